"""Out-of-domain image pools, offline: what ImageNet is to CIFAR for the Digits clients (backbone pretraining), and
what CIFAR-100 is to CIFAR-10 (unlabelled server-side distillation data, PerAda / FedDF).

No client holds any class or image of these pools:

* classes: letters and symbols (Latin, Greek, punctuation/maths) rendered in every TTF font that matplotlib ships,
  procedural shapes, procedural textures, and crops of scikit-image photos; *no digit glyph* and no glyph that
  renders like a digit in common fonts (O, o, I, l, Z, S, B, b, g, q, ...; see :data:`_EXCLUDED_GLYPHS`);
* images: rendered here, on backgrounds cut from scikit-image photos that the client domains do *not* use (the
  MNIST-M-style client domain blends digits into astronaut/coffee/chelsea/rocket/immunohistochemistry: those photos,
  and ``cat`` = chelsea, are excluded, see :data:`CLIENT_PHOTOS`), plus LFW face crops;
* many styles: random fonts, colours, sizes, positions, rotations, blur, inversion, grey or colour, textured/photo
  backgrounds, noise.

Two disjoint index ranges of the same generator (the content of sample ``i`` depends only on ``i``):
``pretrain`` (labelled, for the stand-in backbones ``hfpfl/tiny-resnet-ood`` / ``hfpfl/tiny-vit-ood``) and ``kd``
(served unlabelled to the server for distillation).  ``load_ood(split, n)`` returns a :class:`datasets.Dataset`
with the same columns as :func:`hfpfl.data.load_source` (``image``, ``label``, ``domain`` = the class family).
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np

import datasets
from datasets import ClassLabel, Dataset, Features, Image, Value

from .builtin_sources import _font, _font_paths, _load_npz, _save_npz
from .source_splits import _rng

OOD_VERSION = "ood-v1"  # bump when the rendering changes (keys the disk cache and the stand-ins' recipe)
SIZE = 28

# glyphs that look like a digit in some font: 0 O o Q D Θ σ; 1 I l i j | !; 2 Z z ?; 3 ε; 5 S s § $; 6 b G δ; 7 T; 8 B β;
# 9 g q; £ (a 2/L hybrid)
_EXCLUDED_GLYPHS = set("0123456789OoQDIlijZzSsbGBgqT|!δβΘσε§$?£")
_LATIN = [c for c in "ABCEFHJKLMNPRUVWXYacdefhkmnprtuvwxy" if c not in _EXCLUDED_GLYPHS]
_GREEK = [c for c in "ΓΔΛΞΠΣΦΨΩαλμπφψω" if c not in _EXCLUDED_GLYPHS]
_SYMBOLS = [c for c in "#%&@*+=<>¶€¥" if c not in _EXCLUDED_GLYPHS]
GLYPHS = tuple(_LATIN + _GREEK + _SYMBOLS)
SHAPES = ("circle", "square", "triangle", "star", "cross", "ring", "hexagon", "diamond", "crescent", "arrow")
TEXTURES = ("stripes", "checker", "dots", "grid", "waves", "rings", "blobs", "noise")
# scikit-image photos the client domains never use (see CLIENT_PHOTOS); each is a class ("which photo is this crop
# from"), and the same photos serve as backgrounds for glyphs and shapes
PHOTOS = ("camera", "coins", "clock", "moon", "hubble_deep_field", "retina", "stereo_motorcycle", "grass", "gravel",
          "brick", "cell", "colorwheel")
#: photos that client data is built from (builtin_sources._photos: MNIST-M-style backgrounds); never used here
CLIENT_PHOTOS = ("astronaut", "coffee", "chelsea", "cat", "rocket", "immunohistochemistry")

CLASS_NAMES = tuple([f"glyph:{g}" for g in GLYPHS] + [f"shape:{s}" for s in SHAPES]
                    + [f"texture:{t}" for t in TEXTURES] + [f"photo:{p}" for p in PHOTOS] + ["photo:face"])
NUM_CLASSES = len(CLASS_NAMES)
SPLIT_OFFSET = {"pretrain": 0, "kd": 10_000_000}  # disjoint index ranges: no image is in both


@functools.lru_cache(maxsize=None)
def _cmaps() -> dict[str, frozenset]:
    from fontTools.ttLib import TTFont  # why: only when the out-of-domain glyphs are rendered

    out = {}
    for path in _font_paths():
        try:
            out[path] = frozenset((TTFont(path, lazy=True).getBestCmap() or {}).keys())
        except Exception:  # pragma: no cover - unreadable font
            continue
    return out


@functools.lru_cache(maxsize=None)
def _fonts_for(glyph: str) -> tuple[str, ...]:
    """matplotlib's fonts whose character map has ``glyph`` (no tofu boxes or blanks)."""
    out = tuple(p for p, cmap in _cmaps().items() if ord(glyph) in cmap)
    if not out:
        raise RuntimeError(f"no matplotlib font renders {glyph!r}")
    return out


def _family(label: int) -> str:
    return CLASS_NAMES[label].split(":", 1)[0]


@functools.lru_cache(maxsize=None)
def _photo(name: str) -> np.ndarray:
    import skimage.data as skd  # why: only when photos are read (not at `import hfpfl.data`)

    if name in CLIENT_PHOTOS:
        raise ValueError(f"{name!r} is used by client data; out-of-domain pools must not use it")
    img = getattr(skd, name)()
    if isinstance(img, tuple):
        img = img[0]
    img = np.asarray(img)
    if img.dtype != np.uint8:
        img = (np.clip(img.astype(np.float64), 0, 1) * 255).round().astype(np.uint8)
    if img.ndim == 2:
        img = np.repeat(img[..., None], 3, axis=2)
    return np.ascontiguousarray(img[..., :3])


@functools.lru_cache(maxsize=None)
def _faces() -> np.ndarray:
    import skimage.data as skd  # why: only when photos are read (not at `import hfpfl.data`)

    f = np.asarray(skd.lfw_subset())  # 200 x 25 x 25 float in [0, 1]
    return (np.clip(f, 0, 1) * 255).round().astype(np.uint8)


def _crop(img: np.ndarray, r: np.random.Generator, size: int) -> np.ndarray:
    from PIL import Image as PILImage  # why: PIL only when images are drawn (not at `import hfpfl.data`)

    h, w = img.shape[:2]
    side = int(r.integers(max(8, min(h, w) // 8), max(9, min(h, w) // 2)))
    top, left = int(r.integers(0, h - side + 1)), int(r.integers(0, w - side + 1))
    patch = PILImage.fromarray(img[top:top + side, left:left + side])
    return np.asarray(patch.resize((size, size), PILImage.BILINEAR))


def _colour(r, avoid=None):
    while True:
        c = r.integers(0, 256, size=3)
        if avoid is None or abs(float(np.dot(c - avoid, [0.299, 0.587, 0.114]))) > 80:
            return c


def _texture(kind: str, r: np.random.Generator, size: int) -> np.ndarray:
    """Grey texture in [0, 1], random frequency/phase/orientation."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64) / size
    th = r.uniform(0, np.pi)
    u = xx * np.cos(th) + yy * np.sin(th)
    f = r.uniform(3, 8)
    ph = r.uniform(0, 2 * np.pi)
    if kind == "stripes":
        t = (np.sin(2 * np.pi * f * u + ph) > 0).astype(float)
    elif kind == "checker":
        v = -xx * np.sin(th) + yy * np.cos(th)
        t = ((np.floor(f * u) + np.floor(f * v)) % 2).astype(float)
    elif kind == "dots":
        v = -xx * np.sin(th) + yy * np.cos(th)
        t = ((np.sin(2 * np.pi * f * u) * np.sin(2 * np.pi * f * v)) > 0.5).astype(float)
    elif kind == "grid":
        v = -xx * np.sin(th) + yy * np.cos(th)
        t = (((f * u) % 1 < 0.18) | ((f * v) % 1 < 0.18)).astype(float)
    elif kind == "waves":
        t = 0.5 + 0.5 * np.sin(2 * np.pi * f * u + 2.5 * np.sin(2 * np.pi * r.uniform(1, 3) * (yy + xx)) + ph)
    elif kind == "rings":
        cx, cy = r.uniform(0.2, 0.8, size=2)
        t = 0.5 + 0.5 * np.sin(2 * np.pi * f * np.hypot(xx - cx, yy - cy) * 2 + ph)
    elif kind == "blobs":
        n = int(r.integers(4, 9))
        t = np.zeros_like(xx)
        for _ in range(n):
            cx, cy, s = r.uniform(0, 1), r.uniform(0, 1), r.uniform(0.05, 0.15)
            t += np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * s * s))
        t = np.clip(t, 0, 1)
    elif kind == "noise":
        coarse = r.uniform(0, 1, size=(int(r.integers(3, 8)),) * 2)
        from PIL import Image as PILImage  # why: PIL only when images are drawn (not at `import hfpfl.data`)

        t = np.asarray(PILImage.fromarray((coarse * 255).astype(np.uint8)).resize((size, size), PILImage.BICUBIC))
        t = t.astype(float) / 255.0
    else:  # pragma: no cover
        raise ValueError(kind)
    return t


def _shape_mask(kind: str, r: np.random.Generator, big: int):
    from PIL import Image as PILImage  # why: PIL only when images are drawn (not at `import hfpfl.data`)
    from PIL import ImageDraw

    m = PILImage.new("L", (big, big), 0)
    d = ImageDraw.Draw(m)
    c = big / 2 + r.uniform(-big * 0.1, big * 0.1, size=2)
    s = big * r.uniform(0.22, 0.38)
    rot = r.uniform(0, 360)
    if kind == "circle":
        d.ellipse([c[0] - s, c[1] - s, c[0] + s, c[1] + s], fill=255)
    elif kind == "ring":
        d.ellipse([c[0] - s, c[1] - s, c[0] + s, c[1] + s], fill=255)
        d.ellipse([c[0] - 0.55 * s, c[1] - 0.55 * s, c[0] + 0.55 * s, c[1] + 0.55 * s], fill=0)
    elif kind == "crescent":
        d.ellipse([c[0] - s, c[1] - s, c[0] + s, c[1] + s], fill=255)
        o = 0.5 * s * np.array([np.cos(np.radians(rot)), np.sin(np.radians(rot))])
        d.ellipse([c[0] + o[0] - s, c[1] + o[1] - s, c[0] + o[0] + s, c[1] + o[1] + s], fill=0)
    else:
        if kind == "square":
            pts = [(np.cos(a), np.sin(a)) for a in np.radians([45, 135, 225, 315])]
        elif kind == "diamond":
            pts = [(0.6 * np.cos(a), np.sin(a)) for a in np.radians([0, 90, 180, 270])]
        elif kind == "triangle":
            pts = [(np.cos(a), np.sin(a)) for a in np.radians([90, 210, 330])]
        elif kind == "hexagon":
            pts = [(np.cos(a), np.sin(a)) for a in np.radians(np.arange(0, 360, 60))]
        elif kind == "star":
            pts = [((1.0 if k % 2 == 0 else 0.42) * np.cos(a), (1.0 if k % 2 == 0 else 0.42) * np.sin(a))
                   for k, a in enumerate(np.radians(np.arange(90, 450, 36)))]
        elif kind == "cross":
            w = 0.33
            pts = [(-w, -1), (w, -1), (w, -w), (1, -w), (1, w), (w, w), (w, 1), (-w, 1), (-w, w), (-1, w), (-1, -w),
                   (-w, -w)]
        elif kind == "arrow":
            pts = [(-1, -0.3), (0.2, -0.3), (0.2, -0.75), (1, 0), (0.2, 0.75), (0.2, 0.3), (-1, 0.3)]
        else:  # pragma: no cover
            raise ValueError(kind)
        a = np.radians(rot)
        rm = np.array([[np.cos(a), -np.sin(a)], [np.sin(a), np.cos(a)]])
        xy = (np.asarray(pts) @ rm.T) * s + c
        d.polygon([tuple(p) for p in xy], fill=255)
    return m


def _background(r: np.random.Generator, big: int) -> np.ndarray:
    """uint8 [big, big, 3]: solid, gradient, texture or a crop of an out-of-domain photo."""
    kind = r.choice(["solid", "gradient", "texture", "photo"], p=[0.35, 0.2, 0.2, 0.25])
    if kind == "solid":
        return np.broadcast_to(_colour(r), (big, big, 3)).astype(np.uint8)
    if kind == "gradient":
        a, b = _colour(r).astype(float), _colour(r).astype(float)
        t = _texture("waves", r, big)[..., None] * 0.3 + np.linspace(0, 1, big)[None, :, None] * 0.7
        return (a * (1 - t) + b * t).clip(0, 255).astype(np.uint8)
    if kind == "texture":
        t = _texture(str(r.choice(TEXTURES)), r, big)[..., None]
        a, b = _colour(r).astype(float), _colour(r).astype(float)
        return (a * (1 - 0.5 * t) + b * 0.5 * t).clip(0, 255).astype(np.uint8)
    return _crop(_photo(str(r.choice(PHOTOS))), r, big)


def _render(i: int) -> tuple[np.ndarray, int]:
    """(uint8 [28, 28, 3], label) of pool sample ``i`` (depends on ``i`` only)."""
    from PIL import Image as PILImage  # why: PIL only when images are drawn (not at `import hfpfl.data`)
    from PIL import ImageDraw, ImageFilter

    r = _rng(OOD_VERSION, int(i))
    label = int(i) % NUM_CLASSES
    name = CLASS_NAMES[label]
    fam, what = name.split(":", 1)
    big = 2 * SIZE
    if fam in ("glyph", "shape"):
        bg = _background(r, big)
        mean_bg = bg.reshape(-1, 3).mean(0)
        fg = _colour(r, avoid=mean_bg)
        if fam == "glyph":
            fonts = _fonts_for(what)
            mask = PILImage.new("L", (big, big), 0)
            font = _font(fonts[int(r.integers(len(fonts)))], int(r.choice((28, 32, 36, 40))))
            ImageDraw.Draw(mask).text((big / 2 + r.uniform(-5, 5), big / 2 + r.uniform(-5, 5)), what, fill=255,
                                      font=font, anchor="mm")
            mask = mask.rotate(r.uniform(-25, 25), resample=PILImage.BILINEAR)
        else:
            mask = _shape_mask(what, r, big)
        m = np.asarray(mask, dtype=np.float64)[..., None] / 255.0
        if r.uniform() < 0.25:  # textured foreground
            t = _texture(str(r.choice(TEXTURES)), r, big)[..., None]
            fgimg = fg[None, None] * (0.6 + 0.4 * t)
        else:
            fgimg = np.broadcast_to(fg, (big, big, 3))
        img = bg * (1 - m) + fgimg * m
    elif fam == "texture":
        t = _texture(what, r, big)[..., None]
        a, b = _colour(r).astype(float), _colour(r, avoid=None).astype(float)
        img = a * (1 - t) + b * t
    else:  # photo crops and faces
        if what == "face":
            f = _faces()[int(r.integers(len(_faces())))]
            img = np.asarray(PILImage.fromarray(f).resize((big, big), PILImage.BILINEAR), dtype=np.float64)
            img = np.repeat(img[..., None], 3, axis=2)
            if r.uniform() < 0.5:  # tint
                img = img * (0.5 + 0.5 * _colour(r)[None, None] / 255.0)
        else:
            img = _crop(_photo(what), r, big).astype(np.float64)
    img = np.clip(img, 0, 255).astype(np.uint8)
    pil = PILImage.fromarray(img)
    # styles: inversion, greyscale, blur, noise
    if r.uniform() < 0.15:
        pil = PILImage.fromarray(255 - np.asarray(pil))
    if r.uniform() < 0.25:
        pil = pil.convert("L").convert("RGB")
    pil = pil.resize((SIZE, SIZE), PILImage.BILINEAR)
    if r.uniform() < 0.3:
        pil = pil.filter(ImageFilter.GaussianBlur(r.uniform(0.3, 1.0)))
    out = np.asarray(pil, dtype=np.float64)
    if r.uniform() < 0.2:
        out = out + r.normal(0, r.uniform(5, 25), size=out.shape)
    return np.clip(out, 0, 255).round().astype(np.uint8), label


def ood_arrays(split: str = "pretrain", n: int = 12_000) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 [n, 28, 28, 3], labels int64 [n]) of the first ``n`` samples of ``split`` ("pretrain" or "kd");
    cached on disk under ``$HF_DATASETS_CACHE/hfpfl/``. Class-balanced: label = index % NUM_CLASSES."""
    if split not in SPLIT_OFFSET:
        raise ValueError(f"unknown out-of-domain split {split!r}; expected one of {tuple(SPLIT_OFFSET)}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    cache = Path(datasets.config.HF_DATASETS_CACHE) / "hfpfl" / f"{OOD_VERSION}-{split}-{n}.npz"
    cached = _load_npz(cache)
    if cached is not None:
        return cached
    start = SPLIT_OFFSET[split]
    x = np.empty((n, SIZE, SIZE, 3), dtype=np.uint8)
    y = np.empty(n, dtype=np.int64)
    for j in range(n):
        x[j], y[j] = _render(start + j)
    if os.environ.get("HFPFL_NO_DATA_CACHE") != "1":
        _save_npz(cache, x, y)
    return x, y


def load_ood(split: str = "pretrain", n: int = 12_000) -> Dataset:
    """The out-of-domain pool as a ``Dataset`` (``image``, ``label`` = ClassLabel(:data:`CLASS_NAMES`), ``domain`` =
    class family: glyph / shape / texture / photo)."""
    x, y = ood_arrays(split, n)
    feats = Features({"image": Image(), "label": ClassLabel(names=list(CLASS_NAMES)), "domain": Value("string")})
    return Dataset.from_dict({"image": list(x), "label": y.tolist(), "domain": [_family(int(v)) for v in y]},
                             features=feats)


def describe() -> str:
    """One paragraph for model cards."""
    return (f"{NUM_CLASSES} out-of-domain classes ({len(GLYPHS)} letters/symbols rendered in matplotlib's "
            f"{len(_font_paths())} TTF fonts, {len(SHAPES)} shapes, {len(TEXTURES)} textures, {len(PHOTOS)} "
            f"scikit-image photo sources + LFW faces) in many styles (fonts, colours, rotation, blur, inversion, "
            f"grey/colour, textured and photo backgrounds, noise); no digit glyph or digit-like glyph, no client "
            f"photo ({', '.join(CLIENT_PHOTOS)}); {OOD_VERSION}")
