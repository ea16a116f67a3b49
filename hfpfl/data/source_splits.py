"""The deterministic train/test/public split every image source shares, and the seeded generator behind it and
behind the built-in renderings (:mod:`hfpfl.data.sources` describes the fractions)."""
from __future__ import annotations

import hashlib

import numpy as np

SPLITS = ("train", "test", "public")
SPLIT_FRACTIONS = {"train": 0.70, "test": 0.15, "public": 0.15}


def _rng(*keys) -> np.random.Generator:
    """A generator seeded by a tuple of ints/strings (strings hashed stably, unlike ``hash()``)."""
    ints = []
    for k in keys:
        if isinstance(k, str):
            ints.append(int.from_bytes(hashlib.sha256(k.encode()).digest()[:4], "little"))
        else:
            ints.append(int(k) & 0xFFFFFFFF)
    return np.random.default_rng(ints)



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
