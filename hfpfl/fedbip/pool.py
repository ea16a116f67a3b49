"""The broad public pretraining pool of FedBiP's tiny foundation LDM (the LAION stand-in, DESIGN "honest stand-ins").

Stable Diffusion relates to DomainNet/PACS as follows: it has seen a broad world of styles (sketches, paintings,
clipart, photos) captioned with the content and only generic or partial style words, so a client's rare domain is
*within reach* but not renderable *exactly* from words. This pool builds the same relation for the Digits clients:

* **real public images of every Digits domain** (``load_source(d, "public", seed=POOL_SPLIT_SEED)`` for mnist, usps,
  mnistm, syn): held by no client of a simulation whose data split uses the same seed (the FedBiP recipe keeps the
  data split seed at 0 (``--data_seed 0``) and varies the run seed);
* **many procedural styles** on handwritten (public MNIST / USPS) and font-rendered digit shapes: plain, inverted,
  random colours, photo backgrounds, photo-textured digits and MNIST-M-like photo blends (scikit-image photos and
  textures), bold / thin strokes, blur, noise, low resolution;
* **captions** ``"a photo of the digit seven"`` or, half of the time, ``"a {word} photo of the digit seven"`` with one
  generic or partial word of the applied style (``blurry``, ``colored``, ``textured``, ``printed``, ...). No caption
  names a client domain (``usps``, ``mnistm``, ``syn``), and no word pins one down: "textured" covers photo
  backgrounds, textured strokes and MNIST-M-like blends alike.

Everything is deterministic in ``seed``; images are uint8 (N, 28, 28, 3), labels int64, captions str, plus the style
name of every image (for the per-style sample grid and the judge's per-style accuracy).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

POOL_SPLIT_SEED = 0  # the data-split seed whose "public" split feeds the pool (clients hold only train/test splits)
DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")

# generic / partial caption words per style (a caption carries at most one of them)
STYLE_WORDS = {
    "plain": ("white", "black", "handwritten"),
    "inverted": ("inverted", "white", "black"),
    "colored": ("colored", "colorful"),
    "photo-background": ("photo", "textured", "colorful"),
    "photo-stroke": ("textured", "colored"),
    "photo-blend": ("textured", "blended", "colorful"),
    "gray-texture": ("textured", "gray"),
    # real public images of the Digits domains: only generic words
    "public-mnist": ("handwritten", "white"),
    "public-usps": ("handwritten", "blurry"),
    "public-mnistm": ("textured", "colored"),
    "public-syn": ("printed", "colored"),
}
MODIFIER_WORDS = {"bold": ("bold", "thick"), "thin": ("thin",), "blur": ("blurry",), "noise": ("noisy",),
                  "lowres": ("blurry", "small")}
#: every word a pool caption may use (the tiny tokenizer must know each as one token)
CAPTION_WORDS = tuple(sorted({w for ws in list(STYLE_WORDS.values()) + list(MODIFIER_WORDS.values()) for w in ws}))
#: words the per-style sample grid prompts with ("" = the plain prompt)
GRID_WORDS = ("", "handwritten", "printed", "inverted", "colored", "textured", "photo", "blurry", "bold", "noisy")


def caption_word(domain: str | None) -> str | None:
    """The real word a prompt names ``domain`` by: for a Digits domain, the first caption word the pool gives that
    domain's public images (the LDM learnt it with them: ``usps`` -> ``handwritten``, ``mnistm`` -> ``textured``,
    ``syn`` -> ``printed``); any other domain by its own name. Chosen from the LDM's pretraining captions alone, never
    from client data: the domain names themselves are tokens no caption carried, so their embeddings stayed as the
    text encoder was initialised (the paper's "[STY]" is a word its LDM knows, e.g. "sketch")."""
    words = STYLE_WORDS.get(f"public-{domain}")
    return words[0] if words else domain


def caption(label: int, word: str | None = None) -> str:
    """``"a photo of the digit seven"`` or ``"a blurry photo of the digit seven"``."""
    return f"a {word} photo of the digit {DIGIT_NAMES[int(label)]}" if word else \
        f"a photo of the digit {DIGIT_NAMES[int(label)]}"


@functools.lru_cache(maxsize=None)
def _textures() -> tuple[np.ndarray, ...]:
    """Colour photos and grey textures shipped inside scikit-image (RGB uint8)."""
    import skimage.data as skd

    out = []
    for name in ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry", "retina", "colorwheel",
                 "hubble_deep_field", "camera", "brick", "grass", "gravel", "moon", "coins", "clock", "cell", "page"):
        try:
            a = np.asarray(getattr(skd, name)())
        except Exception:  # pragma: no cover - depends on the scikit-image build
            continue
        if a.dtype != np.uint8 or min(a.shape[:2]) < 64:
            continue
        if a.ndim == 2:
            a = np.repeat(a[..., None], 3, axis=2)
        out.append(np.ascontiguousarray(a[..., :3]))
    if not out:  # pragma: no cover
        raise RuntimeError("no scikit-image photos available for the LDM pool")
    return tuple(out)


def _crop(rng, size: int = 28, color_only: bool = False) -> np.ndarray:
    tex = _textures()
    if color_only:  # the colour photos (grey textures are stored as 3 equal channels)
        tex = [t for t in tex if not (np.array_equal(t[..., 0], t[..., 1]) and np.array_equal(t[..., 1], t[..., 2]))]
    p = tex[rng.integers(len(tex))]
    top, left = rng.integers(0, p.shape[0] - size), rng.integers(0, p.shape[1] - size)
    return p[top : top + size, left : left + size].astype(np.float32) / 255.0


def _font_masks(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` grey digit masks rendered with matplotlib's fonts (random font, size, position, rotation)."""
    from PIL import Image, ImageDraw

    from hfpfl.data.sources import _font, _font_paths

    fonts = _font_paths()
    rng = np.random.default_rng([seed, 77])
    masks, labels = np.empty((n, 28, 28), np.float32), np.arange(n) % 10
    big = 56
    for i in range(n):
        canvas = Image.new("L", (big, big), 0)
        draw = ImageDraw.Draw(canvas)
        font = _font(fonts[rng.integers(len(fonts))], int(rng.choice((30, 34, 38, 42, 46))))
        draw.text((big / 2 + rng.uniform(-5, 5), big / 2 + rng.uniform(-5, 5)), str(labels[i]), fill=255,
                  font=font, anchor="mm")
        canvas = canvas.rotate(rng.uniform(-20, 20), resample=Image.BILINEAR).resize((28, 28), Image.BILINEAR)
        masks[i] = np.asarray(canvas, np.float32) / 255.0
    return masks, labels.astype(np.int64)


def _color_pair(rng, contrast: float = 0.35):
    while True:
        fg, bg = rng.uniform(0, 1, 3), rng.uniform(0, 1, 3)
        if abs(float(np.dot(fg - bg, [0.299, 0.587, 0.114]))) > contrast:
            return fg.astype(np.float32), bg.astype(np.float32)


def render_style(mask: np.ndarray, style: str, modifiers: tuple[str, ...], rng) -> np.ndarray:
    """A digit mask (28, 28) in [0, 1] -> RGB float image (28, 28, 3) in [0, 1] in the given style."""
    from scipy import ndimage

    m = mask
    if "bold" in modifiers:
        m = ndimage.grey_dilation(m, size=(2, 2))
    if "thin" in modifiers and (ndimage.grey_erosion(m, size=(2, 2)) > 0.5).sum() > 20:
        m = ndimage.grey_erosion(m, size=(2, 2))
    m3 = m[..., None]
    if style == "plain":
        img = np.repeat(m3, 3, axis=2)
    elif style == "inverted":
        img = 1.0 - np.repeat(m3, 3, axis=2)
    elif style == "colored":
        fg, bg = _color_pair(rng)
        img = m3 * fg + (1 - m3) * bg
    elif style == "photo-background":
        fg = rng.uniform(0, 1, 3).astype(np.float32)
        if rng.random() < 0.5:
            fg = np.full(3, float(rng.random() < 0.5), np.float32)
        img = m3 * fg + (1 - m3) * _crop(rng)
    elif style == "photo-stroke":
        _, bg = _color_pair(rng)
        img = m3 * _crop(rng) + (1 - m3) * bg
    elif style == "photo-blend":
        img = np.abs(_crop(rng, color_only=True) - m3)
    elif style == "gray-texture":
        g = _crop(rng).mean(2, keepdims=True) * 0.6
        img = np.repeat(np.clip(g + m3 * 0.8, 0, 1), 3, axis=2)
    else:
        raise ValueError(f"unknown style {style!r}")
    if "blur" in modifiers:
        img = ndimage.gaussian_filter(img, sigma=(rng.uniform(0.7, 1.4),) * 2 + (0,))
    if "lowres" in modifiers:
        from PIL import Image

        s = int(rng.integers(8, 13))
        im = Image.fromarray((np.clip(img, 0, 1) * 255).astype(np.uint8)).resize((s, s), Image.BILINEAR)
        img = np.asarray(im.resize((28, 28), Image.BILINEAR), np.float32) / 255.0
    if "noise" in modifiers:
        img = img + rng.normal(0, rng.uniform(0.04, 0.1), img.shape).astype(np.float32)
    return np.clip(img, 0, 1)


PROCEDURAL_STYLES = ("plain", "inverted", "colored", "photo-background", "photo-stroke", "photo-blend",
                     "gray-texture")


def _public(domain: str, seed: int):
    from hfpfl.data.sources import load_source

    ds = load_source(domain, split="public", seed=seed).with_format(None)
    imgs = np.stack([np.asarray(im.convert("RGB"), dtype=np.uint8) for im in ds["image"]])
    return imgs, np.asarray(ds["label"], dtype=np.int64)


def build_pool(seed: int = 0, copies: int = 2, font_masks: int = 1500, word_prob: float = 0.5):
    """The pretraining pool: dict(images uint8 (N,28,28,3), labels, captions, styles)."""
    rng = np.random.default_rng([seed, 4242])
    images, labels, captions, styles = [], [], [], []

    def add(img_u8, y, style, words):
        images.append(img_u8)
        labels.append(int(y))
        styles.append(style)
        captions.append(caption(y, rng.choice(words) if words and rng.random() < word_prob else None))

    # 1) real public images of every Digits domain, generic words only
    for d in ("mnist", "usps", "mnistm", "syn"):
        x, y = _public(d, POOL_SPLIT_SEED)
        for im, lab in zip(x, y):
            add(im, lab, f"public-{d}", STYLE_WORDS[f"public-{d}"])
    # 2) procedural styles on handwritten (public mnist + usps) and font-rendered shapes
    shapes = []
    for d in ("mnist", "usps"):
        x, y = _public(d, POOL_SPLIT_SEED)
        shapes += [(im[..., 0].astype(np.float32) / 255.0, lab) for im, lab in zip(x, y)]
    fm, fy = _font_masks(font_masks, seed)
    shapes += list(zip(fm, fy))
    for _ in range(copies):
        for mask, y in shapes:
            style = PROCEDURAL_STYLES[rng.integers(len(PROCEDURAL_STYLES))]
            mods = tuple(m for m, p in (("bold", 0.15), ("thin", 0.15), ("blur", 0.15), ("noise", 0.05),
                                        ("lowres", 0.1)) if rng.random() < p)
            if "bold" in mods and "thin" in mods:
                mods = tuple(m for m in mods if m != "thin")
            img = render_style(mask, style, mods, rng)
            words = STYLE_WORDS[style] + tuple(w for m in mods for w in MODIFIER_WORDS[m])
            add((img * 255).round().astype(np.uint8), y, style, words)
    return {"images": np.stack(images), "labels": np.asarray(labels, np.int64), "captions": captions,
            "styles": styles}


def pool_to_tensor(images, image_size: int = 32) -> torch.Tensor:
    """uint8 (N, 28, 28, 3) -> float (N, 3, S, S) in [-1, 1], resized bilinearly (as the clients' images are)."""
    import torch
    import torch.nn.functional as F

    x = torch.as_tensor(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    if x.shape[-1] != image_size:
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False, antialias=True)
    return x.clamp(-1, 1).contiguous()
