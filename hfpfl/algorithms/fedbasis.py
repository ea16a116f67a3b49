"""FedBasis (paper 004, spec adapters_fedbasis.md PART B): K shareable bases (+1 major basis); each client's network
is a per-group convex combination of them; the coefficients psi are a client's only personal state; a new client
learns only its coefficients (Algorithm 2), every basis frozen.

Training (B2.4, ``training="improved"``): per round, psi <- 0; step 2: psi trained with the bases frozen; step 3:
alpha sharpened to softmax(psi / tau) (tau = 0.1) and frozen; step 4: the bases trained with that alpha; upload the
bases; the server takes their uniform (1/M) mean. ``training="naive"`` (B2.3, Eq. 7, the collapse diagnostic):
psi and the bases trained jointly at temperature 1, psi at the same ``lr_coef`` as the improved training's step 2.
``training="joint"`` is Table 3's row without coordinate descent: the joint phase of naive with the sharpening kept
(alpha = softmax(psi / tau)); ``major_basis=False`` its row without the major basis (theta = sum_k alpha_k v_k);
``temperature=1`` its row without sharpening. Warm start (B2.5): the first ``warm_fraction`` of the rounds
are FedAvg on the major basis alone (the network is v'); at the end of the warm start the server sets v' to the
FedAvg mean and v_1..v_K to the k-means centroids of that round's local models (the gather path: the server needs
every local model once). Diagnostics each evaluation (B3.3): mean pairwise cosine similarity of the non-major
bases, of their displacements from the warm-start centroids, and the mean entropy of the clients' alphas.

New clients: Algorithm 2 learns only the coefficients (``new_client_mode="coef"``, default); the paper's
experiments (Sec. 6) learn "the combinations and the whole classifier" (``"head"``); "full" tunes everything (a
reference, no baseline of the paper); "major_ft" / "major_lp" tune the major basis alone as the network (FedAvg+FT /
+LP on the same ResNet when ``warm_fraction=1``). The paper's protocol (20 epochs per grid lr, Last / Best chosen on
validation): :meth:`FedBasis.new_client_curve` and :func:`best_and_last`, run by ``recipes/fedbasis.py
--paper_new_clients``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from ..models.basis import BasisCombinedModel, resnet_groups
from ..models.cond_norm_resnet import CondNormResNetConfig, CondNormResNetForImageClassification
from ..options import at_least, in_range, number_list, one_of, positive, validate
from ..training.tensor_data import batch_bounds
from .base import GLOBAL, MODEL, PRIVATE, Algorithm, Update, register

ANCHOR = "anchor"


@dataclass
class FedBasisConfig:
    num_bases: int = field(default=3, metadata={"help": "K non-major bases (paper: 4 PACS/Office-Home, 8 GLD).",
                                                "check": at_least(1)})
    temperature: float = field(default=0.1, metadata={
        "help": "Sharpening temperature tau of step 3 (> 0; smaller = sharper coefficients).", "check": positive()})
    warm_fraction: float = field(default=0.3, metadata={"help": "Fraction of rounds of FedAvg warm start.",
                                                        "check": in_range(0, 1)})
    training: str = field(default="improved", metadata={
        "help": "improved (Eq. 9: coefficients, then the bases with the sharpened coefficients frozen), naive (Eq. 7: "
                "coefficients and bases jointly at temperature 1, the collapse study) or joint (Table 3's row "
                "without coordinate descent: coefficients and bases jointly, alpha = softmax(psi / --temperature)).",
        "check": one_of("improved", "naive", "joint")})
    major_basis: bool = field(default=True, metadata={
        "help": "Keep the major basis v' in every combination (Sec. 4.4: theta = 1/2 v' + 1/2 sum_k alpha_k v_k); "
                "false: theta = sum_k alpha_k v_k (Table 3's row without it; the warm start's FedAvg model then "
                "lives in basis 1 until the k-means split)."})
    alpha_epochs: int = field(default=1, metadata={"help": "Local epochs of the coefficient step (paper: 5).",
                                                   "check": at_least(1)})
    basis_epochs: int = field(default=1, metadata={"help": "Local epochs of the basis step (paper: 5).",
                                                   "check": at_least(1)})
    lr_coef: float = field(default=0.1, metadata={"help": "Learning rate of the coefficients psi.", "check": positive()})
    widths: str = field(default="8,16,32,64", metadata={"help": "ResNet stage widths of each basis.",
                                                        "check": number_list(integer=True, low=1)})
    depths: str = field(default="1,1,1,1", metadata={"help": "BasicBlocks per stage (one per --widths entry).",
                                                     "check": number_list(integer=True, low=1)})
    new_client_steps: int = field(default=50, metadata={
        "help": "Coefficient steps for a held-out new client (0 = no adaptation).", "check": at_least(0)})
    new_client_mode: str = field(default="coef", metadata={
        "help": "What a new client tunes: coef (Algorithm 2: coefficients only), head (coefficients + the whole "
                "classifier, through the major basis' classifier, or every basis' without it: the paper's "
                "experiments, Sec. 6), full "
                "(everything: a reference, no baseline of the paper); major_ft / major_lp: the network is the "
                "major basis alone, all of it / its classifier tuned (FedAvg+FT / FedAvg+LP on the same ResNet "
                "with --warm_fraction 1, every round then FedAvg on it).",
        "check": one_of("coef", "head", "full", "major_ft", "major_lp")})
    new_client_lr_grid: str = field(default="0.005,0.01,0.05", metadata={
        "help": "Learning rates of the paper's new-client protocol (Sec. 6, Table 2: {0.005, 0.01, 0.05}): a new "
                "client trains --new_client_epochs epochs at each and keeps the one its validation split scores "
                "best (recipes/fedbasis.py --paper_new_clients).",
        "check": number_list(low=0, low_open=True)})
    lr_full: float = field(default=0.01, metadata={"help": "Learning rate of the bases when new_client_mode=full.",
                                                   "check": positive()})
    #: the options that set the step size of what this method trains, and which way makes a step smaller (named
    #: when training diverges; --lr always is): a small temperature sharpens the softmax over the coefficients
    STEP_SIZES: ClassVar[dict[str, str]] = {"lr_coef": "lower", "lr_full": "lower", "temperature": "raise"}

    def __post_init__(self):
        validate(self)
        if not self.major_basis and self.new_client_mode in ("major_ft", "major_lp"):
            raise ValueError(f"--new_client_mode {self.new_client_mode} tunes the major basis, but --major_basis is "
                             "false: keep --major_basis true or use --new_client_mode coef / head / full")
        if len(_ints(self.widths)) != len(_ints(self.depths)):
            raise ValueError(f"--widths and --depths must give the same number of ResNet stages, got "
                             f"{len(_ints(self.widths))} widths ({self.widths}) and {len(_ints(self.depths))} depths "
                             f"({self.depths}); give one --depths entry per --widths entry")

    def lr_grid(self) -> list[float]:
        return [float(t) for t in self.new_client_lr_grid.split(",") if t.strip()]


def _ints(s):
    return [int(t) for t in str(s).split(",") if t.strip()]


@register
class FedBasis(Algorithm):
    name = "fedbasis"
    aggregation = "gather"
    local_update = "own"
    # load_client switches the network back to the basis combination (a new client may have left it on the major
    # basis alone): a personal model is built by this code, never by loading tensors only
    personal_model = "own"
    Config = FedBasisConfig
    has_global_model = False
    uses_server_hparams = frozenset()  # aggregate: the uniform mean (+ k-means); no FedOpt step
    # local training runs basis_epochs / alpha_epochs of the config, never --local_epochs
    uses_client_hparams = Algorithm.uses_client_hparams - {"local_epochs"}

    def build_model(self):
        c = self.config
        t = CondNormResNetForImageClassification(CondNormResNetConfig(
            num_channels=self.ctx.data.num_channels, hidden_sizes=_ints(c.widths), depths=_ints(c.depths),
            conditional=False, num_labels=self.ctx.num_labels))
        return BasisCombinedModel(t, c.num_bases, resnet_groups(t), major=c.major_basis)

    @property
    def _first(self) -> int:
        """Index of the first non-major basis (0 without the major basis)."""
        return 1 if self.config.major_basis else 0

    def key_role(self, key, default):
        return PRIVATE if default == GLOBAL and key.startswith("coef.") else default

    def init_server_state(self):
        # part "anchor": the non-major bases as the warm start left them (the k-means centroids), kept in the server
        # state so that the B3.3 diagnostic survives a resume and is the same on every process; it never travels
        state = super().init_server_state()
        nonmajor = tuple(f"bases.{b}." for b in range(self._first, self._first + self.config.num_bases))
        return {**state, ANCHOR: {k: v.clone() for k, v in state[MODEL].items() if k.startswith(nonmajor)}}

    def warm_rounds(self) -> int:
        """At least one warm-start round (when there are >= 2 rounds and warm_fraction > 0): bases that start
        identical get identical gradients and uniform alphas forever, so the k-means split is what separates them."""
        r = int(math.floor(self.config.warm_fraction * self.ctx.run.num_rounds))
        return max(r, 1) if self.config.warm_fraction > 0 and self.ctx.run.num_rounds >= 2 else r

    def _keys(self, prefix):
        return [k for k in self.global_keys if k.startswith(prefix)]

    def _params(self, prefix):
        return [p for n, p in self.model.named_parameters() if n.startswith(prefix)]

    def _train(self, cid, r, groups, tag, epochs):
        """Train the parameters of ``groups`` (``[(params, lr or None = the client's lr), ...]``), one optimizer
        parameter group each, everything else frozen."""
        named = dict(self.model.named_parameters())
        chosen = {id(p) for params, _ in groups for p in params}
        was = {n: p.requires_grad for n, p in named.items()}
        for p in named.values():
            p.requires_grad_(id(p) in chosen)
        try:
            hp = self.ctx.hparams(cid)
            return self.ctx.train(cid, r, params=[{"params": params, "lr": lr or hp.lr} for params, lr in groups],
                                  hp=hp, epochs=epochs, steps=hp.local_steps, tag=tag)
        finally:
            for n, p in named.items():
                p.requires_grad_(was[n])

    # ------------------------------------------------------------------ client
    def client_update(self, client_id, down, private, round_idx):
        self.load_client(down, private)
        m, c = self.model, self.config
        n = len(self.ctx.train_data(client_id))
        with torch.no_grad():
            for p in m.coef.values():
                p.zero_()                              # alpha = uniform every round (stateless, Eq. 7 / 9)
        if round_idx <= self.warm_rounds():            # FedAvg on the network v' alone
            m.fixed_alpha = None
            m.major_only = True
            try:
                met = self._train(client_id, round_idx, [(self._params("bases.0."), None)], "warm", c.basis_epochs)
            finally:
                m.major_only = False
            return Update(client_id, {MODEL: self.ctx.snapshot(self._keys("bases.0."))}, n,
                          {MODEL: self.ctx.snapshot(self.private_keys)}, met)
        coef, bases = list(m.coef.values()), self._params("bases.")
        if c.training in ("naive", "joint"):
            # the same coefficient lr as the improved training's step 2 (the paper states one local lr for all of
            # FedBasis, Sec. 6), so the trainings differ in their schedule alone; joint (Table 3, no coordinate
            # descent) keeps the sharpening, naive (Eq. 7) has none
            m.temperature = 1.0 if c.training == "naive" else c.temperature
            try:
                met = self._train(client_id, round_idx, [(coef, c.lr_coef), (bases, None)], "joint", c.basis_epochs)
            finally:
                m.temperature = 1.0
        else:
            m.temperature = 1.0
            met_a = self._train(client_id, round_idx, [(coef, c.lr_coef)], "alpha", c.alpha_epochs)
            m.fixed_alpha = {g: torch.softmax(m.coef[g].detach() / c.temperature, 0) for g in m.group_names}
            try:
                met = self._train(client_id, round_idx, [(bases, None)], "bases", c.basis_epochs)
            finally:
                m.fixed_alpha = None
            # the round's budget is both phases' optimizer steps and examples (the coefficient step trains too)
            met = {**met, "alpha_train_loss": met_a["train_loss"], "steps": met_a["steps"] + met["steps"],
                   "examples": met_a["examples"] + met["examples"]}
        return Update(client_id, {MODEL: self.ctx.snapshot(self._keys("bases."))}, n,
                      {MODEL: self.ctx.snapshot(self.private_keys)}, met)

    # ------------------------------------------------------------------ server
    def aggregate(self, server_state, updates, round_idx):
        if not updates:
            return server_state
        keys = list(updates[0].upload[MODEL])
        mean = {k: torch.stack([u.upload[MODEL][k].double() for u in updates]).mean(0).to(updates[0].upload[MODEL][k].dtype)
                for k in keys}                         # uniform 1/M mean (B2.3 / B2.4)
        new = dict(server_state[MODEL])
        new.update(mean)
        if round_idx <= self.warm_rounds():            # bases follow v' until the warm start ends
            K, first = self.config.num_bases, self._first
            major = [k for k in keys]
            if round_idx == self.warm_rounds():        # v_1..v_K <- k-means centroids of the local models
                X = torch.stack([torch.cat([u.upload[MODEL][k].flatten().double() for k in major]) for u in updates])
                cents = _kmeans(X, K, seed=self.ctx.seed_for(round_idx, 0, "kmeans"))
            else:
                cents = None
            for b in range(first, first + K):
                off = 0
                for k in major:
                    kk = k.replace("bases.0.", f"bases.{b}.", 1)
                    if cents is None:
                        new[kk] = mean[k].clone()
                    else:
                        num = mean[k].numel()
                        new[kk] = cents[b - first, off:off + num].view_as(mean[k]).to(mean[k].dtype)
                        off += num
            if cents is not None:
                anchor = {k: new[k].clone() for k in server_state[ANCHOR]}
                return {**server_state, MODEL: new, ANCHOR: anchor}
        return {**server_state, MODEL: new}

    def extra_metrics(self, round_idx, server_state):
        K, first = self.config.num_bases, self._first
        if K < 2:
            return {}
        s = server_state[MODEL]
        vec = [torch.cat([s[k].flatten().double() for k in sorted(s) if k.startswith(f"bases.{b}.")])
               for b in range(first, first + K)]
        out = {"basis_cosine": _mean_cos(vec)}
        anchor = server_state.get(ANCHOR)
        if anchor and round_idx >= self.warm_rounds():
            d = [v - torch.cat([anchor[k].flatten().double() for k in sorted(s) if k.startswith(f"bases.{b}.")])
                 for b, v in zip(range(first, first + K), vec)]
            if all(float(x.norm()) > 0 for x in d):
                out["basis_update_cosine"] = _mean_cos(d)
        ents = []
        for i in range(self.ctx.num_clients):     # this process's clients; gathered, in one order for any process count
            st = self.ctx.private_state(i)
            if st and st.get(MODEL):
                for k, psi in sorted(st[MODEL].items()):
                    a = torch.softmax(psi.double(), 0)
                    ents.append((i, k, float(-(a * a.clamp_min(1e-12).log()).sum() / math.log(K))))
        ents = sorted(self.ctx.gather(ents))
        if ents:
            out["alpha_entropy"] = float(np.mean([e for _, _, e in ents]))   # normalised: 1 = uniform alpha
        return out

    # ------------------------------------------------------------------ new clients (Algorithm 2)
    def load_client(self, down, private):
        self.model.major_only = False            # a participant's network is always the combination
        super().load_client(down, private)

    def new_client_keys(self):
        mode = self.config.new_client_mode
        if mode == "major_ft":
            return [k for k in self.global_keys if k.startswith("bases.0.")]
        if mode == "major_lp":
            return [k for k in self.global_keys if k.startswith("bases.0.classifier")]
        keys = [k for k in self.private_keys]
        if mode == "head":
            head = "bases.0.classifier" if self.config.major_basis else "bases."
            keys += [k for k in self.global_keys if k.startswith(head) and ".classifier" in k]
        elif mode == "full":
            keys += list(self.global_keys)
        return keys

    def new_client_groups(self, lr: float) -> list[dict]:
        """Optimizer parameter groups of a new client trained at the single lr of the paper's protocol (Sec. 6:
        one lr per method from the grid). head: the classifier is 1/2 v'_fc + 1/2 sum_k alpha_k v_k,fc, so it is
        tuned through v'_fc at 4 lr: a step 4 lr * dL/dv'_fc = 4 lr * 1/2 G moves the combined classifier by
        lr * G, as tuning "the whole classifier" directly at lr does; the coefficients train at lr. Without the major
        basis the classifier is sum_k alpha_k v_k,fc, tuned through every v_k,fc at K lr: at the start (alpha =
        1/K) a step moves it by sum_k alpha_k K lr alpha_k G = lr G. Every other mode trains what it tunes at lr
        (major_ft / major_lp: the network is v' alone)."""
        named = dict(self.model.named_parameters())
        keys = self.new_client_keys()
        if self.config.new_client_mode == "head":
            scale = 4 if self.config.major_basis else self.config.num_bases
            return [{"params": [named[k] for k in keys if k.startswith("coef.")], "lr": lr},
                    {"params": [named[k] for k in keys if not k.startswith("coef.")], "lr": scale * lr}]
        return [{"params": [named[k] for k in keys], "lr": lr}]

    def new_client_start(self, server_state) -> torch.nn.Module:
        """A new client's network before it trains: the server's bases, psi = 0 (uniform alpha); the major basis
        alone in the major_* modes."""
        self.ctx.load({k: server_state[MODEL][k] for k in self.global_keys})
        self.ctx.load({k: torch.zeros_like(v) for k, v in self.ctx.initial_private.items()})
        self.model.temperature = 1.0
        self.model.major_only = self.config.new_client_mode in ("major_ft", "major_lp")
        return self.model

    def new_client_curve(self, client_id, server_state, data, round_idx, lr, epochs, score) -> list:
        """The paper's new-client protocol at one grid lr (Sec. 6, Table 2): from :meth:`new_client_start`,
        ``epochs`` epochs of SGD on ``data`` (the client's optimizer settings, lr replaced; one optimizer for the
        whole run, so momentum carries across epochs) on :meth:`new_client_groups`; ``score(model)`` after epoch
        0 (the start), 1, ..., ``epochs``: the list of its results. Every other parameter is frozen and restored."""
        model = self.new_client_start(server_state)
        curve = [score(model)]
        if epochs <= 0:
            return curve
        hp = self.ctx.hparams(client_id).replace(lr=lr)
        per_epoch = len(batch_bounds(len(data), hp.batch_size, self.ctx.run.last_batch))

        def after_step(step):
            if step % per_epoch == 0:
                curve.append(score(model))
                model.train()

        named = dict(model.named_parameters())
        groups = self.new_client_groups(lr)
        chosen = {id(p) for g in groups for p in g["params"]}
        was = {n: p.requires_grad for n, p in named.items()}
        for p in named.values():
            p.requires_grad_(id(p) in chosen)
        try:
            self.ctx.train(client_id, round_idx, params=groups, hp=hp, epochs=epochs, data=data,
                           tag="new-client", after_step=after_step)
        finally:
            for n, p in named.items():
                p.requires_grad_(was[n])
        return curve

    def personalize_new_client(self, client_id, server_state, data, round_idx):
        self.new_client_start(server_state)
        if self.config.new_client_steps <= 0:
            return self.model
        named = dict(self.model.named_parameters())
        keys = self.new_client_keys()
        was = {n: p.requires_grad for n, p in named.items()}
        for n, p in named.items():
            p.requires_grad_(n in keys)
        try:
            hp = self.ctx.hparams(client_id)
            coef = [named[k] for k in keys if k.startswith("coef.")]
            rest = [named[k] for k in keys if not k.startswith("coef.")]
            groups = [{"params": coef, "lr": self.config.lr_coef}] + \
                ([{"params": rest, "lr": self.config.lr_full}] if rest else [])
            self.ctx.train(client_id, round_idx, params=groups,
                           hp=hp, steps=self.config.new_client_steps, epochs=10 ** 9, data=data, tag="new-client")
        finally:
            for n, p in named.items():
                p.requires_grad_(was[n])
        return self.model


def best_and_last(curves: list[list[tuple[float, float]]]) -> dict:
    """The paper's Last and Best (Sec. 6, Table 2: "the Last epoch and the Best by validation") from one client's
    curves: ``curves[i][e] = (validation score, test score)`` at grid lr i after epoch e (e = 0: the start). The lr
    is chosen on validation, never on test: Last = the test score at the last epoch of the lr whose last-epoch
    validation score is highest; Best = the test score at the (lr, epoch >= 1) of highest validation score. Ties:
    the earlier grid entry, then the earlier epoch. Also each lr's own Last and Best (Tables 4-5)."""
    last_i = max(range(len(curves)), key=lambda i: (curves[i][-1][0], -i))
    cands = [(v, -i, -e, t) for i, c in enumerate(curves) for e, (v, t) in enumerate(c) if e >= 1]
    best = max(cands)
    per_lr = []
    for c in curves:
        e = max(range(1, len(c)), key=lambda j: (c[j][0], -j))
        per_lr.append({"last": c[-1][1], "best": c[e][1]})
    return {"last": curves[last_i][-1][1], "best": best[3], "last_lr_index": last_i, "best_lr_index": -best[1],
            "best_epoch": -best[2], "start": curves[0][0][1], "per_lr": per_lr}


def _mean_cos(vecs):
    sims = [float(torch.nn.functional.cosine_similarity(a, b, dim=0)) for i, a in enumerate(vecs) for b in vecs[i + 1:]]
    return float(np.mean(sims))


def _kmeans(X: torch.Tensor, k: int, seed: int, iters: int = 20) -> torch.Tensor:
    """Plain Lloyd k-means on the rows of X (k <= rows: centroids; k > rows: rows repeated)."""
    n = X.shape[0]
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(n, generator=g)
    if k > n:
        return X[idx[torch.arange(k) % n]].clone()
    C = X[idx[:k]].clone()
    for _ in range(iters):
        assign = torch.cdist(X, C).argmin(1)
        for j in range(k):
            if (assign == j).any():
                C[j] = X[assign == j].mean(0)
    return C
