"""FedDAT (Chen et al., AAAI 2024; dissertation ch. 3): federated dual-adapter teacher, and its PEFT baselines.

Method card: ``docs/methods/feddat.md``. Methods (all on :class:`hfpfl.models.vqa.VQAModel`, a frozen pretrained
ViLT or BLIP; the ViLT head is per client and private in every method, as the paper's Algorithm 1, and scores the
client's own answer pool A^k, the paper's "Problem Statement" and "Implementation Details"):

==========================  =========================================================================================
``feddat``                  A_s (global: the only thing that travels, 1/K mean), A_c + head private, Â_s = frozen copy
                            of the received A_s re-copied every round; per batch: (1) A_s step on
                            CE(z_s) + alpha KD(z_s <- z_DAT), (2) A_c step on CE(z_DAT) + beta KD(z_DAT <- z_s);
                            inference with A_s. ``--mutual false``: the "w/o MKD" ablation (beta = 0, only DAT -> A_s).
                            ``--teacher local|frozen``: Table 4's "w/o Â_s" / "w/o A_c" teachers
                            (w/o A_c: the teacher Â_s is frozen, so there is no L^DAT step; A_c is unused).
``vqa_adapter``             Adapter: one adapter per block (= A_s), FedAvg (Eq. 2-3, 1/K as the authors' code), head private.
``vqa_adapter_local``       Adapter-L: the same adapter trained locally only (nothing travels).
``vqa_peft``                ``--peft lora|prompt|bias|full|head``: LoRA / prompt / bias / full fine-tuning / clf-L with
                            FedAvg of the PEFT module (the head stays local); ``--local_only true`` for the -L variants.
==========================  =========================================================================================

Choices where the paper is silent (the authors' code decides, and it is said here):

* KD: standard KD with teacher detached, ``T^2 KL(softmax(teacher/T) || softmax(student/T))``, T = 3 (the authors' code).
* alpha = beta = exp(-5 (1 - t/T0)) (the paper's App. B.2), t = the client's cumulative local steps, T0 = R x steps per
  round; ``--kd_schedule round`` restarts t every round, ``constant`` is the authors' code's fixed 1 with the global 1/2.
* Update order as the authors' code: A_s first (teacher = DAT before the update), then A_c (teacher = the z_s of step 1).
* Two AdamW optimizers (A_s + head, then A_c), betas (0.9, 0.98), weight decay 0.01, each with warm-up 10% + linear
  decay to 0 over exactly one round's local steps, restarted every round (the paper). The baselines use the same
  optimizer and schedule, passed to the engine's loop as ``ctx.train(optimizer=..., schedule=...)``.
* The client head is trained by L^s only: one head step per batch, as in Adapter (``--head_loss shared``). Algorithm 1
  optimises "A_s via L^s" and "DAT via L^DAT", where DAT is Â_s + A_c (Eq. 4, Fig. 2a) and the head belongs to the
  deployed model f(x; theta, A_s, head); the paper never trains the head with L^DAT. ``--head_loss both`` is the
  authors' code (the head always has requires_grad, so both steps move it: two head steps per batch).
* Each client's head scores its own answer pool A^k, the answers of its training split (``--answer_pool client``):
  the paper's C^k-way classification ("Problem Statement") with client-specific heads for ViLT and answer lists for
  ALBEF ("Implementation Details"); ``--answer_pool all`` scores every answer of the benchmark.
* Server mean 1/K (Alg. 1); ``--weighting samples`` for N_k.
* CE on the single answer (easy-vqa has one answer per question).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from ..models.vqa import build_vqa_peft_model
from ..models.vqa_model import MODES, PEFT_KINDS, AnswerAccuracy, kd_loss, kd_ramp
from ..options import at_least, in_range, one_of, positive, validate
from ..training import batch_bounds, model_inputs
from .base import FROZEN, GLOBAL, MODEL, PRIVATE, Algorithm, Update, register

KD_SCHEDULES = ("ramp", "round", "constant")


def steps_per_epoch(n: int, batch_size: int, last: str = "merge") -> int:
    """Batches of :func:`hfpfl.training.iterate_batches` (``last``: the run's ``--last_batch``)."""
    return len(batch_bounds(n, batch_size, last))


def warmup_linear(total: int, warmup: float = 0.1):
    w = max(1, int(round(warmup * total)))
    return lambda s: (s + 1) / w if s < w else max(0.0, (total - s) / max(1, total - w))


@dataclass
class VQAPeftConfig:
    peft: str = field(default="adapter", metadata={"help": f"PEFT module: {' | '.join(PEFT_KINDS)} (head = clf-L).",
                                                   "check": one_of(*PEFT_KINDS)})
    local_only: bool = field(default=False, metadata={"help": "Train locally only, nothing travels (Adapter-L, ...)."})
    weighting: str = field(default="uniform", metadata={
        "help": "Server mean: uniform (1/K, Alg. 1 and the authors' code) | samples (N_k, Eq. 3).",
        "check": one_of("uniform", "samples")})
    reduction: int = field(default=16, metadata={"help": "Adapter reduction factor (r = d / reduction).",
                                                 "check": at_least(1)})
    adapter_init: str = field(default="normal", metadata={"help": "normal (N(0,0.02), the authors' code) | zero (W_up = 0).",
                                                          "check": one_of("normal", "zero")})
    head_init: str = field(default="random", metadata={
        "help": "ViLT client head: random (Algorithm 1's init_head) | pretrained (the foundation model's pool head).",
        "check": one_of("random", "pretrained")})
    answer_pool: str = field(default="client", metadata={
        "help": "The answers a client's head scores: client (the answers of its own training split, A^k: the paper's "
                "client-specific heads and answer lists) | all (every answer of the benchmark).",
        "check": one_of("client", "all")})
    warmup: float = field(default=0.1, metadata={
        "help": "LR warm-up fraction of each round's local steps.",
        "check": in_range(0, 1)._replace(allowed="a fraction in [0, 1] of each round's local steps (e.g. 0.1)")})

    def __post_init__(self):
        validate(self)


@register
class VQAPeft(Algorithm):
    """PEFT of a frozen VQA foundation model with FedAvg of the PEFT module (head local); the paper's baselines."""

    name = "vqa_peft"
    local_update = "own"
    personal_model = "own"
    Config = VQAPeftConfig
    has_global_model = False      # every client scores with its own head (the paper reports client-local test accuracy)
    uses_client_hparams = Algorithm.uses_client_hparams - {"momentum"}  # AdamW (``optimizer``): no momentum

    # ----------------------------------------------------------------- model and roles
    def build_model(self):
        from ..runtime import preserved_rng

        with preserved_rng():
            return build_vqa_peft_model(self.ctx.run.model, list(self.ctx.data.label_names), peft=self.peft_kind(),
                                        reduction=self.config.reduction, lora_r=self.ctx.run.lora_r,  # the run's --lora_r (paper: 16 on d = 768)
                                        
                                        adapter_init=self.config.adapter_init, head_init=self.config.head_init)

    def peft_kind(self) -> str:
        return self.config.peft

    def key_role(self, key, default):
        if key.startswith("backbone.classifier."):
            return PRIVATE                                  # the client head never travels
        if self.config.local_only and default == GLOBAL:
            return PRIVATE
        if key.startswith("backbone.") and default == PRIVATE:
            return FROZEN       # tied, frozen weights (BLIP's decoder = word embeddings) are not client state
        return default

    def metric(self):
        return AnswerAccuracy()

    def aggregation_weights(self, client_ids):
        if self.config.weighting == "uniform":
            return {c: 1.0 for c in client_ids}
        return super().aggregation_weights(client_ids)

    def reduce(self, server_state, sums, round_idx):
        if not self.global_keys:
            return server_state                             # local-only: nothing to aggregate
        return super().reduce(server_state, sums, round_idx)

    def client_answer_pool(self, client_id) -> torch.Tensor | None:
        """A^k as a bool mask over the benchmark's answers: the answers of the client's training split (``None``:
        ``--answer_pool all``)."""
        if self.config.answer_pool == "all":
            return None
        pool = torch.zeros(len(self.ctx.data.label_names), dtype=torch.bool)
        pool[self.ctx.train_data(client_id).columns["answer"].long()] = True
        return pool

    def load_client_pool(self, client_id) -> None:
        self.model.set_answer_pool(self.client_answer_pool(client_id))

    # ----------------------------------------------------------------- local training
    def set_mode(self, mode: str) -> None:
        self.model.mode = mode if self.model.peft == "adapter" else "none"

    @staticmethod
    def optimizer(params, hp):
        params = [p for p in params if p.requires_grad]
        return torch.optim.AdamW(params, lr=hp.lr, betas=(0.9, 0.98), eps=1e-8, weight_decay=hp.weight_decay)

    def round_steps(self, client_id) -> tuple[int, int]:
        hp = self.ctx.hparams(client_id)
        per_epoch = steps_per_epoch(len(self.ctx.train_data(client_id)), hp.batch_size, self.ctx.run.last_batch)
        steps = hp.local_steps or per_epoch * hp.local_epochs
        return steps, per_epoch

    def run_local(self, client_id, round_idx, param_sets, loss_fns) -> dict:
        """The engine's one loop (``ctx.train``) with AdamW on every parameter set and this round's warm-up +
        linear-decay schedule on every optimizer."""
        steps, _ = self.round_steps(client_id)
        schedule = warmup_linear(steps, self.config.warmup)
        several = len(param_sets) > 1
        t0 = time.perf_counter()
        m = self.ctx.train(client_id, round_idx, params=param_sets if several else param_sets[0],
                           loss_fn=loss_fns if several else loss_fns[0], optimizer=self.optimizer,
                           schedule=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule))
        m["ms_per_step"] = 1000 * (time.perf_counter() - t0) / max(1, m["steps"])
        return m

    def client_update(self, client_id, down, private, round_idx):
        self.load_client(down, private)
        self.load_client_pool(client_id)
        self.set_mode("shared")
        metrics = self.run_local(client_id, round_idx, [self.trainable_parameters()], [lambda m, b: m(**b).loss])
        return Update(client_id, upload={MODEL: self.ctx.snapshot(self.global_keys)},
                      num_samples=len(self.ctx.train_data(client_id)),
                      private={MODEL: self.ctx.snapshot(self.private_keys)}, metrics=metrics)

    def load_personal(self, client_id, server_state, private, round_idx):
        model = super().load_personal(client_id, server_state, private, round_idx)
        self.load_client_pool(client_id)
        self.set_mode("shared")                             # inference path: A_s (+ the client head)
        return model


@register
class VQAAdapter(VQAPeft):
    """Adapter: FedAvg of one bottleneck adapter per block (Eq. 2-3), head local."""

    name = "vqa_adapter"

    def peft_kind(self):
        return "adapter"


@register
class VQAAdapterLocal(VQAAdapter):
    """Adapter-L: the adapter trained on local data only; nothing travels."""

    name = "vqa_adapter_local"
    uses_server_hparams = frozenset()  # nothing travels, nothing is aggregated

    def key_role(self, key, default):
        return PRIVATE if default == GLOBAL else super().key_role(key, default)


@dataclass
class FedDATConfig(VQAPeftConfig):
    temperature: float = field(default=3.0, metadata={"help": "KD temperature T (the authors' code: 3; the paper gives none).",
                                                      "check": positive()})
    kd_schedule: str = field(default="ramp", metadata={
        "help": "alpha = beta: ramp (exp(-5(1-t/T0)), t over all rounds, the paper) | round (t restarts each round) | "
                "constant (the authors' code: (CE + KD) / 2).", "check": one_of(*KD_SCHEDULES)})
    mutual: bool = field(default=True, metadata={
        "help": "Mutual KD; false = the 'w/o MKD' ablation (only DAT -> A_s, no A_s -> DAT term)."})
    teacher: str = field(default="dat", metadata={
        "help": "Teacher path: dat (1/2 Â_s + 1/2 A_c) | local ('w/o Â_s': A_c only) | frozen ('w/o A_c': Â_s only).",
        "check": one_of("dat", "local", "frozen")})
    head_loss: str = field(default="shared", metadata={
        "help": "Which loss trains the client head: shared (L^s only: one head step per batch, as in Adapter; the "
                "head belongs to the deployed model with A_s) | both (L^s and L^DAT, the authors' code: two head "
                "steps per batch).", "check": one_of("shared", "both")})
    eval_variants: bool = field(default=True, metadata={
        "help": "At the last round also score the DAT and A_c inference paths (Table 4) besides A_s."})

    def __post_init__(self):
        super().__post_init__()
        if self.peft != "adapter":
            raise ValueError(f"--peft must be adapter for feddat (it is built on adapters), got {self.peft!r}")


@register
class FedDAT(VQAAdapter):
    """FedDAT: dual-adapter teacher + mutual KD; only the shared adapter A_s travels and is used at inference."""

    name = "feddat"
    Config = FedDATConfig

    def build_model(self):
        model = super().build_model()
        for slot in model.adapters:
            slot.local.requires_grad_(True)                 # A_c trains (private)
        return model

    def key_role(self, key, default):
        if ".local." in key and key.startswith("adapters."):
            return PRIVATE                                  # A_c persists on the client, never sent
        return super().key_role(key, default)

    def kd_weight(self, client_id, round_idx, step) -> float:
        steps, _ = self.round_steps(client_id)
        if self.config.kd_schedule == "constant":
            return 1.0
        if self.config.kd_schedule == "round":
            return kd_ramp(step, steps)
        return kd_ramp((round_idx - 1) * steps + step, self.ctx.run.num_rounds * steps)

    def client_update(self, client_id, down, private, round_idx):
        self.load_client(down, private)                    # A_s <- global, A_c + head <- this client's
        self.load_client_pool(client_id)
        model = self.model
        model.copy_shared_to_frozen()                      # Â_s <- the received A_s, every round
        head = [p for k, p in model.named_parameters() if k.startswith("backbone.classifier.")]
        shared = [p for k, p in model.named_parameters() if ".shared." in k]
        local = [p for k, p in model.named_parameters() if ".local." in k]
        cfg, state = self.config, {"step": 0, "kd_s": 0.0, "kd_dat": 0.0}
        half = 0.5 if cfg.kd_schedule == "constant" else 1.0
        # the head steps with A_s only (Alg. 1: L^DAT optimises DAT = Â_s + A_c; see the module doc), so L^DAT's
        # forward leaves it out of the graph; ``--head_loss both`` (the authors' code) steps it in both stages
        dat_head = head if cfg.head_loss == "both" else []
        still = [] if cfg.head_loss == "both" else head

        def loss_s(m, batch):                              # L^s = CE(z_s) + alpha KD(z_s <- z_DAT): trains A_s (+head)
            x, y = model_inputs(batch), batch["answer"]
            a = state["weight"] = self.kd_weight(client_id, round_idx, state["step"])    # beta = alpha this step
            state["step"] += 1
            with torch.no_grad():
                m.mode = cfg.teacher
                z_t = m(**x).logits
            m.mode = "shared"
            z_s = m(**x).logits
            state["z_s"] = z_s.detach()
            kd = kd_loss(z_s, z_t, cfg.temperature)
            state["kd_s"] += float(kd.detach())
            return half * (F.cross_entropy(z_s, y) + a * kd)

        def loss_dat(m, batch):                            # L^DAT = CE(z_DAT) + beta KD(z_DAT <- z_s): trains A_c
            x, y = model_inputs(batch), batch["answer"]
            b = state["weight"] if cfg.mutual else 0.0
            m.mode = cfg.teacher
            for p in still:
                p.requires_grad_(False)
            try:
                z_t = m(**x).logits
            finally:
                for p in still:
                    p.requires_grad_(True)
            m.mode = "shared"
            kd = kd_loss(z_t, state.pop("z_s"), cfg.temperature)
            state["kd_dat"] += float(kd.detach())
            return half * (F.cross_entropy(z_t, y) + b * kd)

        params, losses = [shared + head], [loss_s]
        if cfg.teacher != "frozen":     # "w/o A_c": the teacher is Â_s alone, frozen: L^DAT has nothing to train
            params, losses = params + [local + dat_head], losses + [loss_dat]
        metrics = self.run_local(client_id, round_idx, params, losses)
        n = max(1, metrics["steps"])
        metrics.update(kd_s=state["kd_s"] / n, kd_dat=state["kd_dat"] / n,
                       kd_weight=self.kd_weight(client_id, round_idx, state["step"] - 1))
        self.set_mode("shared")
        return Update(client_id, upload={MODEL: self.ctx.snapshot(self.global_keys)},
                      num_samples=len(self.ctx.train_data(client_id)),
                      private={MODEL: self.ctx.snapshot(self.private_keys)}, metrics=metrics)

    def inference_variants(self, server_state) -> dict:
        """Table 4's inference rows: per-client accuracy with A_s (default), DAT (Â_s = the final global A_s, + A_c)
        and A_c alone."""
        rows = []
        for cid, _ in self.ctx.personal_models(self.ctx.owned(range(self.ctx.num_clients)), server_state,
                                               self.ctx.round):
            self.model.copy_shared_to_frozen()
            accs = {}
            for mode in ("shared", "dat", "local"):
                self.model.mode = mode
                accs[mode] = self.ctx.evaluate(self.model, self.ctx.test_data(cid))["accuracy"]
            rows.append((cid, accs))
            self.set_mode("shared")
        rows = sorted(self.ctx.gather(rows))
        return {f"inference_{mode}": sum(r[1][mode] for r in rows) / max(1, len(rows)) for mode in ("shared", "dat",
                                                                                                 "local")}

    def extra_metrics(self, round_idx, server_state):
        if round_idx < self.ctx.run.num_rounds:
            return {}
        if self.ctx.is_main_process:
            self.save_shared_adapter(server_state)
        return self.inference_variants(server_state) if self.config.eval_variants else {}

    def save_shared_adapter(self, server_state) -> str | None:
        """``<output_dir>/shared_adapter``: the final global A_s, which loads without hfpfl in one call,
        ``AutoModelForVisualQuestionAnswering.from_pretrained(folder, trust_remote_code=True)``
        (:mod:`hfpfl.models.vqa_hub`). Skipped, with a log line, for a backbone built from a config (no checkpoint
        to name)."""
        import logging
        import os

        from ..models.vqa_hub import save_shared_adapter

        if not getattr(self.model.backbone, "name_or_path", ""):
            logging.getLogger(__name__).info("FedDAT: the backbone has no checkpoint to name; shared adapter not saved")
            return None
        return save_shared_adapter(self.model, os.path.join(self.ctx.output_dir, "shared_adapter"),
                                   shared_state=server_state[MODEL])


__all__ = ["FedDAT", "VQAAdapter", "VQAAdapterLocal", "VQAPeft", "steps_per_epoch", "MODES"]
