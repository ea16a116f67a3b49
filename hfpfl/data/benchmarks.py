"""Benchmarks for new-client personalization (FedPCE, FedBasis), built on the hfpfl.data API.

* :func:`degradation_benchmark` — FedPCE's CIFAR protocol on a Digits source: the pool is split uniformly into
  clients, one group per degradation (Gaussian noise, colour jitter, rotation), each client with its own severity
  (client-dependent noise variance / jitter strength / rotation range), and **held-out new clients in every group**.
* :func:`leave_one_domain_out` — Digits domains (mnist, usps, mnistm, syn) as groups, several clients per domain;
  every client of one domain is a new client (today's partitioner cannot express this).
* :func:`with_new_client_budget` — the new clients' training splits cut to k images per class (few-shot axis:
  2, 8, 32, all); test splits unchanged.

Degradation strength (``levels``): ``"paper"`` (default) uses the FedPCE paper's per-client settings over the M
clients of a group (held-out ones included): Gaussian-noise variances linspace(0.005, 1, M) on the [0, 1] image
scale, added to the model inputs without clamping, and ColorJitter factors linspace(0.5, 1.5, M) for brightness,
contrast and saturation and linspace(-0.5, 0.5, M) for hue, each list randomly permuted over the clients, applied in
a random order per image. ``"cycled"`` is the milder earlier setting: the 5 levels of :mod:`hfpfl.data.transforms`
(noise std 0.08..0.38, clamped; jitter drawn per image) cycled over a group's clients. Rotation has no counterpart in
the paper and keeps the cycled 15..90 degree ranges in both settings. The paper's third group, Class imbalance, is
the group ``"imbalance"`` (:mod:`hfpfl.data.class_imbalance`): undegraded images over client pairs by Dirichlet(alpha)
label proportions, alpha logspace(0.1, 10) per pair. ``new_client_test_size`` gives the held-out clients test sets of
that many images (from the source's test split, through the client's degradation) instead of their own 25 %.

Differences from the paper, said once: the degradations are applied once per image (fixed draws, seeded) rather than
resampled at every load; the noise is added after resizing to ``image_size`` (the paper's CIFAR images are used at
their native 32 px).
"""
from __future__ import annotations

import numpy as np
import torch

from datasets import ClassLabel, concatenate_datasets

from .build import _finish, _split
from .federated import ClientData, FederatedData
from .sources import load_source
from .transforms import DEGRADATIONS, add_input_noise, color_jitter_fixed, degrade, to_model_inputs


def _client(i, ds, domain, image_size, num_channels, test_fraction, seed, post=None):
    cd = to_model_inputs(ds, image_size, num_channels)
    cd = (post(cd) if post else cd).with_format(None)
    labels = np.asarray(cd.with_format("numpy")["labels"])
    train, test = _split(labels, test_fraction, seed * 100003 + i, isinstance(cd.features["labels"], ClassLabel))
    return ClientData(client_id=i, train=_finish(cd.select(train)), test=_finish(cd.select(test)), domain=domain)


def _assemble(collab, new, global_test, label_feat, image_size, num_channels, public=None) -> FederatedData:
    clients = collab + new
    for i, c in enumerate(clients):      # ids: collaborative 0..N-1, new clients continue (the engine's convention)
        c.client_id = i
    return FederatedData(clients=collab, new_clients=new, global_test=global_test, public=public,
                         num_labels=label_feat.num_classes, label_names=list(label_feat.names),
                         image_size=image_size, num_channels=num_channels)


GROUPS = DEGRADATIONS + ("imbalance",)


def degradation_benchmark(source: str = "mnist", groups=("noise", "color", "rotation"), clients_per_group: int = 4,
                          new_per_group: int = 1, max_per_domain: int | None = 600, image_size: int = 28,
                          num_channels: int = 3, test_fraction: float = 0.25, seed: int = 0,
                          levels: str = "paper", new_client_test_size: int | None = None) -> FederatedData:
    """Clients in degradation groups with held-out new clients per group (see the module docstring).

    Each group gets M = ``clients_per_group + new_per_group`` clients; client j of a group has level j + 1 of M
    (``levels="paper"``) or severity ``1 + j % 5`` (``"cycled"``); which of them are held out is drawn with ``seed``
    (stratified: ``new_per_group`` per group). ``ClientData.domain`` is ``"<kind>-<level>"``;
    :func:`degradation_settings` gives each level's parameters. The group ``"imbalance"`` is FedPCE's Class imbalance
    (:mod:`hfpfl.data.class_imbalance`; M must be even): the group's images, undegraded, split over client pairs by
    Dirichlet(alpha) label proportions, alpha logspace(0.1, 10, M / 2).

    ``new_client_test_size``: each held-out client's test split is instead this many images of the source's test
    split (disjoint between new clients, so not its own 25 %), through the client's own degradation (a fresh draw of
    its noise; the same jitter factors or rotation severity); an imbalance client's follow its training labels'
    proportions. None (default): the client's own ``test_fraction`` split, as before."""
    if levels not in ("paper", "cycled"):
        raise ValueError(f"levels must be 'paper' or 'cycled', got {levels!r}")
    groups = tuple(groups)
    for g in groups:
        if g not in GROUPS:
            raise ValueError(f"unknown degradation {g!r}; expected some of {GROUPS}")
    if clients_per_group < 1 or new_per_group < 0:
        raise ValueError("clients_per_group must be >= 1 and new_per_group >= 0")
    if new_client_test_size is not None and new_client_test_size < 1:
        raise ValueError(f"new_client_test_size must be >= 1 (or None), got {new_client_test_size}")
    raw = load_source(source, "train", seed=seed, max_per_domain=max_per_domain)
    raw_test = load_source(source, "test", seed=seed, max_per_domain=max_per_domain)
    per_group = clients_per_group + new_per_group
    n = len(groups) * per_group
    rng = np.random.default_rng([seed, 11])
    chunks = np.array_split(rng.permutation(len(raw)), n)
    if min(len(c) for c in chunks) < 4:
        raise ValueError(f"{len(raw)} images cannot make {n} clients: raise max_per_domain")
    pool = NewClientTests(raw_test, new_client_test_size, len(groups) * new_per_group, seed)
    collab, new = [], []
    for gi, kind in enumerate(groups):
        held = set(rng.choice(per_group, size=new_per_group, replace=False).tolist()) if new_per_group else set()
        settings = degradation_settings(kind, per_group, levels, seed=seed * 1000 + gi)
        if kind == "imbalance":
            from .class_imbalance import class_imbalance_split
            group_idx = np.concatenate(chunks[gi * per_group:(gi + 1) * per_group])
            pair_parts = class_imbalance_split(np.asarray(raw.select(group_idx)["label"]), per_group,
                                               seed=seed * 1000 + gi)
        for j in range(per_group):
            k = gi * per_group + j
            rows = group_idx[pair_parts[j]] if kind == "imbalance" else chunks[k]
            ds, post = _degraded(raw.select(np.sort(rows)), kind, settings[j], levels, seed * 1000 + k)
            level = j + 1 if levels == "paper" or kind == "imbalance" else settings[j]["severity"]
            c = _client(k, ds, f"{kind}-{level}", image_size, num_channels, test_fraction, seed, post=post)
            if j in held and new_client_test_size is not None:
                labels = np.asarray(c.train.with_format(None)["labels"]) if kind == "imbalance" else None
                tds, tpost = _degraded(pool.take(labels), kind, settings[j], levels, seed * 1000 + k + 500_000)
                tds = to_model_inputs(tds, image_size, num_channels)
                c.test = _finish((tpost(tds) if tpost else tds).with_format(None))
            (new if j in held else collab).append(c)
    test = to_model_inputs(raw_test, image_size, num_channels)
    return _assemble(collab, new, test, raw.features["label"], image_size, num_channels)


def _degraded(ds, kind: str, setting: dict, levels: str, seed: int):
    """(images with the client's degradation, a post-step on model inputs or None) for one client's setting."""
    if kind == "imbalance":
        return ds, None
    if levels == "paper" and kind == "noise":
        return ds, lambda d, s=setting["std"]: add_input_noise(d, s, seed=seed)
    if levels == "paper" and kind == "color":
        return color_jitter_fixed(ds, setting["factors"], seed=seed), None
    return degrade(ds, kind, setting["severity"], seed=seed), None


class NewClientTests:
    """Disjoint test sets for the new clients out of the source's test split (``degradation_benchmark``'s
    ``new_client_test_size``): uniform draws, or, given a client's training labels, per-class counts in their
    proportions (largest remainders)."""

    def __init__(self, raw_test, size: int | None, num_new: int, seed: int):
        self.raw, self.size = raw_test, size
        if size is None:
            return
        if size * num_new > len(raw_test):
            raise ValueError(f"{num_new} new clients x new_client_test_size {size} > the {len(raw_test)} images of "
                             f"the test split: lower new_client_test_size or raise max_per_domain")
        self.labels = np.asarray(raw_test["label"])
        self.free = np.random.default_rng([seed, 43]).permutation(len(raw_test))

    def take(self, train_labels=None):
        if train_labels is None:
            rows, self.free = self.free[:self.size], self.free[self.size:]
            return self.raw.select(np.sort(rows))
        hist = np.bincount(train_labels, minlength=int(self.labels.max()) + 1)
        counts = capped_class_counts(hist, self.size, np.bincount(self.labels[self.free], minlength=len(hist)))
        rows = [self.free[self.labels[self.free] == k][:c] for k, c in enumerate(counts)]
        rows = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        self.free = np.setdiff1d(self.free, rows, assume_unique=True)  # keeps the permutation's order
        return self.raw.select(np.sort(rows))


def class_counts(histogram, total: int) -> list[int]:
    """``total`` split over classes in proportion to ``histogram`` by largest remainders (ties: lower class)."""
    h = np.asarray(histogram, dtype=np.float64)
    exact = h / h.sum() * total
    base = np.floor(exact).astype(int)
    order = sorted(range(len(h)), key=lambda i: (-(exact[i] - base[i]), i))
    for i in order[: total - int(base.sum())]:
        base[i] += 1
    return base.tolist()


def capped_class_counts(histogram, total: int, available) -> list[int]:
    """:func:`class_counts`, with no class above the images ``available`` of it: a class that runs short gives all
    it has and its remainder is split over the histogram's other classes in their proportions (largest remainders).
    A heavily skewed imbalance client can ask for more test images of its main class than the test split holds (the
    bundled MNIST's 75 a class); the paper's validation fold (5-fold CV in each client) follows the client's own
    proportions, which this keeps wherever the images exist. Where none run short, exactly :func:`class_counts`."""
    h = np.asarray(histogram, dtype=np.float64)
    avail = np.asarray(available)
    counts, fixed = np.zeros(len(h), dtype=int), np.zeros(len(h), dtype=bool)
    while True:
        rest = np.where(fixed, 0.0, h)
        left = total - int(counts[fixed].sum())
        if left and not rest.sum():
            raise ValueError(f"the test split has too few images of the classes {np.flatnonzero(h).tolist()} for "
                             f"the new clients' test sets: lower new_client_test_size or raise max_per_domain")
        share = np.asarray(class_counts(rest, left)) if left else np.zeros(len(h), dtype=int)
        short = ~fixed & (share > avail)
        if not short.any():
            counts[~fixed] = share[~fixed]
            return counts.tolist()
        counts[short], fixed = avail[short], fixed | short


def degradation_settings(kind: str, m: int, levels: str = "paper", seed: int = 0) -> list[dict]:
    """The per-client parameters of a degradation group of ``m`` clients (see the module docstring): ``severity``
    (cycled levels), ``std`` (paper noise: sqrt of linspace(0.005, 1, m)) or ``factors`` (paper jitter:
    (brightness, contrast, saturation, hue), each list linspace-spaced and permuted with ``seed``)."""
    if kind == "imbalance":
        from .class_imbalance import imbalance_alphas
        return [{"alpha": a} for a in imbalance_alphas(m)]
    if levels == "paper" and kind == "noise":
        return [{"variance": float(v), "std": float(np.sqrt(v))} for v in np.linspace(0.005, 1.0, m)]
    if levels == "paper" and kind == "color":
        rng = np.random.default_rng([seed, 23])
        bcs = np.linspace(0.5, 1.5, m)
        hue = np.linspace(-0.5, 0.5, m)
        perms = [rng.permutation(m) for _ in range(4)]
        return [{"factors": (float(bcs[perms[0][i]]), float(bcs[perms[1][i]]), float(bcs[perms[2][i]]),
                             float(hue[perms[3][i]]))} for i in range(m)]
    return [{"severity": 1 + j % 5} for j in range(m)]


def leave_one_domain_out(held_out: str = "syn", domains=("mnist", "usps", "mnistm", "syn"),
                         clients_per_domain: int = 3, max_per_domain: int | None = 600, image_size: int = 28,
                         num_channels: int = 3, test_fraction: float = 0.25, seed: int = 0) -> FederatedData:
    """Each domain split uniformly into ``clients_per_domain`` clients; the clients of ``held_out`` are all new."""
    if held_out not in domains:
        raise ValueError(f"held_out {held_out!r} is not among the domains {list(domains)}")
    collab, new, tests, label_feat = [], [], [], None
    k = 0
    rng = np.random.default_rng([seed, 13])
    for d in domains:
        raw = load_source(d, "train", seed=seed, max_per_domain=max_per_domain)
        label_feat = raw.features["label"]
        for idx in np.array_split(rng.permutation(len(raw)), clients_per_domain):
            c = _client(k, raw.select(np.sort(idx)), d, image_size, num_channels, test_fraction, seed)
            (new if d == held_out else collab).append(c)
            k += 1
        if d != held_out:
            tests.append(load_source(d, "test", seed=seed, max_per_domain=max_per_domain))
    test = to_model_inputs(concatenate_datasets(tests), image_size, num_channels)
    return _assemble(collab, new, test, label_feat, image_size, num_channels)


def with_new_client_budget(fed: FederatedData, per_class: int | None, seed: int = 0) -> FederatedData:
    """A copy of ``fed`` whose new clients keep at most ``per_class`` training images of each class (None: all).
    The subset for budget k contains the subset for every smaller budget (nested), so budgets compare fairly."""
    if per_class is None:
        return fed
    if per_class < 1:
        raise ValueError(f"per_class must be >= 1, got {per_class}")
    new = []
    for c in fed.new_clients:
        y = np.asarray(c.train.with_format(None)["labels"])
        order = np.random.default_rng([seed, 17, c.client_id]).permutation(len(y))
        keep = np.sort(np.concatenate([order[y[order] == label][:per_class] for label in np.unique(y)]))
        new.append(ClientData(client_id=c.client_id, train=c.train.select(keep), test=c.test, val=c.val,
                              domain=c.domain))
    return FederatedData(clients=fed.clients, new_clients=new, global_test=fed.global_test, public=fed.public,
                         num_labels=fed.num_labels, label_names=fed.label_names, image_size=fed.image_size,
                         num_channels=fed.num_channels)


def pflbed(domains=("mnist", "usps", "mnistm", "syn"), clients_per_domain: int = 4, new_per_domain: int = 2,
           alpha: float = 0.3, max_per_domain: int | None = 600, image_size: int = 28, num_channels: int = 3,
           seed: int = 0) -> FederatedData:
    """FedBasis' PFLBED protocol (the FedBasis paper, Sec. 5) on Digits domains: per domain, the source's
    train split is divided 75/25 (stratified) into participated / unparticipated pools, each Dirichlet(alpha)-split
    by class over its clients (Hsu et al. 2019); every client of a domain is tested on that domain's whole,
    shared test split. Score with :func:`label_weighted_accuracy` (re-weighted by the client's training labels)."""
    collab, new = [], []
    k = 0
    rng = np.random.default_rng([seed, 19])
    label_feat, tests = None, []
    for d in domains:
        raw = load_source(d, "train", seed=seed, max_per_domain=max_per_domain)
        label_feat = raw.features["label"]
        test = _finish(to_model_inputs(load_source(d, "test", seed=seed, max_per_domain=max_per_domain), image_size,
                                       num_channels).with_format(None))
        tests.append(test)
        y = np.asarray(raw["label"])
        part, unpart = [], []
        for c in np.unique(y):
            idx = rng.permutation(np.flatnonzero(y == c))
            cut = int(round(0.75 * len(idx)))
            part.extend(idx[:cut]), unpart.extend(idx[cut:])
        for pool, m, dest in ((np.array(part), clients_per_domain, collab), (np.array(unpart), new_per_domain, new)):
            if m == 0:
                continue
            owners = [[] for _ in range(m)]
            for c in np.unique(y[pool]):
                idx = rng.permutation(pool[y[pool] == c])
                q = rng.dirichlet(alpha * np.ones(m))
                for o, chunk in enumerate(np.split(idx, (np.cumsum(q)[:-1] * len(idx)).astype(int))):
                    owners[o].extend(chunk.tolist())
            for o in owners:
                if len(o) < 2:          # keep every client trainable (tiny pools at CPU scale)
                    o.extend(rng.choice(pool, 2, replace=False).tolist())
                cd = to_model_inputs(raw.select(np.sort(o)), image_size, num_channels).with_format(None)
                dest.append(ClientData(client_id=k, train=_finish(cd), test=test, domain=d))
                k += 1
    gtest = concatenate_datasets(tests)
    return _assemble(collab, new, gtest, label_feat, image_size, num_channels)


def label_weighted_accuracy(model, client: ClientData, num_labels: int, batch_size: int = 256) -> float:
    """PFLBED's metric: accuracy on the shared domain test set with sample i weighted by P_client(y_i), the
    client's training label distribution (the paper, Sec. 5)."""
    p = np.bincount(np.asarray(client.train.with_format(None)["labels"]), minlength=num_labels).astype(np.float64)
    p /= p.sum()
    x = client.test.with_format("torch")
    num = den = 0.0
    model.eval()
    with torch.no_grad():
        for s in range(0, len(x), batch_size):
            b = x[s:s + batch_size]
            dev = next(model.parameters()).device
            pred = model(pixel_values=b["pixel_values"].to(dev)).logits.argmax(-1).cpu().numpy()
            yy = b["labels"].numpy()
            w = p[yy]
            num += float((w * (pred == yy)).sum())
            den += float(w.sum())
    return num / den if den else float("nan")
