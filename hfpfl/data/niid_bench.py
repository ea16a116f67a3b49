"""The two non-IID settings of the parallel-adapters paper (Elvebakken, Iosifidis and Esterle, "Adaptive
Parameterization of Deep Learning Models for Federated Learning", section IV) that the other schemes lack; the paper
follows the NIID-Bench implementation (Li et al., "Federated Learning on Non-IID Data Silos", ICDE 2022, its [15]).

``label_quantity`` (a scheme of :mod:`hfpfl.data.partition`) -- quantity-based label imbalance, "#M": every client holds samples of exactly M labels; "if there
are 10 clients and 10 classes, each class is only found on one client" (M = 1). NIID-Bench's assignment: client i's
first label is i mod K, the other M - 1 are drawn at random among the rest; then each label's samples are shuffled
and split equally among the clients that hold it. That is Flower's ``PathologicalPartitioner`` in
``first-deterministic`` mode. (The ``pathological`` scheme uses Flower's ``random`` mode: with M = 1 and as many
clients as classes two clients can share a class and another class go unused, which the paper's M = 1 excludes.)

``noise_skew`` -- noise-based feature skew, "Gau(sigma)": the data are split homogeneously (``--partition iid``),
then client C_i's local data get Gaussian noise of mean 0 and "variance sigma * i / N" (i = 1..N, sigma = 0.1 in the
paper): ``rule='paper'``. NIID-Bench's code instead uses sigma * i / (N - 1), i = 0..N-1, as the *standard
deviation* (client 0 clean): ``rule='niid_bench'``. The noise is added on the [0, 1] image scale and not clamped
(NIID-Bench adds it to the tensor after ToTensor); it is one fixed draw per image (NIID-Bench redraws at every load).
Each training client's train, validation and test splits get its noise; the global test set, the public split and
held-out new clients stay clean (NIID-Bench tests on the clean global test set).

FRAug's noise-robustness experiment (Chen's dissertation, FRAug chapter, section 4.3.4, Table 6, "privatized
OfficeHome") adds delta ~ N(0, sigma^2 I) to every client's local images "when optimizing the classification model",
sigma 0.01 / 0.1 / 1.0, and scores on clean test images: ``rule='uniform'`` (std sigma for every client) with
``splits='train'`` (the train and validation splits, the client's own data, are noised; its test split stays
clean). The chapter does not say whether the noise is redrawn at every step; a privatized copy is one fixed draw per
image, as here.
"""
from __future__ import annotations

import dataclasses
import math

NOISE_RULES = ("paper", "niid_bench", "uniform")
#: which of a training client's splits get its noise: every split, or only the data it trains on (train, val)
NOISE_SPLITS = {"all": ("train", "val", "test"), "train": ("train", "val")}


def noise_skew_stds(num_clients: int, sigma: float, rule: str = "paper") -> list[float]:
    """The noise standard deviation of each client 0..N-1 (on the [0, 1] image scale).

    ``paper``: client index i = 1..N has variance sigma * i / N, so std sqrt(sigma * i / N);
    ``niid_bench``: client index i = 0..N-1 has std sigma * i / (N - 1) (0 for a single client);
    ``uniform``: every client has std sigma (FRAug's privatized clients)."""
    if rule not in NOISE_RULES:
        raise ValueError(f"noise skew rule must be one of {', '.join(NOISE_RULES)}, got {rule!r}")
    if num_clients < 1 or not (sigma >= 0 and math.isfinite(sigma)):
        raise ValueError(f"noise skew needs >= 1 client and a finite sigma >= 0, got {num_clients}, {sigma}")
    n = num_clients
    if rule == "paper":
        return [math.sqrt(sigma * (i + 1) / n) for i in range(n)]
    if rule == "uniform":
        return [float(sigma)] * n
    return [sigma * i / (n - 1) if n > 1 else 0.0 for i in range(n)]


def noise_skew(fed, sigma: float, rule: str = "paper", seed: int = 0, splits: str = "all"):
    """``fed`` with each training client's splits of ``NOISE_SPLITS[splits]`` (all: train / val / test; train: train
    / val) noised by its std of :func:`noise_skew_stds` (one fixed draw per image, from (seed, client, split)); new
    clients, global test and public untouched."""
    from .transforms import add_input_noise

    if splits not in NOISE_SPLITS:
        raise ValueError(f"noise skew splits must be one of {', '.join(NOISE_SPLITS)}, got {splits!r}")
    stds = noise_skew_stds(len(fed.clients), sigma, rule)
    out = []
    for c, std in zip(fed.clients, stds):
        changes = {}
        for j, split in enumerate(("train", "val", "test")):
            if split not in NOISE_SPLITS[splits]:
                continue
            ds = getattr(c, split, None)
            if ds is not None and len(ds) and std > 0:
                changes[split] = add_input_noise(ds, std, seed=(int(seed) * 1000003 + c.client_id * 7 + j))
        out.append(dataclasses.replace(c, **changes))
    return dataclasses.replace(fed, clients=out)
