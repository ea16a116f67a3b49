"""Run configuration: the run's options as a plain dataclass (:class:`RunArguments`), the flat mapping a run writes to
``config.yaml``, and the checks that need the built data. Parsing them (command line, ``--config`` file) is
:mod:`hfpfl.arguments`: the engine imports this module, never the parser (which knows every method)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from .launch import DEFAULT_NUM_PROCESSES, ENV_NUM_PROCESSES
from .options import Check, at_least, in_range, non_negative, number_list, one_of, positive, validate


ADAPTERS = ("none", "lora", "residual", "parallel")
REPORT_TO = ("none", "tensorboard", "all", "wandb", "mlflow", "comet_ml")


def _says(check: Check, allowed: str) -> Check:
    """``check`` with its own words for what is allowed (the fix the error line says)."""
    return check._replace(allowed=allowed)


def _or_none(check: Check) -> Check:
    return _says(check, f"{check.allowed} (or None)")


def _eval_clients_ok(v) -> bool:
    return _finite(v) and v > 0 and (v < 1 or float(v).is_integer())


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


_SEED = Check(lambda v: _finite(v) and 0 <= v < 2**32, "in [0, 2**32)")
_EVAL_CLIENTS = Check(_eval_clients_ok, "a whole number >= 1 or a fraction in (0, 1) (or None = all)")
_NUM_PROCESSES = Check(lambda v: v == "auto" or (str(v).isdigit() and int(v) >= 1), "auto or a whole number >= 1")
_REPORT_TO = Check(lambda v: v in REPORT_TO, "none, tensorboard or all")


@dataclass
class RunArguments:
    method: str = field(default="fedavg", metadata={"help": "Method or baseline to run (see `hfpfl methods`)."})
    model: str = field(default="tiny-resnet", metadata={
        "help": "Model: a built-in tiny config (tiny-resnet, tiny-vit), a Hub repo id (microsoft/resnet-18) or a local path."})
    adapter: str = field(default="none", metadata={"check": one_of(*ADAPTERS),
        "help": "Parameter-efficient tuning of a frozen backbone: none | lora (peft LoRA on attention / convs) | "
                "residual (PerAda residual adapters, ResNet) | parallel (parallel 1x1 adapters, ResNet). Only adapters, "
                "their BatchNorms and the head train and travel."})
    lora_r: int = field(default=4, metadata={"check": at_least(1), "help": "LoRA rank when --adapter lora."})
    output_dir: str | None = field(default=None, metadata={
        "help": "Where config, checkpoints, results.json and plots go (default: outputs/<recipe>-<timestamp>)."})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "Allow reusing an output_dir that holds a finished run."})
    seed: int = field(default=0, metadata={"check": _SEED, "help": "Seed for model init, data partition, client sampling and local training."})
    num_rounds: int = field(default=10, metadata={"check": at_least(1), "help": "Communication rounds."})
    clients_per_round: int | None = field(default=None, metadata={"check": _or_none(at_least(1)), "help": "Clients sampled per round (overrides client_fraction)."})
    client_fraction: float = field(default=1.0, metadata={"check": in_range(0, 1, low_open=True), "help": "Fraction of clients sampled per round."})
    local_epochs: int = field(default=1, metadata={"check": at_least(1), "help": "Local epochs per round."})
    local_steps: int | None = field(default=None, metadata={"check": _or_none(at_least(1)), "help": "Exact local steps per round (overrides local_epochs)."})
    batch_size: int = field(default=32, metadata={"check": at_least(1), "help": "Local training batch size."})
    last_batch: str = field(default="merge", metadata={"check": one_of("merge", "keep", "drop"),
        "help": "A client's trailing partial batch in local training: merge (one of fewer than min(8, batch_size) "
                "images joins the previous batch: BatchNorm cannot learn from a handful of images, and a 2-image "
                "step once held a Central oracle at chance) | keep (a step of its own, as PyTorch's DataLoader and "
                "pfl-research) | drop (left out, as drop_last=True, unless it is the client's only batch)."})
    lr: float = field(default=0.05, metadata={"check": positive(), "help": "Local learning rate."})
    lr_milestones: str | None = field(default=None, metadata={
        "check": _or_none(number_list(low=1, integer=True)),
        "help": "Rounds (comma-separated, 1-based) from which the clients' --lr is multiplied by --lr_gamma once more: "
                "a step schedule; the parallel-adapters paper: 30 (0.1 -> 0.01 at round 30). None = constant --lr."})
    lr_gamma: float = field(default=0.1, metadata={"check": in_range(0, 1, low_open=True),
                                                   "help": "Factor of each --lr_milestones step (paper: 0.1)."})
    optimizer: str = field(default="sgd", metadata={"check": one_of("sgd", "adam", "adamw"), "help": "Local optimizer: sgd | adam | adamw."})
    momentum: float = field(default=0.9, metadata={"check": in_range(0, 1, high_open=True), "help": "SGD momentum (fresh optimizer every round)."})
    weight_decay: float = field(default=0.0, metadata={"check": non_negative(), "help": "Weight decay."})
    dropout: float | None = field(default=None, metadata={"check": _or_none(in_range(0, 1, high_open=True)),
        "help": "Dropout rate for every nn.Dropout during local training (default: the model's own)."})
    server_lr: float = field(default=1.0, metadata={"check": positive(),
        "help": "Server optimizer (FedOpt) learning rate on the pseudo-gradient x - mean(uploads); 1 with "
                "server_momentum 0 is FedAvg."})
    server_momentum: float = field(default=0.0, metadata={"check": in_range(0, 1, high_open=True), "help": "Server optimizer momentum (FedAvgM)."})
    server_lr_decay: float = field(default=1.0, metadata={"check": in_range(0, 1, low_open=True), "help": "Server lr multiplied by this every round."})
    eval_every: int = field(default=1, metadata={"check": at_least(1), "help": "Evaluate every N rounds (and always after the last)."})
    eval_clients: float | None = field(default=None, metadata={"check": _EVAL_CLIENTS,
        "help": "Clients evaluated at the evaluations before the last: N (>= 1) clients or a fraction in (0, 1), "
                "drawn per round from the seed; default all. The final evaluation always scores every client."})
    eval_batch_size: int = field(default=256, metadata={"check": at_least(1), "help": "Evaluation batch size."})
    vectorize: str = field(default="auto", metadata={
        "help": "Train the sampled clients of a round together in batched (torch.func.vmap) calls: auto (when the "
                "method's local update can be vectorized and the model is small enough to be overhead-bound) | on "
                "(whenever the method can be vectorized) | off. Same numbers either way (float tolerance).",
        "choices": ["auto", "on", "off"]})
    vector_chunk_mb: float | None = field(default=None, metadata={"check": _says(positive(), "> 0 (or left unset: 64 on the CPU, 256 on an accelerator)"),
        "help": "Most MiB of stacked client state (parameters, gradients, optimizer state) per vectorized chunk: "
                "fewer clients per batched call, lower peak memory (the chunk is most of a vectorized round's peak). "
                "Default: 64 on the CPU, 256 on an accelerator (more clients per call keep a GPU busy). Same "
                "numbers at any size (float tolerance)."})
    channels_last: str = field(default="auto", metadata={
        "help": "On the CPU: train and evaluate with every Conv2d weight in channels_last memory format (oneDNN's "
                "faster convolutions: PFLlib's CNN trains a quarter faster here on one thread, the tiny ResNet 15 "
                "percent). auto = on for models whose convolutions all have stride 1 (strided ones, as the tiny "
                "ResNet the published tables were run with, keep the contiguous format and reproduce them bit for "
                "bit) | on | off. Results differ from off in their last float bits.",
        "choices": ["auto", "on", "off"]})
    max_state_mb: float = field(default=2048.0, metadata={"check": _says(non_negative(), ">= 0 (0 = no cap)"),
        "help": "Most MiB of client private state (adapters, heads, optimizer state) kept in memory; the least "
                "recently used clients' states beyond it are written to <output_dir>/client_states/*.safetensors "
                "and read back when needed (0 = no cap, everything in memory)."})
    data_cache_mb: float = field(default=1024.0, metadata={"check": _says(non_negative(), ">= 0 (0 = no cap)"),
        "help": "Most MiB of client tensors kept in memory (images as uint8), one copy per split (clients that share "
                "a Dataset share it); the least recently used splits are converted again when needed (0 = no cap)."})
    new_client_epochs: int = field(default=3, metadata={"check": at_least(0), "help": "Fine-tuning epochs for held-out new clients."})
    checkpoint_every: int = field(default=1, metadata={"check": _says(at_least(0), ">= 0 (0 = never)"), "help": "Checkpoint every N rounds (0 = never)."})
    keep_checkpoints: int = field(default=2, metadata={"check": at_least(1), "help": "How many round checkpoints to keep."})
    resume_from_checkpoint: str | None = field(default=None, metadata={
        "help": "Resume: 'latest' or a path to a round checkpoint directory."})
    num_threads: int = field(default=1, metadata={"check": at_least(1), "help": "torch intra-op threads per process (1 is fastest on small boxes)."})
    deterministic: bool = field(default=True, metadata={
        "help": "On a CUDA device: deterministic cuDNN/cuBLAS kernels and no TF32, so that the same seed gives the same "
                "numbers (and the vectorized and sequential paths agree to float32 precision). False = cuDNN autotuning "
                "and TF32 (faster; results then vary in their last bits). No effect on the CPU."})
    num_processes: str = field(default=DEFAULT_NUM_PROCESSES, metadata={"check": _NUM_PROCESSES,
        "help": "Processes to shard the clients over when the recipe is started with plain python: N, or auto (where "
                "it pays: one per GPU, or on the CPU one per idle core, at most one per client per round, and one "
                "process for runs under 20 client updates, rounds x clients per round; the choice is printed in one "
                "line). On the CPU the recipe forks itself, with GPUs it launches itself through accelerate; the "
                "same numbers as one process (the upload sums are exact in practice). Default: the environment variable "
                f"{ENV_NUM_PROCESSES} if set, else {DEFAULT_NUM_PROCESSES}. Under accelerate launch the launcher's "
                "--num_processes wins."})
    report_to: str = field(default="none", metadata={"check": _REPORT_TO, "help": "Accelerate trackers: none | tensorboard | all."})
    progress: bool = field(default=True, metadata={"help": "Show tqdm progress bars (only when stderr is a terminal; "
                                                           "the plain per-round lines are always printed)."})
    random_backbone_ok: bool = field(default=False, metadata={
        "help": "Silence the warning for --adapter on a randomly initialised (not pretrained) frozen backbone."})

    def __post_init__(self):
        validate(self)   # the checks each field declares (hfpfl.options); no option here depends on another


# Keys a saved config.yaml may hold that are where/how a run was stored, not what it computes.
LOCATION_KEYS = ("output_dir", "overwrite_output_dir", "resume_from_checkpoint")


def config_for_file(*configs) -> dict:
    """The flat ``{option: value}`` mapping a run writes to ``config.yaml``: a valid ``--config`` input that
    reproduces the run (location options -- output_dir, overwrite, resume -- are left out: pass --output_dir)."""
    flat: dict = {}
    for c in configs:
        if c is None:
            continue
        values = dataclasses.asdict(c) if dataclasses.is_dataclass(c) else dict(c)
        for k, v in values.items():
            if k in LOCATION_KEYS:
                continue
            if k in flat and flat[k] != v:
                raise ValueError(f"option {k!r} appears twice with different values ({flat[k]!r}, {v!r})")
            flat[k] = v
    return flat


def warn_random_backbone(run) -> bool:
    """Adapters on a frozen, randomly initialised backbone train on noise features: say so loudly (once per run),
    unless --random_backbone_ok. Returns True when it warned."""
    import logging

    if run.adapter == "none" or getattr(run, "random_backbone_ok", False):
        return False
    from .models.names import TINY_CLASSIFIER_NAMES as TINY_CLASSIFIERS, TINY_VQA_MODELS
    if run.model not in TINY_CLASSIFIERS and run.model not in TINY_VQA_MODELS:
        return False
    logging.getLogger("hfpfl").warning(
        "WARNING: --adapter %s freezes --model %s, a RANDOMLY INITIALISED backbone: the adapters learn on noise "
        "features and adapter comparisons are meaningless. Use a pretrained backbone (e.g. --model "
        "hfpfl/tiny-resnet-ood, the out-of-domain stand-in published on first use) or pass --random_backbone_ok true if you mean it.",
        run.adapter, run.model)
    return True
