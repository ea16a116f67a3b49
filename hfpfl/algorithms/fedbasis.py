"""FedBasis (paper 004, spec adapters_fedbasis.md PART B): K shareable bases (+1 major basis); each client's network
is a per-group convex combination of them; the coefficients psi are a client's only personal state; a new client
learns only its coefficients (Algorithm 2), every basis frozen.

Training (B2.4, ``training="improved"``): per round, psi <- 0; step 2: psi trained with the bases frozen; step 3:
alpha sharpened to softmax(psi / tau) (tau = 0.1) and frozen; step 4: the bases trained with that alpha; upload the
bases; the server takes their uniform (1/M) mean. ``training="naive"`` (B2.3, Eq. 7, the collapse diagnostic):
psi and the bases trained jointly at temperature 1. Warm start (B2.5): the first ``warm_fraction`` of the rounds
are FedAvg on the major basis alone (the network is v'); at the end of the warm start the server sets v' to the
FedAvg mean and v_1..v_K to the k-means centroids of that round's local models (the gather path: the server needs
every local model once). Diagnostics each evaluation (B3.3): mean pairwise cosine similarity of the non-major
bases, of their displacements from the warm-start centroids, and the mean entropy of the clients' alphas.

Deviations: the paper's experiments also fine-tune the whole classifier for new clients ("combinations and the
whole classifier"); Algorithm 2 (and the issue) learn only the coefficients, which is what ``new_client_mode="coef"``
(default) does; "head" adds the major basis' classifier, "full" tunes everything (the full fine-tuning reference).
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
    training: str = field(default="improved", metadata={"help": "improved (B2.4) or naive (B2.3 collapse study).",
                                                        "check": one_of("improved", "naive")})
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
        "help": "What a new client tunes: coef (Algorithm 2: coefficients only), head (coefficients + the major "
                "basis' classifier, the paper's experiments) or full (everything: the full fine-tuning reference).",
        "check": one_of("coef", "head", "full")})
    lr_full: float = field(default=0.01, metadata={"help": "Learning rate of the bases when new_client_mode=full.",
                                                   "check": positive()})
    #: the options that set the step size of what this method trains, and which way makes a step smaller (named
    #: when training diverges; --lr always is): a small temperature sharpens the softmax over the coefficients
    STEP_SIZES: ClassVar[dict[str, str]] = {"lr_coef": "lower", "lr_full": "lower", "temperature": "raise"}

    def __post_init__(self):
        validate(self)
        if len(_ints(self.widths)) != len(_ints(self.depths)):
            raise ValueError(f"--widths and --depths must give the same number of ResNet stages, got "
                             f"{len(_ints(self.widths))} widths ({self.widths}) and {len(_ints(self.depths))} depths "
                             f"({self.depths}); give one --depths entry per --widths entry")


def _ints(s):
    return [int(t) for t in str(s).split(",") if t.strip()]


@register
class FedBasis(Algorithm):
    name = "fedbasis"
    aggregation = "gather"
    local_update = "own"
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
        return BasisCombinedModel(t, c.num_bases, resnet_groups(t), major=True)

    def key_role(self, key, default):
        return PRIVATE if default == GLOBAL and key.startswith("coef.") else default

    def init_server_state(self):
        # part "anchor": the non-major bases as the warm start left them (the k-means centroids), kept in the server
        # state so that the B3.3 diagnostic survives a resume and is the same on every process; it never travels
        state = super().init_server_state()
        return {**state, ANCHOR: {k: v.clone() for k, v in state[MODEL].items()
                                  if k.startswith("bases.") and not k.startswith("bases.0.")}}

    def warm_rounds(self) -> int:
        """At least one warm-start round (when there are >= 2 rounds and warm_fraction > 0): bases that start
        identical get identical gradients and uniform alphas forever, so the k-means split is what separates them."""
        r = int(math.floor(self.config.warm_fraction * self.ctx.run.num_rounds))
        return max(r, 1) if self.config.warm_fraction > 0 and self.ctx.run.num_rounds >= 2 else r

    def _keys(self, prefix):
        return [k for k in self.global_keys if k.startswith(prefix)]

    def _params(self, prefix):
        return [p for n, p in self.model.named_parameters() if n.startswith(prefix)]

    def _train(self, cid, r, params, tag, epochs, lr=None):
        named = dict(self.model.named_parameters())
        chosen = {id(p) for p in params}
        was = {n: p.requires_grad for n, p in named.items()}
        for p in named.values():
            p.requires_grad_(id(p) in chosen)
        try:
            hp = self.ctx.hparams(cid)
            return self.ctx.train(cid, r, params=[{"params": params, "lr": lr or hp.lr}], hp=hp, epochs=epochs,
                                  steps=hp.local_steps, tag=tag)
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
                met = self._train(client_id, round_idx, self._params("bases.0."), "warm", c.basis_epochs)
            finally:
                m.major_only = False
            return Update(client_id, {MODEL: self.ctx.snapshot(self._keys("bases.0."))}, n,
                          {MODEL: self.ctx.snapshot(self.private_keys)}, met)
        coef, bases = list(m.coef.values()), self._params("bases.")
        if c.training == "naive":
            m.temperature = 1.0
            named = dict(m.named_parameters())
            met = self._train(client_id, round_idx, list(named.values()), "joint", c.basis_epochs)
        else:
            m.temperature = 1.0
            met_a = self._train(client_id, round_idx, coef, "alpha", c.alpha_epochs, lr=c.lr_coef)
            m.fixed_alpha = {g: torch.softmax(m.coef[g].detach() / c.temperature, 0) for g in m.group_names}
            try:
                met = self._train(client_id, round_idx, bases, "bases", c.basis_epochs)
            finally:
                m.fixed_alpha = None
            met = {**met, "alpha_train_loss": met_a["train_loss"]}
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
            K = self.config.num_bases
            major = [k for k in keys]
            if round_idx == self.warm_rounds():        # v_1..v_K <- k-means centroids of the local models
                X = torch.stack([torch.cat([u.upload[MODEL][k].flatten().double() for k in major]) for u in updates])
                cents = _kmeans(X, K, seed=self.ctx.seed_for(round_idx, 0, "kmeans"))
            else:
                cents = None
            for b in range(1, K + 1):
                off = 0
                for k in major:
                    kk = k.replace("bases.0.", f"bases.{b}.", 1)
                    if cents is None:
                        new[kk] = mean[k].clone()
                    else:
                        num = mean[k].numel()
                        new[kk] = cents[b - 1, off:off + num].view_as(mean[k]).to(mean[k].dtype)
                        off += num
            if cents is not None:
                anchor = {k: new[k].clone() for k in server_state[ANCHOR]}
                return {**server_state, MODEL: new, ANCHOR: anchor}
        return {**server_state, MODEL: new}

    def extra_metrics(self, round_idx, server_state):
        K = self.config.num_bases
        if K < 2:
            return {}
        s = server_state[MODEL]
        vec = [torch.cat([s[k].flatten().double() for k in sorted(s) if k.startswith(f"bases.{b}.")])
               for b in range(1, K + 1)]
        out = {"basis_cosine": _mean_cos(vec)}
        anchor = server_state.get(ANCHOR)
        if anchor and round_idx >= self.warm_rounds():
            d = [v - torch.cat([anchor[k].flatten().double() for k in sorted(s) if k.startswith(f"bases.{b}.")])
                 for b, v in zip(range(1, K + 1), vec)]
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
    def new_client_keys(self):
        keys = [k for k in self.private_keys]
        if self.config.new_client_mode == "head":
            keys += [k for k in self.global_keys if k.startswith("bases.0.classifier")]
        elif self.config.new_client_mode == "full":
            keys += list(self.global_keys)
        return keys

    def personalize_new_client(self, client_id, server_state, data, round_idx):
        self.ctx.load({k: server_state[MODEL][k] for k in self.global_keys})
        self.ctx.load({k: torch.zeros_like(v) for k, v in self.ctx.initial_private.items()})
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
