"""Image degradations (as used by the feature-shift papers) and conversion to model inputs.

``degrade(ds, kind, severity, seed)`` returns a copy of an image dataset with every image degraded, each image with
its own draw from a generator seeded by ``(seed, kind, severity)`` (deterministic). Kinds:

* ``noise``    additive Gaussian noise, std (fraction of 255) = 0.08, 0.12, 0.18, 0.26, 0.38 for severity 1..5
               (ImageNet-C ``gaussian_noise`` levels)
* ``color``    colour jitter: brightness, contrast, saturation factors in [1-s, 1+s] and a hue shift in
               [-h, h] with s = 0.2..0.8, h = 0.05..0.25 (grey images become RGB)
* ``rotation`` rotation by an angle uniform in [-a, a], a = 15, 30, 45, 60, 90 degrees

With ``domain_suffix=True`` the ``domain`` column becomes ``"<domain>-<kind>"``: this is how degraded copies become
extra domains (``load_source("digits+noise")`` or ``DataArguments.degradations="noise,rotation"``).
"""

from __future__ import annotations

import numpy as np

from datasets import Array3D, ClassLabel, Dataset, Features, Value

DEGRADATIONS = ("noise", "color", "rotation")
_NOISE_STD = (0.08, 0.12, 0.18, 0.26, 0.38)
_COLOR_S = (0.2, 0.35, 0.5, 0.65, 0.8)
_COLOR_H = (0.05, 0.1, 0.15, 0.2, 0.25)
_ROT_DEG = (15, 30, 45, 60, 90)


def _degrade_one(img, kind: str, sev: int, r: np.random.Generator):
    from PIL import Image as PILImage  # why: PIL only when images are drawn (not at `import hfpfl.data`)
    from PIL import ImageEnhance

    if kind == "noise":
        a = np.asarray(img).astype(np.float32)
        a = a + r.normal(0.0, _NOISE_STD[sev - 1] * 255.0, size=a.shape)
        return PILImage.fromarray(np.clip(a, 0, 255).round().astype(np.uint8), mode=img.mode)
    if kind == "rotation":
        a = np.asarray(img)
        border = np.concatenate([a[0], a[-1], a[:, 0], a[:, -1]]).reshape(-1, *a.shape[2:])
        fill = np.median(border, axis=0).astype(int)  # fill the corners with the background, not black
        fill = int(fill) if fill.ndim == 0 else tuple(int(v) for v in fill)
        angle = float(r.uniform(-_ROT_DEG[sev - 1], _ROT_DEG[sev - 1]))
        return img.rotate(angle, resample=PILImage.BILINEAR, fillcolor=fill)
    if kind == "color":
        img = img.convert("RGB")
        s, h = _COLOR_S[sev - 1], _COLOR_H[sev - 1]
        b, c, sat = r.uniform(1 - s, 1 + s, size=3)
        img = ImageEnhance.Brightness(img).enhance(b)
        img = ImageEnhance.Contrast(img).enhance(c)
        img = ImageEnhance.Color(img).enhance(sat)
        hsv = np.asarray(img.convert("HSV")).copy()
        hsv[..., 0] = (hsv[..., 0].astype(np.int16) + int(round(r.uniform(-h, h) * 255))) % 256
        return PILImage.fromarray(hsv, mode="HSV").convert("RGB")
    raise ValueError(f"unknown degradation {kind!r}; expected one of {DEGRADATIONS}")


def _jitter_fixed(img, factors, r: np.random.Generator):
    """The paper's ColorJitter with fixed factors (brightness b, contrast c, saturation s, hue h in [-0.5, 0.5] of
    the hue circle, as torchvision's adjust_*), the four operations applied in a random order per image."""
    from PIL import Image as PILImage  # why: PIL only when images are drawn (not at `import hfpfl.data`)
    from PIL import ImageEnhance

    b, c, s, h = factors
    img = img.convert("RGB")
    for op in r.permutation(4):
        if op == 0:
            img = ImageEnhance.Brightness(img).enhance(b)
        elif op == 1:
            img = ImageEnhance.Contrast(img).enhance(c)
        elif op == 2:
            img = ImageEnhance.Color(img).enhance(s)
        else:
            hsv = np.asarray(img.convert("HSV")).copy()
            hsv[..., 0] = (hsv[..., 0].astype(np.int16) + int(round(h * 255))) % 256
            img = PILImage.fromarray(hsv, mode="HSV").convert("RGB")
    return img


def color_jitter_fixed(ds: Dataset, factors, seed: int = 0) -> Dataset:
    """Every image of ``ds`` jittered with the same ``factors`` = (brightness, contrast, saturation, hue) in a random
    order per image (deterministic per ``seed``): FedPCE's per-client ColorJitter (paper 000 section 4.2)."""
    gens = np.random.default_rng([int(seed) & 0xFFFFFFFF, 29]).spawn(len(ds))
    factors = tuple(float(f) for f in factors)

    def fn(batch, idx):
        return {"image": [_jitter_fixed(im, factors, gens[i]) for im, i in zip(batch["image"], idx)]}

    return ds.map(fn, batched=True, with_indices=True, batch_size=256, features=ds.features)


def add_input_noise(ds: Dataset, std: float, seed: int = 0) -> Dataset:
    """Additive pixel-wise Gaussian noise N(0, std^2) on the [0, 1] image scale, added to model inputs
    (``pixel_values`` in [-1, 1], so 2 * std there) and **not clamped**: FedPCE's Gaussian-noise clients (paper 000
    section 4.2, variances linspace(0.005, 1, M); no clamping as in spec fedpce.md section 6 #18). One fixed draw
    per image (deterministic per ``seed``; the paper resamples at every load)."""
    gens = np.random.default_rng([int(seed) & 0xFFFFFFFF, 31]).spawn(len(ds))

    def fn(batch, idx):
        x = np.asarray(batch["pixel_values"], dtype=np.float32)
        noise = np.stack([gens[i].standard_normal(x.shape[1:]) for i in idx]).astype(np.float32)
        return {"pixel_values": x + np.float32(2.0 * std) * noise}

    return ds.with_format("numpy").map(fn, batched=True, with_indices=True, batch_size=512,
                                       features=ds.features).with_format("torch")


def degrade(ds: Dataset, kind: str, severity: int = 3, seed: int = 0, domain_suffix: bool = False) -> Dataset:
    """Degrade every image of ``ds`` (columns ``image``, optional ``domain``); deterministic per ``seed``."""
    if kind not in DEGRADATIONS:
        raise ValueError(f"unknown degradation {kind!r}; expected one of {DEGRADATIONS}")
    if not 1 <= int(severity) <= 5:
        raise ValueError(f"severity must be in 1..5, got {severity}")
    sev = int(severity)
    r = np.random.default_rng([int(seed) & 0xFFFFFFFF, DEGRADATIONS.index(kind), sev])
    # one child generator per image: image i's degradation does not depend on how the map is batched
    gens = r.spawn(len(ds))

    def fn(batch, idx):
        out = {"image": [_degrade_one(im, kind, sev, gens[i]) for im, i in zip(batch["image"], idx)]}
        if domain_suffix and "domain" in batch:
            out["domain"] = [f"{d}-{kind}" for d in batch["domain"]]
        return out

    return ds.map(fn, batched=True, with_indices=True, batch_size=256, features=ds.features)


def to_model_inputs(ds: Dataset, image_size: int = 28, num_channels: int = 3) -> Dataset:
    """Images -> ``pixel_values`` float32 [C,H,W] in [-1, 1] ((x/255 - 0.5) / 0.5), ``label`` -> ``labels``
    (ClassLabel, int64 tensors); every other column (e.g. ``domain``) is kept. Returned in torch format.

    Grey images are repeated to RGB when ``num_channels == 3``; colour images are converted to ``L`` when
    ``num_channels == 1``. Images of another size are resized (bilinear).
    """
    from PIL import Image as PILImage  # why: PIL only when images are drawn (not at `import hfpfl.data`)

    if num_channels not in (1, 3):
        raise ValueError(f"num_channels must be 1 or 3, got {num_channels}")
    if "image" not in ds.column_names or "label" not in ds.column_names:
        raise ValueError(f"to_model_inputs needs 'image' and 'label' columns, got {ds.column_names}")
    mode = "RGB" if num_channels == 3 else "L"
    size = (int(image_size), int(image_size))

    def fn(batch):
        arrs = []
        for im in batch["image"]:
            if im.mode != mode:
                im = im.convert(mode)
            if im.size != size:
                im = im.resize(size, PILImage.BILINEAR)
            arrs.append(np.asarray(im, dtype=np.uint8))
        x = np.stack(arrs)
        x = x[:, None] if x.ndim == 3 else x.transpose(0, 3, 1, 2)
        x = x.astype(np.float32) * (2.0 / 255.0) - 1.0
        return {"pixel_values": x, "labels": batch["label"]}

    feats = {k: v for k, v in ds.features.items() if k not in ("image", "label")}
    label_feat = ds.features["label"]
    features = Features(
        {
            "pixel_values": Array3D(shape=(num_channels, *size), dtype="float32"),
            "labels": label_feat if isinstance(label_feat, ClassLabel) else Value("int64"),
            **feats,
        }
    )
    out = ds.map(fn, batched=True, batch_size=512, remove_columns=["image", "label"], features=features)
    return out.with_format("torch")
