"""Server-side ensemble distillation on unlabelled data (PerAda's Line 21, FedDF), one function for both.

Student = the averaged global state; teacher = the *uniform mean of the logits* of the participating clients'
uploaded states on an unlabelled pool (labels never read): by default the out-of-domain pool of
:mod:`hfpfl.data.ood` (``kd_pool='ood'``, the paper's CIFAR-100-for-CIFAR-10), or the dataset's in-domain public
split (``kd_pool='public'``). Loss = KL(softmax(teacher/T) || softmax(student/T)) (PerAda Sec. 4, the KD loss of
Line 21: teacher first, Hinton et al.), ``batchmean``, no T^2 factor and no CE term (the PerAda and FedDF code's
``divergence``); Adam(kd_lr) cosine-annealed to 0 over ``kd_steps``. Everything runs through the engine's one model
instance: each teacher state is loaded in turn, so teacher logits are computed once per round over the pool.

Teacher mode (``kd_teacher_mode``): neither paper (PerAda Sec. 4, Alg. 1 Line 21; FedDF) says. ``eval`` (default):
the teachers normalise with their own running statistics and dropout is off: each teacher is the model its client
would deploy. This is what the FedDF code does (``pcode/aggregation/adv_knowledge_transfer.py``,
``BaseKTSolver.prepare_model``: teachers ``eval()``). ``train``: the teachers run in training mode, which is what the
PerAda code does (its ``aggregation/distillation.py``, after FedDF's, calls the clients' models just after their
local ``model.train()`` epochs, under ``no_grad`` without ``eval()``): BatchNorm uses the statistics of each batch of
the pool (here batches of the run's eval batch size, once per round; the code re-runs the teachers on every KD
batch) and dropout is active (a fixed draw per round from the run's seed). The teachers' running statistics this
moves are not kept: every BatchNorm buffer of the model is restored before the student trains.

BatchNorm during distillation: Line 21 updates the adapter's *parameters* w by gradient steps on the KL loss; the
student's BatchNorms run in eval mode (``kd_student_bn='eval'``, default), so they normalise with the averaged
running statistics the global model is evaluated with, and those statistics come back unchanged. The PerAda and
FedDF code train the whole student in train mode, so the distillation pool's batch statistics overwrite the
running statistics of every trainable BN and are returned as global state; both codes then keep the distilled
model only if it beats the plain average on a labelled validation split, which hides the damage. Without that
selection (our default, the paper's text) and with an out-of-domain pool whose statistics differ from the clients'
data, the returned statistics are the pool's, not the clients'. ``kd_student_bn='train'`` reproduces the code.

Optional checkpoint selection (the PerAda code, off by default): ``kd_val_fraction`` > 0 holds out a
labelled part of the public pool; the student is scored every ``kd_eval_every`` steps, the best is kept, and the
plain average is kept when it scores at least as well as every KD checkpoint.

Also: :class:`KDConfig` (the shared flags) and :func:`push_global_adapter` (per-round global adapters as revisions
``round-N`` of a local Hub cache repo, loadable with ``PeftModel.from_pretrained(base, repo, revision="round-3")``).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..federated.state import load_into, snapshot
from ..options import Check, at_least, in_range, one_of, positive, validate
from ..training import TensorData, evaluate, train_local

logger = logging.getLogger("hfpfl")
BN_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def _is_repo_id(value) -> bool:
    from ..hub import validate_repo_id
    try:
        validate_repo_id(value)
    except ValueError:
        return False
    return True


@dataclass
class KDConfig:
    use_kd: bool = field(default=True, metadata={
        "help": "Refine the averaged global model by ensemble distillation on the unlabelled pool (--kd_pool) "
                "(False = plain averaging, e.g. 'PerAda w/o KD')."})
    kd_steps: int = field(default=50, metadata={"help": "Server distillation steps R per round (paper: 500/100/50).",
                                                "check": at_least(0)})
    kd_lr: float = field(default=1e-3, metadata={"help": "Server Adam learning rate (cosine-annealed to 0 over R).",
                                                 "check": positive()})
    kd_batch_size: int = field(default=128, metadata={"help": "Distillation batch size.", "check": at_least(2)})
    kd_temperature: float = field(default=1.0, metadata={
        "help": "Softmax temperature T of the KL loss (PerAda code default 1; no T^2 factor).", "check": positive()})
    kd_rounds: int | None = field(default=None, metadata={
        "help": "Distil only in rounds 1..kd_rounds (PerAda code: kd_max_round=30 of 200); None = every round.",
        "check": at_least(0)})
    kd_pool: str = field(default="ood", metadata={
        "help": "Unlabelled distillation data: 'ood' (default: hfpfl.data.ood split 'kd' -- letters, symbols, "
                "shapes, textures, photo crops; no client class or image, the CIFAR-100-for-CIFAR-10 analogue of "
                "the paper) or 'public' (the dataset's own held-out public split: in-domain, paper Fig. 4's "
                "'CIFAR-10 val' ablation).", "choices": ["ood", "public"]})
    kd_pool_size: int = field(default=2000, metadata={"help": "Samples of the 'ood' distillation pool.",
                                                      "check": at_least(2)})
    kd_public_fraction: float = field(default=1.0, metadata={
        "help": "Fraction of the distillation pool used (paper Fig. 4 ablation).",
        "check": in_range(0, 1, low_open=True)})
    kd_val_fraction: float = field(default=0.0, metadata={
        "help": "Hold out this labelled fraction of the public pool for KD checkpoint selection (PerAda code); "
                "0 = off (pure unlabeled KD as the paper describes).", "check": in_range(0, 1, high_open=True)})
    kd_eval_every: int = field(default=5, metadata={"help": "With kd_val_fraction > 0: score the student every N steps.",
                                                    "check": at_least(1)})
    kd_teacher_mode: str = field(default="eval", metadata={
        "help": "Mode of the teachers when their logits are taken: eval (running statistics, no dropout) | train "
                "(BatchNorm on the pool's batch statistics, dropout active: the PerAda code; FedDF's code uses eval). "
                "Running statistics are restored either way.", "check": one_of("eval", "train")})
    kd_student_bn: str = field(default="eval", metadata={
        "help": "BatchNorm mode of the student during distillation: eval (running statistics used and left "
                "unchanged: only parameters are distilled) | train (batch statistics; the pool's statistics "
                "overwrite the running ones, as the PerAda/FedDF code).", "check": one_of("eval", "train")})
    push_adapters_to_hub_cache: str | None = field(default=None, metadata={
        "help": "Local Hub repo id: push the global adapter after every round as revision 'round-N' (and 'main'); "
                "load with PeftModel.from_pretrained(base, repo_id, revision='round-N'). Adapter models only.",
        "check": Check(_is_repo_id, "a Hub repo id 'org/name' of letters, digits, '.', '_', '-' (max 96 chars)")})
    #: the options that set the step size of what this method trains (named when training diverges; --lr always is)
    STEP_SIZES: ClassVar[dict[str, str]] = {"kd_lr": "lower"}

    def __post_init__(self):
        validate(self)

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
    cache = sim.cache("kd_pool")
    key = (config.kd_pool, config.kd_pool_size, config.kd_public_fraction, config.kd_val_fraction)
    if key not in cache:
        need_public = config.kd_pool == "public" or config.kd_val_fraction > 0
        if need_public and (sim.data.public is None or len(sim.data.public) == 0):
            raise ValueError("this distillation setting needs the dataset's public split (sim.data.public is empty); "
                             "use kd_pool='ood' without kd_val_fraction, or set use_kd=False")
        gen = torch.Generator().manual_seed(sim.run.seed)
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


def _teacher_logits(sim, model, teachers: list[dict], keys: list, pixels: torch.Tensor, config: KDConfig,
                    round_idx: int) -> torch.Tensor:
    """The uniform mean of the K teachers' logits over the pool (the PerAda code), in ``config.kd_teacher_mode``."""
    bs, dev = sim.run.eval_batch_size, sim.device
    train = config.kd_teacher_mode == "train"
    # train mode moves running statistics (also of BNs outside ``keys``): all of them are put back afterwards
    stats = snapshot(sim.model_state, [k for k in sim.model_state if k.endswith(BN_BUFFERS)]) if train else {}
    model.train(train)
    teacher_logits = torch.zeros(0)
    cuda = torch.device(dev).type == "cuda"
    with torch.random.fork_rng(devices=[dev] if cuda else []):
        if train:  # dropout draws: fixed per run seed and round, not the global RNG's state (restored after)
            seed = sim.generator(round_idx, -1, "kd-teacher").initial_seed()
            torch.default_generator.manual_seed(seed)
            if cuda:
                torch.cuda.manual_seed(seed)
        for t in teachers:
            load_into(sim.model_state, {k: t[k] for k in keys})
            lg = _logits(model, pixels, bs, dev)
            teacher_logits = lg if teacher_logits.numel() == 0 else teacher_logits + lg
    load_into(sim.model_state, stats)
    model.eval()
    return teacher_logits / len(teachers)


def ensemble_distill(algo, student: dict, teachers: list[dict], config: KDConfig, round_idx: int) -> tuple[dict, dict]:
    """Distil ``student`` (a global-keys state) from the logit ensemble of ``teachers`` (uploaded global-keys states)
    on the public pool, through ``algo.ctx.model``. Returns (new student state, metrics)."""
    sim, model = algo.ctx, algo.model
    keys = list(student)
    pixels, val = public_pool(sim, config)
    bs, dev = sim.run.eval_batch_size, sim.device
    teacher_logits = _teacher_logits(sim, model, teachers, keys, pixels, config, round_idx)

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
    norms = [mod for mod in model.modules() if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm)]

    def loss_fn(m, batch):
        if config.kd_student_bn == "eval":  # every step: the loop (and the selection's evaluation) calls train()
            for mod in norms:
                mod.eval()
        loss = kd_loss(m(pixel_values=batch["pixel_values"]).logits, batch["teacher_logits"], config.kd_temperature)
        losses.append(float(loss.detach()))
        return loss

    # the student trains through the engine's one loop (dropout active; BatchNorm per kd_student_bn); the public
    # pool is unlabeled: its batches carry the teachers' mean logits instead of labels
    pool = TensorData(pixels, torch.full((len(pixels),), -1), extras={"teacher_logits": teacher_logits})
    train_local(model, pool, opt, batch_size=min(config.kd_batch_size, len(pixels)), max_steps=config.kd_steps,
                generator=sim.generator(round_idx, -1, "kd"), device=dev, loss_fn=loss_fn,
                backward=sim.backward, scheduler=sched, after_step=select)
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

    sim = algo.ctx
    if not is_adapter_model(sim.model):
        raise ValueError("push_adapters_to_hub_cache needs an adapter model (--adapter residual|parallel|lora)")
    if not sim.is_main_process:
        return ""
    load_into(sim.model_state, state)
    return publish_adapter(sim.model, repo_id, [f"round-{round_idx}", "main"])
