"""Partitioners: one ``datasets.Dataset`` in, one ``Dataset`` per client out.

Flower Datasets' partitioners do the work wherever they exist (``partitioner.dataset = ds`` then
``load_partition(i)``); the two schemes Flower lacks are written here (``feature_shift``, ``concept_drift``).

======================  ==========================================================================================
scheme                  what / keyword arguments
======================  ==========================================================================================
``iid``                 shuffle (seed) + Flower ``IidPartitioner`` (equal contiguous shards of the shuffled data)
``dirichlet``           Flower ``DirichletPartitioner`` on ``label``: ``alpha`` (0.5), ``min_partition_size`` (10),
                        ``self_balancing`` (False)
``pathological``        Flower ``PathologicalPartitioner``: exactly ``classes_per_client`` (2) classes per client
``shards``              Flower ``ShardPartitioner``: ``num_shards_per_partition`` (2) label-sorted shards per client
``quantity``            quantity skew, label distribution IID: ``quantity_mode`` = ``"dirichlet"`` (default: sizes
                        proportional to Dir(``alpha``), at least ``min_partition_size`` each, Flower
                        ``SizePartitioner``), ``"linear"`` or ``"exponential"`` (Flower ``Linear``/
                        ``ExponentialPartitioner``)
``feature_shift``       one domain per client, several clients per domain (``column`` = ``"domain"``)
``concept_drift``       same P(x), different P(y|x) between client groups (``num_concepts`` = 2)
``natural_id``          Flower ``NaturalIdPartitioner`` by a column (``column`` = ``"domain"``): one client per value
``label_quantity``      #M of NIID-Bench / the adapters paper: ``classes_per_client`` labels, client i's first i mod K
======================  ==========================================================================================

Every scheme is deterministic per ``seed``; an empty client raises ``ValueError`` naming the client.
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np

from datasets import Dataset

from ._flwr import partitioner_module

logger = logging.getLogger(__name__)


def _fp():
    """``flwr_datasets.partitioner`` (imported lazily, see :mod:`hfpfl.data._flwr`)."""
    return partitioner_module()


def _check_common(ds: Dataset, num_partitions: int) -> None:
    if not isinstance(num_partitions, (int, np.integer)) or num_partitions < 1:
        raise ValueError(f"num_partitions must be a positive integer, got {num_partitions!r}")
    if num_partitions > len(ds):
        raise ValueError(
            f"cannot make {num_partitions} partitions from {len(ds)} samples: use fewer clients or a larger source "
            f"(e.g. raise max_per_domain)"
        )


def _check_nonempty(parts: list[Dataset], scheme: str, hint: str) -> list[Dataset]:
    for i, p in enumerate(parts):
        if len(p) == 0:
            raise ValueError(f"partition scheme {scheme!r} left client {i} with no samples: {hint}")
    return parts


def _shuffled(ds: Dataset, seed: int) -> Dataset:
    return ds.shuffle(seed=seed)


def _flower(partitioner, ds: Dataset, n: int) -> list[Dataset]:
    partitioner.dataset = ds
    return [partitioner.load_partition(i) for i in range(n)]


def iid(ds: Dataset, num_partitions: int, seed: int = 0, **_) -> list[Dataset]:
    """IID: Flower's ``IidPartitioner`` cuts contiguous shards and has no seed, so the data is shuffled first."""
    IidPartitioner = _fp().IidPartitioner

    _check_common(ds, num_partitions)
    parts = _flower(IidPartitioner(num_partitions), _shuffled(ds, seed), num_partitions)
    return _check_nonempty(parts, "iid", "use fewer clients")


def dirichlet(
    ds: Dataset,
    num_partitions: int,
    seed: int = 0,
    alpha: float = 0.5,
    min_partition_size: int = 10,
    self_balancing: bool = False,
    partition_by: str = "label",
    **_,
) -> list[Dataset]:
    """Label skew: per class, proportions over clients ~ Dir(alpha) (Flower ``DirichletPartitioner``)."""
    DirichletPartitioner = _fp().DirichletPartitioner

    if alpha is None or float(alpha) <= 0:
        raise ValueError(f"dirichlet alpha must be > 0, got {alpha}")
    _check_common(ds, num_partitions)
    if min_partition_size * num_partitions > len(ds):
        raise ValueError(
            f"dirichlet: {num_partitions} clients x min_partition_size={min_partition_size} > {len(ds)} samples: "
            f"use fewer clients or a smaller min_partition_size"
        )
    p = DirichletPartitioner(
        num_partitions=num_partitions,
        partition_by=partition_by,
        alpha=float(alpha),
        min_partition_size=int(min_partition_size),
        self_balancing=self_balancing,
        shuffle=True,
        seed=seed,
    )
    try:
        parts = _flower(p, ds, num_partitions)
    except ValueError as e:
        raise ValueError(
            f"dirichlet partitioning failed ({e}). Use fewer clients, a larger alpha (now {alpha}) or a smaller "
            f"min_partition_size (now {min_partition_size})"
        ) from e
    return _check_nonempty(parts, "dirichlet", "use fewer clients, a larger alpha or min_partition_size >= 1")


def pathological(
    ds: Dataset, num_partitions: int, seed: int = 0, classes_per_client: int = 2, partition_by: str = "label", **_
) -> list[Dataset]:
    """Each client holds exactly ``classes_per_client`` classes (Flower ``PathologicalPartitioner``, random mode)."""
    PathologicalPartitioner = _fp().PathologicalPartitioner

    _check_common(ds, num_partitions)
    n_classes = len(set(ds[partition_by]))
    if not 1 <= classes_per_client <= n_classes:
        raise ValueError(f"--classes_per_client must be in 1..{n_classes} (the labels of this dataset), got "
                         f"{classes_per_client}")
    p = PathologicalPartitioner(
        num_partitions=num_partitions,
        partition_by=partition_by,
        num_classes_per_partition=int(classes_per_client),
        class_assignment_mode="random",
        shuffle=True,
        seed=seed,
    )
    parts = _flower(p, ds, num_partitions)
    return _check_nonempty(parts, "pathological", "use fewer clients or more classes_per_client")


def shards(
    ds: Dataset, num_partitions: int, seed: int = 0, num_shards_per_client: int = 2, partition_by: str = "label", **kw
) -> list[Dataset]:
    """McMahan et al. shards: data sorted by label, cut into shards, ``num_shards_per_client`` per client
    (Flower ``ShardPartitioner``)."""
    ShardPartitioner = _fp().ShardPartitioner

    _check_common(ds, num_partitions)
    k = int(kw.get("num_shards_per_partition", num_shards_per_client))
    if k * num_partitions > len(ds):
        raise ValueError(f"shards: {num_partitions} clients x {k} shards > {len(ds)} samples: use fewer clients")
    p = ShardPartitioner(
        num_partitions=num_partitions, partition_by=partition_by, num_shards_per_partition=k, shuffle=True, seed=seed
    )
    parts = _flower(p, ds, num_partitions)
    return _check_nonempty(parts, "shards", "use fewer clients or fewer shards per client")


def quantity(
    ds: Dataset,
    num_partitions: int,
    seed: int = 0,
    alpha: float = 0.5,
    min_partition_size: int = 10,
    quantity_mode: str = "dirichlet",
    **_,
) -> list[Dataset]:
    """Quantity skew with IID labels. ``dirichlet``: client sizes ~ Dir(alpha) * N (at least ``min_partition_size``),
    cut with Flower's ``SizePartitioner`` (Flower has no seeded Dirichlet-size partitioner); ``linear`` /
    ``exponential``: Flower's ``LinearPartitioner`` / ``ExponentialPartitioner``. The data is shuffled first."""
    fp = _fp()
    ExponentialPartitioner, LinearPartitioner, SizePartitioner = (
        fp.ExponentialPartitioner, fp.LinearPartitioner, fp.SizePartitioner)

    _check_common(ds, num_partitions)
    shuffled = _shuffled(ds, seed)
    if quantity_mode == "linear":
        p = LinearPartitioner(num_partitions)
    elif quantity_mode == "exponential":
        p = ExponentialPartitioner(num_partitions)
    elif quantity_mode == "dirichlet":
        if alpha is None or float(alpha) <= 0:
            raise ValueError(f"quantity alpha must be > 0, got {alpha}")
        n = len(ds)
        m = max(1, int(min_partition_size))
        if m * num_partitions > n:
            raise ValueError(
                f"quantity: {num_partitions} clients x min_partition_size={m} > {n} samples: "
                f"use fewer clients or a smaller min_partition_size"
            )
        q = np.random.default_rng([seed, 7]).dirichlet([float(alpha)] * num_partitions)
        sizes = m + np.floor(q * (n - m * num_partitions)).astype(int)
        sizes[np.argmax(q)] += n - sizes.sum()
        p = SizePartitioner(sizes.tolist())
    else:
        raise ValueError(f"quantity_mode must be 'dirichlet', 'linear' or 'exponential', got {quantity_mode!r}")
    parts = _flower(p, shuffled, num_partitions)
    return _check_nonempty(parts, "quantity", "use fewer clients or a larger min_partition_size")


def feature_shift(ds: Dataset, num_partitions: int, seed: int = 0, column: str = "domain", **_) -> list[Dataset]:
    """One domain per client, several clients per domain (FedBN / FRAug / FedPCE setting).

    Written here because Flower's ``NaturalIdPartitioner`` makes exactly one partition per domain. Clients are
    assigned round-robin to the domains in order of first appearance (client i -> domain i % D); each domain's data is
    shuffled (seed) and split IID (Flower ``IidPartitioner``) among its clients. With fewer clients than domains
    the remaining domains are unused (a warning is logged).
    """
    IidPartitioner = _fp().IidPartitioner

    _check_common(ds, num_partitions)
    if column not in ds.column_names:
        raise ValueError(f"feature_shift needs a {column!r} column; got {ds.column_names}")
    values = ds[column]
    domains = list(dict.fromkeys(values))
    if num_partitions < len(domains):
        logger.warning("feature_shift: %d clients < %d domains; domains %s get no client",
                       num_partitions, len(domains), domains[num_partitions:])
    values = np.asarray(values, dtype=object)
    parts: list[Dataset | None] = [None] * num_partitions
    for d_i, d in enumerate(domains):
        clients = list(range(d_i, num_partitions, len(domains)))
        if not clients:
            continue
        idx = np.flatnonzero(values == d)
        if len(clients) > len(idx):
            raise ValueError(
                f"feature_shift: domain {d!r} has {len(idx)} samples for {len(clients)} clients "
                f"(client {clients[len(idx)]} would be empty): use fewer clients"
            )
        sub = ds.select(idx).shuffle(seed=seed + d_i)
        for j, p in zip(clients, _flower(IidPartitioner(len(clients)), sub, len(clients))):
            parts[j] = p
    return _check_nonempty(parts, "feature_shift", "use fewer clients")  # type: ignore[arg-type]


def concept_drift_permutations(num_labels: int, num_concepts: int, seed: int = 0) -> list[np.ndarray]:
    """Label permutations per concept group: group 0 is the identity, group g > 0 a fixed random permutation
    (seeded) with no fixed point (every class is relabelled)."""
    perms = [np.arange(num_labels)]
    for g in range(1, num_concepts):
        r = np.random.default_rng([seed, 11, g])
        if num_labels < 2:
            perms.append(np.arange(num_labels))
            continue
        while True:
            p = r.permutation(num_labels)
            if not np.any(p == np.arange(num_labels)):
                break
        perms.append(p)
    return perms


def concept_drift(
    ds: Dataset, num_partitions: int, seed: int = 0, num_concepts: int = 2, base: str = "iid", **kw
) -> list[Dataset]:
    """Concept shift: same P(x), different P(y|x) between client groups.

    Written here because Flower partitions rows and never changes labels. The data is first partitioned with
    ``base`` (default ``iid``; any other scheme name works, with its kwargs). Client i belongs to concept group
    ``i % num_concepts``; group 0 keeps the true labels, group g > 0 relabels y -> perm_g[y] with a fixed seeded
    derangement (:func:`concept_drift_permutations`; call it with the same ``num_labels, num_concepts, seed`` to
    recover the mapping). The global test set keeps the true labels (group 0's concept).
    """
    if num_concepts < 1:
        raise ValueError(f"num_concepts must be >= 1, got {num_concepts}")
    if base == "concept_drift" or base not in PARTITIONS:
        raise ValueError(f"concept_drift base scheme must be one of {sorted(set(PARTITIONS) - {'concept_drift'})}")
    parts = PARTITIONS[base](ds, num_partitions, seed=seed, **kw)
    n_labels = ds.features["label"].num_classes if hasattr(ds.features["label"], "num_classes") else (
        int(max(ds["label"])) + 1)
    perms = concept_drift_permutations(n_labels, num_concepts, seed)
    out = []
    for i, p in enumerate(parts):
        perm = perms[i % num_concepts]
        if i % num_concepts:
            feats = p.features
            p = p.map(lambda b: {"label": perm[np.asarray(b["label"])].tolist()}, batched=True, features=feats)
        out.append(p)
    return out


def natural_id(ds: Dataset, num_partitions: int, seed: int = 0, column: str = "domain", **_) -> list[Dataset]:
    """One client per distinct value of ``column`` (Flower ``NaturalIdPartitioner``), values in sorted order."""
    NaturalIdPartitioner = _fp().NaturalIdPartitioner

    if column not in ds.column_names:
        raise ValueError(f"natural_id needs a {column!r} column; got {ds.column_names}")
    n_ids = len(set(ds[column]))
    if num_partitions != n_ids:
        raise ValueError(f"natural_id by {column!r} gives {n_ids} clients (one per value); num_partitions={num_partitions}")
    p = NaturalIdPartitioner(partition_by=column)
    p.dataset = ds
    p.load_partition(0)  # builds Flower's partition_id -> value mapping
    ids = sorted(p.partition_id_to_natural_id.items(), key=lambda kv: str(kv[1]))
    parts = [p.load_partition(pid) for pid, _ in ids]
    return _check_nonempty(parts, "natural_id", "")


def label_quantity(ds: Dataset, num_partitions: int, seed: int = 0, classes_per_client: int = 2,
                   partition_by: str = "label", **_) -> list[Dataset]:
    """#M of NIID-Bench and the adapters paper (Sec. IV): exactly ``classes_per_client`` labels per client, client
    i's first one i mod K (Flower's ``PathologicalPartitioner`` in its first-deterministic mode)."""
    _check_common(ds, num_partitions)
    n_classes = len(set(ds[partition_by]))
    if not 1 <= classes_per_client <= n_classes:
        raise ValueError(f"--classes_per_client must be in 1..{n_classes} (the labels of this dataset), got "
                         f"{classes_per_client}")
    p = _fp().PathologicalPartitioner(num_partitions=num_partitions, partition_by=partition_by,
                                      num_classes_per_partition=int(classes_per_client),
                                      class_assignment_mode="first-deterministic", shuffle=True, seed=seed)
    parts = _flower(p, ds, num_partitions)
    return _check_nonempty(parts, "label_quantity", "use fewer clients or more classes_per_client")


PARTITIONS: dict[str, Callable[..., list[Dataset]]] = {
    "iid": iid,
    "dirichlet": dirichlet,
    "pathological": pathological,
    "shards": shards,
    "quantity": quantity,
    "feature_shift": feature_shift,
    "concept_drift": concept_drift,
    "natural_id": natural_id,
    "label_quantity": label_quantity,
}


def partition_dataset(ds: Dataset, scheme: str, num_partitions: int, seed: int = 0, **kwargs) -> list[Dataset]:
    """Split ``ds`` into ``num_partitions`` client datasets with ``scheme`` (a key of :data:`PARTITIONS`).

    Keyword arguments go to the scheme (see the module docstring), e.g. ``alpha=0.1``, ``classes_per_client=2``.
    Deterministic per ``seed``. Raises ``ValueError`` for an unknown scheme, ``alpha <= 0``, more partitions than
    samples, or an empty client.
    """
    if scheme not in PARTITIONS:
        raise ValueError(f"unknown partition scheme {scheme!r}; expected one of {sorted(PARTITIONS)}")
    if "alpha" in kwargs and kwargs["alpha"] is not None and float(kwargs["alpha"]) <= 0:
        raise ValueError(f"alpha must be > 0, got {kwargs['alpha']}")
    _check_common(ds, num_partitions)
    return PARTITIONS[scheme](ds, num_partitions, seed=int(seed), **kwargs)
