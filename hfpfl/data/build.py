"""Building the federated dataset described by :class:`~hfpfl.data.arguments.DataArguments`: a source,
partitioned among clients, each client split into train/test(/val), in model-input format; plus the global test
pool, the public pool and held-out new clients."""

from __future__ import annotations

import numpy as np

from datasets import ClassLabel, Dataset
from datasets.arrow_dataset import stratified_shuffle_split_generate_indices

from .arguments import DataArguments
from .federated import ClientData, FederatedData, few_shot
from .niid_bench import noise_skew
from .partition import partition_dataset
from .sources import load_source
from .transforms import to_model_inputs


def _split(labels: np.ndarray, fraction: float, seed: int, stratify: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """Positions ``(rest, held)`` of a client's examples with round(fraction * n) >= 1 held out, stratified by
    ``labels`` when possible: the indices ``Dataset.train_test_split(test_size=n_held, stratify_by_column="labels",
    seed=seed)`` selects (its own generator and stratified draw; without a stratification, a class with a single
    member or fewer held examples than classes, its seeded permutation), computed on the labels alone so that a
    client's splits are one ``select`` each (500 clients: 1,000 Arrow splits fewer at start-up)."""
    n = len(labels)
    if fraction <= 0:
        return np.arange(n), None
    n_held = max(1, int(round(fraction * n)))
    if n - n_held < 1:
        raise ValueError(f"client with {n} samples cannot be split with fraction {fraction}: use fewer clients")
    if stratify:
        try:
            rest, held = next(stratified_shuffle_split_generate_indices(labels, n - n_held, n_held,
                                                                        rng=np.random.default_rng(seed)))
            return rest, held
        except ValueError:  # as train_test_split: the stratification is impossible, the plain split is drawn
            pass
    permutation = np.random.default_rng(seed).permutation(n)
    return permutation[n_held:], permutation[:n_held]


def _finish(ds: Dataset) -> Dataset:
    return ds.remove_columns([c for c in ds.column_names if c.startswith("_")]).with_format("torch")


def build_federated_dataset(args: DataArguments, seed: int = 0) -> FederatedData:
    """Build the federated dataset described by ``args`` (deterministic per ``seed``).

    The source's ``"train"`` split is partitioned into ``num_clients + num_new_clients`` clients with
    ``args.partition`` (the last ``num_new_clients`` are held out as ``new_clients``); each client's partition is
    capped at ``samples_per_client`` and split into train/test (and val) within itself. ``global_test`` and
    ``public`` are the source's ``"test"`` and ``"public"`` splits. All datasets are in model-input format.
    """
    if args.num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {args.num_clients}")
    if args.num_new_clients < 0:
        raise ValueError(f"num_new_clients must be >= 0, got {args.num_new_clients}")
    if not 0 <= args.test_fraction < 1 or not 0 <= args.val_fraction < 1 or args.test_fraction + args.val_fraction >= 1:
        raise ValueError("test_fraction and val_fraction must be in [0, 1) with a sum < 1")
    draw_seed, seed = seed, (seed if args.data_seed is None else args.data_seed)
    name = args.source_name()
    raw = load_source(name, "train", seed=seed, max_per_domain=args.max_per_domain)
    raw = raw.add_column("_row", np.arange(len(raw)))
    label_feat = raw.features["label"]
    # convert once; clients are index selections of the converted set (no per-client image decoding)
    inputs = to_model_inputs(raw, image_size=args.image_size, num_channels=args.num_channels).with_format(None)
    source_labels = np.asarray(inputs.with_format("numpy")["labels"])
    stratify = isinstance(inputs.features["labels"], ClassLabel)  # train_test_split stratifies class labels only
    finished = _finish(inputs)  # clients select from it: its helper columns dropped and its format set once
    n_total = args.num_clients + args.num_new_clients
    parts = partition_dataset(raw, args.partition, n_total, seed=seed, **args.partition_kwargs())

    rng = np.random.default_rng([seed, 3])
    clients = []
    for i, p in enumerate(parts):
        cols = p.select_columns(["_row", "label", "domain"]).to_dict()
        rows = np.asarray(cols["_row"])
        labels = np.asarray(cols["label"])
        if args.samples_per_client is not None and len(rows) > args.samples_per_client:
            keep = np.sort(rng.permutation(len(rows))[: args.samples_per_client])
            rows, labels = rows[keep], labels[keep]
        relabelled = not np.array_equal(source_labels[rows], labels)  # a relabelled partition (concept_drift)

        def take(pos):  # the client's examples at these positions, with the partition's labels
            ds = finished.select(rows[pos])
            if relabelled:
                ds = ds.remove_columns("labels").add_column("labels", labels[pos], feature=label_feat) \
                    .with_format("torch")
            return ds

        client_seed = seed * 100003 + i
        strat = isinstance(label_feat, ClassLabel) if relabelled else stratify
        rest, test = _split(labels, args.test_fraction, client_seed, strat)
        val_frac = args.val_fraction / (1 - args.test_fraction) if args.val_fraction else 0.0
        train, val = _split(labels[rest], val_frac, client_seed + 1, strat)
        doms = sorted(set(cols["domain"]))
        clients.append(
            ClientData(
                client_id=i,
                train=take(rest[train]),
                test=take(test if test is not None else np.arange(0)),
                val=take(rest[val]) if val is not None else None,
                domain=doms[0] if len(doms) == 1 else None,
            )
        )
    global_test = to_model_inputs(load_source(name, "test", seed, args.max_per_domain), args.image_size,
                                  args.num_channels)
    public = to_model_inputs(load_source(name, "public", seed, args.max_per_domain), args.image_size,
                             args.num_channels)
    fed = FederatedData(
        clients=clients[: args.num_clients],
        new_clients=clients[args.num_clients :],
        global_test=global_test,
        public=public,
        num_labels=label_feat.num_classes,
        label_names=list(label_feat.names),
        image_size=args.image_size,
        num_channels=args.num_channels,
    )
    if args.noise_skew is not None:
        fed = noise_skew(fed, args.noise_skew, args.noise_skew_rule, seed, args.noise_skew_splits)
    return few_shot(fed, args.shots_per_class, draw_seed)
