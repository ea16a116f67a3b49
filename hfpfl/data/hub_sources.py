"""Hub datasets and local data (``owner/name``, ``imagefolder:<dir>``, ``parquet:<path-or-glob>``) as image
sources: loading (offline at once, with the command that fixes it), column normalisation, and the split."""
from __future__ import annotations

import os
import re
from pathlib import Path

import huggingface_hub.constants as hc
import numpy as np

import datasets
from datasets import ClassLabel, Dataset, Features, Image, Value

from .builtin_sources import SOURCES
from .source_splits import _rng, _split_cap, _stratified_split

_IMAGE_COLUMNS = ("image", "img", "images", "picture", "image_file", "png", "jpg")
_LABEL_COLUMNS = ("label", "labels", "fine_label", "class", "target", "category", "coarse_label", "y")
_DOMAIN_COLUMNS = ("domain", "domains", "style", "environment")


class SourceUnavailableError(RuntimeError, OSError):
    """A Hub dataset could not be loaded (typically: offline and not cached)."""


def _is_offline() -> bool:
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
