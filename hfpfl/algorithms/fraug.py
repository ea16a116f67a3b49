"""FRAug (Chen et al., ICCV 2023; dissertation ch. 2): federated representation augmentation under feature shift.

Method card: ``docs/methods/fraug.md``. Where the authors' code
and the dissertation text disagree, the dissertation wins here:
z ~ N(0, I) (not U[0,1)); L_cls = L_real + L_syn (plain sum, Eq. 1; ``--cls_loss weighted`` for the code's weighting,
see :func:`cls_ratio`); lambda_c ramps up (Eq. 4 + App. A.2); the RTNet
sees v_hat only; the server takes the unweighted 1/K mean (Alg. 1); L_gen uses the batch labels y (Eq. 5 text; the
the authors' code uses class-balanced labels: ``--balanced_gen_labels``); FedBN-style local BatchNorm
(affine + statistics) in the classifier, the generator's BN shared. Spec defaults adopted where the paper is silent:
sum over classes as a class-balanced batch of B_syn cyclic labels (1.10 #3), detached u and v_hat (#5), the code's
multi-kernel Gaussian MMD (#7), EMA skips absent classes (#9), prototypes start at zero and persist (#11), eval-mode
BN for the stage-2 real embeddings (#17), optimizer state kept per client across rounds (#18).

Everything lives in one model (:class:`hfpfl.models.fraug.FRAugModel`), so the engine's key roles say what travels:
global = the classifier without its BatchNorms + the generator g (omega); private = the classifier's BatchNorms, the
RTNet (phi) and the EMA prototypes -- they never leave the client. One local step = three optimizers alternating on
the same batch (``ctx.train(params=[theta, omega, phi], loss_fn=[cls, gen, rt])``):

1. classifier: L_real + L_syn, with u_hat = u.detach() + lam_syn m(g(z, y)) and u_hat_c = proto[c] + lam_syn m(g(z', c))
   built under no_grad, so L_syn reaches only h;
2. generator: CE(h(v_hat), y) - alpha MMD(v_hat, u_ref), theta fixed (h used with detached weights), u_ref = f(X) in
   eval mode;
3. RTNet: -H(h(u_hat)) - H(h(u_hat_c)) + beta (MMD(u_hat, u_ref) + MMD(u_hat_c, proto[c])), theta and omega fixed.

Ablations (paper Table 5): ``--use_rtnet false --use_ema false`` (G only: the head also trains on v_hat itself),
``--use_generator false --use_ema false`` (RTNet only: its input is the client's own real embedding instead of the
shared generator's v_hat, "RTNet solely based on local data"), ``--use_ema false`` (G + RTNet without u_hat_c).
Unused modules get the role ``frozen``: they neither train nor travel.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch.nn import functional as F

from ..models.fraug import FRAugModel, entropy, mmd
from ..options import at_least, in_range, non_negative, positive, validate
from .base import FROZEN, GLOBAL, MODEL, OPTIM, PRIVATE, Algorithm, Update, register


@dataclass
class FRAugConfig:
    d_z: int = field(default=32, metadata={"help": "Noise dimension d_z (also the RTNet's hidden width); paper 128/256, "
                                                   "CPU scale 32.", "check": at_least(1)})
    syn_batch_size: int = field(default=32, metadata={"help": "B_syn: class-balanced synthetic batch for u_hat_c.",
                                                      "check": at_least(2)._replace(allowed=">= 2 (BatchNorm)")})
    gen_lr: float = field(default=0.005, metadata={"help": "eta_g, generator SGD learning rate (paper Digits 0.005).",
                                                   "check": positive()})
    rtnet_lr: float = field(default=0.005, metadata={"help": "eta_m, RTNet SGD learning rate (paper Digits 0.005).",
                                                     "check": positive()})
    aux_momentum: float = field(default=0.5, metadata={"help": "SGD momentum of the generator and RTNet optimizers.",
                                                       "check": in_range(0, 1, high_open=True)})
    mmd_alpha: float = field(default=1.0, metadata={"help": "alpha: weight of -MMD(v_hat, u) in L_gen (paper Digits 1).",
                                                    "check": non_negative()})
    mmd_beta: float = field(default=1.5, metadata={"help": "beta: weight of the MMD terms in L_rt (paper Digits 1.5).",
                                                   "check": non_negative()})
    lambda_0: float = field(default=0.3, metadata={"help": "EMA momentum lambda_0 after the ramp-up.",
                                                   "check": in_range(0, 1)})
    ramp_fraction: float = field(default=0.05, metadata={"help": "r_0 = ramp_fraction * R: lambda_c ramp-up length.",
                                                         "check": in_range(0, 1)})
    syn_gamma: float = field(default=0.01, metadata={"help": "lambda_syn = exp(syn_gamma * (r - R)).",
                                                     "check": non_negative()})
    schedule_rounds: int | None = field(default=None, metadata={
        "help": "R in the schedules (default: --num_rounds).", "check": at_least(1)})
    use_generator: bool = field(default=True, metadata={"help": "Ablation: the shared generator G (v_hat)."})
    use_rtnet: bool = field(default=True, metadata={"help": "Ablation: the local RTNet (u_hat)."})
    use_ema: bool = field(default=True, metadata={"help": "Ablation: the EMA-prototype path (u_hat_c)."})
    balanced_gen_labels: bool = field(default=False, metadata={
        "help": "L_gen on class-balanced cyclic labels (authors' code) instead of the batch labels (paper)."})
    rtnet_label_conditioned: bool = field(default=False, metadata={
        "help": "RTNet input concat(v_hat, onehot(y)) (authors' code) instead of v_hat (paper)."})
    cls_loss: str = field(default="sum", metadata={
        "help": "Stage-1 classifier loss: 'sum' = L_real + L_syn (paper Sec. 3.3.2, Eq. 1) or 'weighted' = "
                "(1 - rho) L_real + rho L_syn' (authors' code, users/user_FRAug.py): L_syn' the mean of the synthetic "
                "paths (CE(h(u_hat), y) and, with --use_ema, CE(h(u_hat_c), c)), rho = min(0.5, exp(gamma' (r - R))), "
                "gamma' = --cls_ratio_gamma.", "choices": ["sum", "weighted"]})
    cls_ratio_gamma: float | None = field(default=None, metadata={
        "help": "gamma' of --cls_loss weighted's rho = min(0.5, exp(gamma' (r - R))); default --syn_gamma (the "
                "authors' code uses one gamma for both; its Digits config 0.002, PACS/OfficeHome 0.01).",
        "check": non_negative()})
    uniform_aggregation: bool = field(default=True, metadata={
        "help": "Server mean 1/K (paper Alg. 1); false: weighted by client sizes (authors' code)."})
    keep_optimizer_state: bool = field(default=True, metadata={
        "help": "Keep each client's momentum buffers across rounds (the authors' code)."})
    plot_embeddings: bool = field(default=True, metadata={
        "help": "At the end, write fraug_embeddings.png (2-D PCA of real vs generated embeddings per client)."})

    #: the options that set the step size of what this method trains (named when training diverges; --lr always is)
    STEP_SIZES: ClassVar[dict[str, str]] = {"gen_lr": "lower", "rtnet_lr": "lower"}

    def __post_init__(self):
        validate(self)
        if not (self.use_generator or self.use_rtnet):
            raise ValueError("--use_generator and --use_rtnet cannot both be false: fraug needs the generator or the "
                             "RTNet; set one of them to true")


# ------------------------------------------------------------------------------------------------ schedules
def lambda_syn(r: int, R: int, gamma: float = 0.01) -> float:
    """exp(gamma (r - R)): 1 at r = R (App. A.2)."""
    return math.exp(gamma * (r - R))


def lambda_c(r: int, R: int, lambda_0: float = 0.3, ramp_fraction: float = 0.05) -> float:
    """lambda_0 exp(-5 (1 - r / r_0)) for r < r_0 = ramp_fraction R, else lambda_0 (App. A.2)."""
    r0 = ramp_fraction * R
    return lambda_0 * math.exp(-5.0 * (1.0 - r / r0)) if r < r0 else lambda_0


def cls_ratio(r: int, R: int, gamma: float) -> float:
    """rho = min(0.5, exp(gamma (r - R))): the synthetic loss's weight in the authors' code's classifier loss
    (1 - rho) L_real + rho L_syn' (``L_ratio`` in their users/user_FRAug.py); the paper's Eq. 1 has no weight."""
    return min(0.5, math.exp(gamma * (r - R)))


@torch.no_grad()
def ema_update(prototypes: torch.Tensor, u: torch.Tensor, labels: torch.Tensor, lam: float, eps: float = 1e-8) -> None:
    """Eq. 4 in place, for the classes present in the batch only (a choice the paper leaves open; docs/methods/fraug.md)."""
    onehot = F.one_hot(labels, prototypes.shape[0]).to(u.dtype)
    counts = onehot.sum(0)
    means = onehot.t() @ u / (counts[:, None] + eps)
    present = counts > 0
    prototypes[present] = (1 - lam) * prototypes[present] + lam * means[present]


def balanced_labels(n: int, num_labels: int, device=None) -> torch.Tensor:
    return torch.arange(n, device=device) % num_labels


class FRAugStages:
    """The three loss functions of one local step, sharing the step's noise. Usable alone (tests) or through
    ``ctx.train``. ``noise`` is a CPU torch.Generator (determinism on any device). ``rho``: the synthetic loss's
    weight under ``--cls_loss weighted`` (:func:`cls_ratio`); unused by the paper's plain sum."""

    def __init__(self, model: FRAugModel, cfg: FRAugConfig, lam_syn: float, lam_c: float, noise: torch.Generator,
                 rho: float = 0.5):
        self.m, self.cfg, self.lam_syn, self.lam_c, self.noise, self.rho = model, cfg, lam_syn, lam_c, noise, rho
        self.step: dict = {}
        self.log = {"loss_cls": [], "loss_real": [], "loss_syn": [], "loss_gen": [], "loss_rt": []}

    def _randn(self, n: int, like: torch.Tensor) -> torch.Tensor:
        return torch.randn(n, self.cfg.d_z, generator=self.noise).to(like.device, like.dtype)

    def head_fixed(self, u: torch.Tensor) -> torch.Tensor:
        """h with detached weights: stage-2 losses reach only omega / phi (theta fixed)."""
        lin = self.m.net.classifier[-1]
        return F.linear(u.flatten(1), lin.weight.detach(), lin.bias.detach() if lin.bias is not None else None)

    def _inputs(self, v_real: torch.Tensor, y: torch.Tensor, z: torch.Tensor, z2: torch.Tensor, c: torch.Tensor):
        """The RTNet/generator inputs of the two synthetic paths: g(z, y), g(z', c) -- or, without a generator
        (RTNet-only ablation), the client's own embeddings (real batch, prototypes)."""
        if self.cfg.use_generator:
            return self.m.generator(z, y), self.m.generator(z2, c)
        return v_real, self.m.prototypes[c]

    def synthetic(self, u: torch.Tensor, y: torch.Tensor, z, z2, c):
        """(u_hat, u_hat_c) from detached real embeddings u (Eq. 3); G-only: (v_hat, proto_c + lam v_hat_c)."""
        v1, v2 = self._inputs(u, y, z, z2, c)
        proto = self.m.prototypes[c]
        if not self.cfg.use_rtnet:                      # G only: client-agnostic v_hat itself
            return v1, proto + self.lam_syn * v2
        return (u + self.lam_syn * self.m.rtnet(v1, y), proto + self.lam_syn * self.m.rtnet(v2, c))

    # ---------------------------------------------------------------- stage 1: classifier (theta)
    def loss_cls(self, model, batch) -> torch.Tensor:
        x, y = batch["pixel_values"], batch["labels"]
        u = self.m.embed(x)
        loss_real = F.cross_entropy(self.m.head(u), y)
        u_d = u.detach()
        if self.cfg.use_ema:
            ema_update(self.m.prototypes, u_d, y, self.lam_c)
        z, z2 = self._randn(len(y), u), self._randn(self.cfg.syn_batch_size, u)
        c = balanced_labels(self.cfg.syn_batch_size, self.m.num_labels, u.device)
        self.step = {"z": z, "z2": z2, "c": c}
        with torch.no_grad():
            u_hat, uc_hat = self.synthetic(u_d, y, z, z2, c)
        loss_syn = F.cross_entropy(self.m.head(u_hat), y)  # L_syn reaches h only: its inputs carry no graph
        if self.cfg.use_ema:
            loss_syn = loss_syn + F.cross_entropy(self.m.head(uc_hat), c)
        if self.cfg.cls_loss == "weighted":   # the authors' code: the paths' mean, weighted against L_real
            paths = 2 if self.cfg.use_ema else 1
            loss = (1 - self.rho) * loss_real + self.rho * (loss_syn / paths)
        else:                                 # the paper's Eq. 1
            loss = loss_real + loss_syn
        for k, v in (("loss_real", loss_real), ("loss_syn", loss_syn), ("loss_cls", loss)):
            self.log[k].append(float(v.detach()))
        return loss

    def real_reference(self, x: torch.Tensor) -> torch.Tensor:
        """u_ref = f(X) with theta fixed: no graph, BatchNorm in eval mode (as the authors' code)."""
        if "u_ref" not in self.step:
            was = self.m.net.training
            self.m.net.eval()
            with torch.no_grad():
                self.step["u_ref"] = self.m.embed(x)
            self.m.net.train(was)
        return self.step["u_ref"]

    # ---------------------------------------------------------------- stage 2a: generator (omega)
    def loss_gen(self, model, batch) -> torch.Tensor:
        x, y = batch["pixel_values"], batch["labels"]
        u_ref = self.real_reference(x)
        y_g = balanced_labels(len(y), self.m.num_labels, y.device) if self.cfg.balanced_gen_labels else y
        v_hat = self.m.generator(self._randn(len(y), u_ref), y_g)
        loss = F.cross_entropy(self.head_fixed(v_hat), y_g) - self.cfg.mmd_alpha * mmd(v_hat, u_ref)
        self.log["loss_gen"].append(float(loss.detach()))
        return loss

    # ---------------------------------------------------------------- stage 2b: RTNet (phi)
    def loss_rt(self, model, batch) -> torch.Tensor:
        x, y = batch["pixel_values"], batch["labels"]
        u_ref = self.real_reference(x)
        st = self.step
        with torch.no_grad():                             # v_hat detached: L_rt does not reach omega
            v1, v2 = self._inputs(u_ref, y, st["z"], st["z2"], st["c"])
        c, proto = st["c"], self.m.prototypes[st["c"]]
        u_hat = u_ref + self.lam_syn * self.m.rtnet(v1, y)
        loss = -entropy(self.head_fixed(u_hat)) + self.cfg.mmd_beta * mmd(u_hat, u_ref)
        if self.cfg.use_ema:
            uc_hat = proto + self.lam_syn * self.m.rtnet(v2, c)
            loss = loss - entropy(self.head_fixed(uc_hat)) + self.cfg.mmd_beta * mmd(uc_hat, proto)
        self.log["loss_rt"].append(float(loss.detach()))
        self.step = {}
        return loss

    def stages(self) -> tuple[list, list]:
        """(parameter groups per optimizer, loss functions), in the order of one local step."""
        cfg, m = self.cfg, self.m
        params = [[{"params": [p for p in m.net.parameters() if p.requires_grad]}]]
        fns = [self.loss_cls]
        if cfg.use_generator:
            params.append([{"params": list(m.generator.parameters()), "lr": cfg.gen_lr, "momentum": cfg.aux_momentum}])
            fns.append(self.loss_gen)
        if cfg.use_rtnet:
            params.append([{"params": list(m.rtnet.parameters()), "lr": cfg.rtnet_lr, "momentum": cfg.aux_momentum}])
            fns.append(self.loss_rt)
        return params, fns


@register
class FRAug(Algorithm):
    """FRAug: shared embedding generator + local RTNet augment the head's training in embedding space."""

    name = "fraug"
    local_update = "own"
    Config = FRAugConfig
    has_global_model = False  # local BatchNorm (FedBN): evaluation is per client

    def build_model(self):
        if self.ctx.run.adapter != "none":
            raise ValueError("fraug trains the whole classifier: use --adapter none")
        return FRAugModel(self.ctx.build_default_model(), self.config.d_z, self.config.rtnet_label_conditioned)

    def key_role(self, key, default):
        cfg = self.config
        if key == "prototypes":
            return PRIVATE if cfg.use_ema else FROZEN
        if key.startswith("rtnet."):
            return PRIVATE if cfg.use_rtnet else FROZEN
        if key.startswith("generator."):
            return default if cfg.use_generator else FROZEN
        if not hasattr(self, "_norm_prefixes"):
            from .fedbn import norm_key_prefixes
            self._norm_prefixes = tuple("net." + p for p in norm_key_prefixes(self.model.net))
        if default == GLOBAL and key.startswith(self._norm_prefixes):
            return PRIVATE  # FedBN: the classifier's BatchNorms (affine + statistics) stay local
        return default

    def aggregation_weights(self, client_ids):
        if self.config.uniform_aggregation:
            return {c: 1.0 for c in client_ids}
        return super().aggregation_weights(client_ids)

    def rounds(self) -> int:
        return self.config.schedule_rounds or self.ctx.run.num_rounds

    def stages_for(self, client_id: int, round_idx: int) -> FRAugStages:
        R, cfg = self.rounds(), self.config
        gamma = cfg.syn_gamma if cfg.cls_ratio_gamma is None else cfg.cls_ratio_gamma
        return FRAugStages(self.model, cfg, lambda_syn(round_idx, R, cfg.syn_gamma),
                           lambda_c(round_idx, R, cfg.lambda_0, cfg.ramp_fraction),
                           self.ctx.generator(round_idx, client_id, "fraug-noise"), rho=cls_ratio(round_idx, R, gamma))

    def client_update(self, client_id, down, private, round_idx):
        private = private or {}
        self.load_client(down, private)
        st = self.stages_for(client_id, round_idx)
        params, fns = st.stages()
        keep = self.config.keep_optimizer_state
        metrics = self.local_train(client_id, round_idx, params=params, loss_fn=fns,
                                   optimizer_state=private.get(OPTIM, {}) if keep else None)
        metrics.update({k: sum(v) / len(v) for k, v in st.log.items() if v})
        metrics["train_loss"] = metrics["loss_cls"]  # the classifier's loss (comparable to the baselines')
        metrics.update(lambda_syn=st.lam_syn, lambda_c=st.lam_c)
        if self.config.cls_loss == "weighted":
            metrics["cls_ratio"] = st.rho
        new_private = {MODEL: self.ctx.snapshot(self.private_keys)}
        if keep:
            new_private[OPTIM] = metrics.pop("optimizer_state")
        return Update(client_id, {MODEL: self.ctx.snapshot(self.global_keys)},
                      len(self.ctx.train_data(client_id)), new_private, metrics)

    def new_client_keys(self):
        return [k for k in self.global_keys + self.private_keys if k.startswith("net.")]

    # ---------------------------------------------------------------- real vs generated embeddings (final round)
    @torch.no_grad()
    def embedding_sets(self, client_id: int, server_state, private, round_idx: int, n: int = 200) -> dict:
        """Real embeddings f(X) of the client's training data and, with as many noise draws, the generator's v_hat and
        the client-specific u_hat = u + lam_syn m(g(z, y)) (numpy arrays + labels)."""
        model = self.load_personal(client_id, server_state, private, round_idx)
        data = self.ctx.train_data(client_id)
        idx = torch.arange(min(n, len(data)))
        batch = {k: v.to(self.ctx.device) for k, v in data.select(idx).items()}
        model.eval()
        u = model.embed(batch["pixel_values"])
        y = batch["labels"]
        st = self.stages_for(client_id, round_idx)
        st.lam_syn = lambda_syn(round_idx, self.rounds(), self.config.syn_gamma)
        z = st._randn(len(y), u)
        out = {"real": u.cpu().numpy(), "labels": y.cpu().numpy()}
        if self.config.use_generator:
            out["v_hat"] = model.generator(z, y).cpu().numpy()
        u_hat, _ = st.synthetic(u, y, z, z[:2], y[:2])
        out["u_hat"] = u_hat.cpu().numpy()
        model.train()
        return out

    def extra_metrics(self, round_idx, server_state):
        if not (self.config.plot_embeddings and round_idx == self.ctx.run.num_rounds):
            return {}
        mine = []
        for cid in self.ctx.owned(range(self.ctx.num_clients)):
            torch.manual_seed(self.ctx.seed_for(round_idx, cid, "fraug-plot"))
            private = self.ctx.private_state(cid)
            self.ctx.load((private or {}).get(MODEL) or self.ctx.initial_private)
            mine.append((cid, self.embedding_sets(cid, server_state, private, round_idx)))
        sets = sorted(self.ctx.gather(mine), key=lambda t: t[0])
        if self.ctx.is_main_process:
            names = {cid: str(self.ctx.client(cid).domain) for cid, _ in sets}
            plot_embeddings(sets, names, self.ctx.output_dir / "fraug_embeddings.png")
        return {}


def plot_embeddings(sets, names: dict, path) -> None:
    """One panel per client: a 2-D PCA (fitted on the real embeddings) of real u, generated v_hat and u_hat."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    k = len(sets)
    cols = min(4, k)
    rows = (k + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.0 * rows), squeeze=False)
    styles = {"real": ("o", 0.35, "real u"), "u_hat": ("^", 0.35, "u_hat (client-specific)"),
              "v_hat": ("x", 0.35, "v_hat (generator)")}
    for ax, (cid, s) in zip(axes.flat, sets):
        mean = s["real"].mean(0)
        _, _, vt = np.linalg.svd(s["real"] - mean, full_matrices=False)
        for key, (marker, a, label) in styles.items():
            if key in s:
                p = (s[key] - mean) @ vt[:2].T
                ax.scatter(p[:, 0], p[:, 1], c=s["labels"], cmap="tab10", marker=marker, s=10, alpha=a, label=label)
        ax.set_title(f"client {cid} ({names.get(cid, '')})", fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    for ax in list(axes.flat)[k:]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7, loc="best")
    fig.suptitle("FRAug: real vs generated embeddings (PCA of real; colour = class)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
