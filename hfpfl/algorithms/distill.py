"""Server-side ensemble distillation on unlabelled data (PerAda's Line 21, FedDF), one function for both.

Student = the averaged global state; teacher = the *uniform mean of the logits* of the participating clients'
uploaded states on an unlabelled pool (labels never read): by default the out-of-domain pool of
:mod:`hfpfl.data.ood` (``kd_pool='ood'``, the paper's CIFAR-100-for-CIFAR-10), or the dataset's in-domain public
split (``kd_pool='public'``). Loss = KL(softmax(teacher/T) || softmax(student/T)),
``batchmean``, no T^2 factor and no CE term (PerAda code, spec 2.3/6.6); Adam(kd_lr) cosine-annealed to 0 over
``kd_steps`` (spec 6.7). Everything runs through the engine's one model instance: each teacher state is loaded in
turn (teachers in eval mode, spec 6.10 default), so teacher logits are computed once per round over the pool.

Optional checkpoint selection (PerAda code, spec 2.6 detail 2, off by default): ``kd_val_fraction`` > 0 holds out a
labelled part of the public pool; the student is scored every ``kd_eval_every`` steps, the best is kept, and the
plain average is kept when it scores at least as well as every KD checkpoint.

Also: :class:`KDConfig` (the shared flags) and :func:`push_global_adapter` (per-round global adapters as revisions
``round-N`` of a local Hub cache repo, loadable with ``PeftModel.from_pretrained(base, repo, revision="round-3")``).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..federated.state import load_into, snapshot
from ..training import TensorData, evaluate, train_local

logger = logging.getLogger("hfpfl")


@dataclass
class KDConfig:
    use_kd: bool = field(default=True, metadata={
        "help": "Refine the averaged global model by ensemble distillation on the unlabelled pool (--kd_pool) "
                "(False = plain averaging, e.g. 'PerAda w/o KD')."})
    kd_steps: int = field(default=50, metadata={"help": "Server distillation steps R per round (paper: 500/100/50)."})
    kd_lr: float = field(default=1e-3, metadata={"help": "Server Adam learning rate (cosine-annealed to 0 over R)."})
    kd_batch_size: int = field(default=128, metadata={"help": "Distillation batch size."})
    kd_temperature: float = field(default=1.0, metadata={
        "help": "Softmax temperature T of the KL loss (PerAda code default 1; no T^2 factor)."})
    kd_rounds: int | None = field(default=None, metadata={
        "help": "Distil only in rounds 1..kd_rounds (PerAda code: kd_max_round=30 of 200); None = every round."})
    kd_pool: str = field(default="ood", metadata={
        "help": "Unlabelled distillation data: 'ood' (default: hfpfl.data.ood split 'kd' -- letters, symbols, "
                "shapes, textures, photo crops; no client class or image, the CIFAR-100-for-CIFAR-10 analogue of "
                "the paper) or 'public' (the dataset's own held-out public split: in-domain, paper Fig. 4's "
                "'CIFAR-10 val' ablation).", "choices": ["ood", "public"]})
    kd_pool_size: int = field(default=2000, metadata={"help": "Samples of the 'ood' distillation pool."})
    kd_public_fraction: float = field(default=1.0, metadata={
        "help": "Fraction of the distillation pool used (paper Fig. 4 ablation)."})
    kd_val_fraction: float = field(default=0.0, metadata={
        "help": "Hold out this labelled fraction of the public pool for KD checkpoint selection (PerAda code); "
                "0 = off (pure unlabeled KD as the paper describes)."})
    kd_eval_every: int = field(default=5, metadata={"help": "With kd_val_fraction > 0: score the student every N steps."})
    push_adapters_to_hub_cache: str | None = field(default=None, metadata={
        "help": "Local Hub repo id: push the global adapter after every round as revision 'round-N' (and 'main'); "
                "load with PeftModel.from_pretrained(base, repo_id, revision='round-N'). Adapter models only."})

    def __post_init__(self):
        checks = [(self.kd_steps >= 0, "kd_steps must be >= 0"), (self.kd_lr > 0, "kd_lr must be > 0"),
                  (self.kd_batch_size >= 2, "kd_batch_size must be >= 2"),
                  (self.kd_temperature > 0, "kd_temperature must be > 0"),
                  (self.kd_rounds is None or self.kd_rounds >= 0, "kd_rounds must be >= 0"),
                  (0 < self.kd_public_fraction <= 1, "kd_public_fraction must be in (0, 1]"),
                  (self.kd_pool in ("ood", "public"), f"kd_pool must be 'ood' or 'public', got {self.kd_pool!r}"),
                  (self.kd_pool_size >= 2, "kd_pool_size must be >= 2"),
                  (0 <= self.kd_val_fraction < 1, "kd_val_fraction must be in [0, 1)"),
                  (self.kd_eval_every >= 1, "kd_eval_every must be >= 1")]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)
        if self.push_adapters_to_hub_cache is not None:
            from ..hub import validate_repo_id
            validate_repo_id(self.push_adapters_to_hub_cache)

    def kd_active(self, round_idx: int) -> bool:
        return self.use_kd and self.kd_steps > 0 and (self.kd_rounds is None or round_idx <= self.kd_rounds)


def ood_kd_pixels(n: int, image_size: int, num_channels: int) -> torch.Tensor:
    """Model inputs of the first ``n`` samples of the out-of-domain distillation pool (labels dropped)."""
    from ..data.ood import load_ood
    from ..data.transforms import to_model_inputs

    ds = to_model_inputs(load_ood("kd", n), image_size=image_size, num_channels=num_channels)
    return TensorData.from_dataset(ds).pixel_values


def public_pool(sim, config: KDConfig) -> tuple[torch.Tensor, TensorData | None]:
    """(unlabelled KD pixels, labelled selection split or None); cached on the simulation.

    KD pixels come from ``config.kd_pool``: the out-of-domain pool (default) or the dataset's in-domain public split.
    The optional selection split (``kd_val_fraction`` > 0, PerAda code) is always a labelled held-out part of the
    dataset's public split: the server's validation data (PerAda: 5,000 held-out CIFAR-10 training images)."""
    cache = sim.__dict__.setdefault("_kd_pool", {})
    key = (config.kd_pool, config.kd_pool_size, config.kd_public_fraction, config.kd_val_fraction)
    if key not in cache:
        need_public = config.kd_pool == "public" or config.kd_val_fraction > 0
        if need_public and (sim.data.public is None or len(sim.data.public) == 0):
            raise ValueError("this distillation setting needs the dataset's public split (sim.data.public is empty); "
                             "use kd_pool='ood' without kd_val_fraction, or set use_kd=False")
        gen = torch.Generator().manual_seed(sim.args.seed)
        val = None
        pub_rest = None
        if need_public:
            pub = TensorData.from_dataset(sim.data.public)
            perm = torch.randperm(len(pub), generator=gen)
            n_val = int(round(config.kd_val_fraction * len(pub)))
            val_idx, pub_rest = perm[:n_val], perm[n_val:]
            val = TensorData(pub.pixel_values[val_idx], pub.labels[val_idx]) if n_val > 0 else None
        if config.kd_pool == "public":
            pixels = pub.pixel_values[pub_rest]
        else:
            pixels = ood_kd_pixels(config.kd_pool_size, sim.data.image_size, sim.data.num_channels)
        kd_idx = torch.randperm(len(pixels), generator=gen)
        kd_idx = kd_idx[: max(2, int(round(config.kd_public_fraction * len(kd_idx))))]
        cache[key] = (pixels[kd_idx].contiguous(), val)  # KD pixels only: labels are never read
    return cache[key]


@torch.no_grad()
def _logits(model, pixels: torch.Tensor, batch_size: int, device) -> torch.Tensor:
    return torch.cat([model(pixel_values=pixels[i:i + batch_size].to(device)).logits.float().cpu()
                      for i in range(0, len(pixels), batch_size)])


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(softmax(teacher/T) || softmax(student/T)), batch mean (zero, with zero gradient, when they agree)."""
    t = temperature
    return F.kl_div(F.log_softmax(student_logits / t, -1), F.log_softmax(teacher_logits / t, -1),
                    reduction="batchmean", log_target=True)


def ensemble_distill(algo, student: dict, teachers: list[dict], config: KDConfig, round_idx: int) -> tuple[dict, dict]:
    """Distil ``student`` (a global-keys state) from the logit ensemble of ``teachers`` (uploaded global-keys states)
    on the public pool, through ``algo.sim.model``. Returns (new student state, metrics)."""
    sim, model = algo.sim, algo.model
    keys = list(student)
    pixels, val = public_pool(sim, config)
    bs, dev = sim.args.eval_batch_size, sim.device
    model.eval()
    teacher_logits = torch.zeros(0)
    for t in teachers:  # uniform mean of the K teachers' logits (spec 6.6)
        load_into(sim.model_state, {k: t[k] for k in keys})
        lg = _logits(model, pixels, bs, dev)
        teacher_logits = lg if teacher_logits.numel() == 0 else teacher_logits + lg
    teacher_logits /= len(teachers)

    load_into(sim.model_state, student)
    opt = torch.optim.Adam(algo.trainable_parameters(keys), lr=config.kd_lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=config.kd_steps, eta_min=0.0)
    best = {}
    if val is not None:  # the plain average competes too; ties keep it (PerAda code)
        avg_acc = evaluate(model, val, batch_size=bs, device=dev)["accuracy"]
        best.update(state=snapshot(sim.model_state, keys), acc=avg_acc)

    def select(step):  # KD checkpoint selection on the labelled held-out split (PerAda code)
        if val is not None and (step % config.kd_eval_every == 0 or step == config.kd_steps):
            acc = evaluate(model, val, batch_size=bs, device=dev)["accuracy"]  # restores train mode
            if acc > best["acc"]:
                best.update(state=snapshot(sim.model_state, keys), acc=acc)

    losses = []

    def loss_fn(m, batch):
        loss = kd_loss(m(pixel_values=batch["pixel_values"]).logits, batch["teacher_logits"], config.kd_temperature)
        losses.append(float(loss.detach()))
        return loss

    # the student trains in train mode (PerAda code) through the engine's one loop; the public pool is unlabeled:
    # its batches carry the teachers' mean logits instead of labels
    pool = TensorData(pixels, torch.full((len(pixels),), -1), extras={"teacher_logits": teacher_logits})
    train_local(model, pool, opt, batch_size=min(config.kd_batch_size, len(pixels)), max_steps=config.kd_steps,
                generator=sim.generator(round_idx, -1, "kd"), device=dev, loss_fn=loss_fn,
                backward=sim.accelerator.backward, scheduler=sched, after_step=select)
    step = len(losses)
    metrics = {"kd_loss_first": losses[0] if losses else math.nan, "kd_loss_last": losses[-1] if losses else math.nan,
               "kd_steps": step}
    if val is not None:
        metrics.update(kd_val_accuracy=best["acc"], kd_val_accuracy_avg=avg_acc)
        return best["state"], metrics
    return snapshot(sim.model_state, keys), metrics


def push_global_adapter(algo, state: dict, round_idx: int, repo_id: str) -> str:
    """Save the global adapter in ``state`` (adapter slot ``default``) with the model's ``save_pretrained`` and publish
    it as revision ``round-<round_idx>`` (and ``main``) of ``repo_id`` in the local Hub cache. Main process only.
    LoRA: a plain peft folder whose config names the frozen base with this run's head shape
    (``AutoPeftModel.from_pretrained(repo_id, revision=...)``); residual/parallel:
    ``ConvAdapterModel.from_pretrained(base, repo_id, revision=...)``."""
    from ..models.adapters import is_adapter_model
    from ..models.adapters.io import publish_adapter

    sim = algo.sim
    if not is_adapter_model(sim.model):
        raise ValueError("push_adapters_to_hub_cache needs an adapter model (--adapter residual|parallel|lora)")
    if not sim.accelerator.is_main_process:
        return ""
    load_into(sim.model_state, state)
    return publish_adapter(sim.model, repo_id, [f"round-{round_idx}", "main"])
