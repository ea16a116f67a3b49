"""Run configuration: dataclasses parsed with transformers' HfArgumentParser, plus `--config file.yaml`.

Precedence: dataclass defaults < YAML file < command-line flags. Unknown keys in the YAML file are an error
(with the closest valid name), as are unknown flags.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml


ADAPTERS = ("none", "lora", "residual", "parallel")


@dataclass
class RunArguments:
    method: str = field(default="fedavg", metadata={"help": "Method or baseline to run (see `hfpfl methods`)."})
    model: str = field(default="tiny-resnet", metadata={
        "help": "Model: a built-in tiny config (tiny-resnet, tiny-vit), a Hub repo id (microsoft/resnet-18) or a local path."})
    adapter: str = field(default="none", metadata={
        "help": "Parameter-efficient tuning of a frozen backbone: none | lora (peft LoRA on attention / convs) | "
                "residual (PerAda residual adapters, ResNet) | parallel (parallel 1x1 adapters, ResNet). Only adapters, "
                "their BatchNorms and the head train and travel."})
    lora_r: int = field(default=4, metadata={"help": "LoRA rank when --adapter lora."})
    output_dir: str = field(default="outputs/run", metadata={"help": "Where config, checkpoints, results.json and plots go."})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "Allow reusing an output_dir that holds a finished run."})
    seed: int = field(default=0, metadata={"help": "Seed for model init, data partition, client sampling and local training."})
    num_rounds: int = field(default=10, metadata={"help": "Communication rounds."})
    clients_per_round: int | None = field(default=None, metadata={"help": "Clients sampled per round (overrides client_fraction)."})
    client_fraction: float = field(default=1.0, metadata={"help": "Fraction of clients sampled per round."})
    local_epochs: int = field(default=1, metadata={"help": "Local epochs per round."})
    local_steps: int | None = field(default=None, metadata={"help": "Exact local steps per round (overrides local_epochs)."})
    batch_size: int = field(default=32, metadata={"help": "Local training batch size."})
    lr: float = field(default=0.05, metadata={"help": "Local learning rate."})
    optimizer: str = field(default="sgd", metadata={"help": "Local optimizer: sgd | adam | adamw."})
    momentum: float = field(default=0.9, metadata={"help": "SGD momentum (fresh optimizer every round)."})
    weight_decay: float = field(default=0.0, metadata={"help": "Weight decay."})
    dropout: float | None = field(default=None, metadata={
        "help": "Dropout rate for every nn.Dropout during local training (default: the model's own)."})
    server_lr: float = field(default=1.0, metadata={
        "help": "Server optimizer (FedOpt) learning rate on the pseudo-gradient x - mean(uploads); 1 with "
                "server_momentum 0 is FedAvg."})
    server_momentum: float = field(default=0.0, metadata={"help": "Server optimizer momentum (FedAvgM)."})
    server_lr_decay: float = field(default=1.0, metadata={"help": "Server lr multiplied by this every round."})
    eval_every: int = field(default=1, metadata={"help": "Evaluate every N rounds (and always after the last)."})
    eval_batch_size: int = field(default=256, metadata={"help": "Evaluation batch size."})
    new_client_epochs: int = field(default=3, metadata={"help": "Fine-tuning epochs for held-out new clients."})
    checkpoint_every: int = field(default=1, metadata={"help": "Checkpoint every N rounds (0 = never)."})
    keep_checkpoints: int = field(default=2, metadata={"help": "How many round checkpoints to keep."})
    resume_from_checkpoint: str | None = field(default=None, metadata={
        "help": "Resume: 'latest' or a path to a round checkpoint directory."})
    num_threads: int = field(default=1, metadata={"help": "torch intra-op threads per process (1 is fastest on small boxes)."})
    report_to: str = field(default="none", metadata={"help": "Accelerate trackers: none | tensorboard | all."})
    progress: bool = field(default=True, metadata={"help": "Show tqdm progress bars."})

    def __post_init__(self):
        checks = [
            (self.num_rounds >= 1, "num_rounds must be >= 1"),
            (0 < self.client_fraction <= 1, "client_fraction must be in (0, 1]"),
            (self.clients_per_round is None or self.clients_per_round >= 1, "clients_per_round must be >= 1"),
            (self.local_epochs >= 1, "local_epochs must be >= 1"),
            (self.local_steps is None or self.local_steps >= 1, "local_steps must be >= 1"),
            (self.batch_size >= 1, "batch_size must be >= 1"),
            (self.lr > 0, "lr must be > 0"),
            (self.eval_every >= 1, "eval_every must be >= 1"),
            (self.adapter in ADAPTERS, f"adapter must be one of {', '.join(ADAPTERS)}, got {self.adapter!r}"),
            (self.lora_r >= 1, "lora_r must be >= 1"),
            (self.optimizer in ("sgd", "adam", "adamw"), f"optimizer must be sgd, adam or adamw, got {self.optimizer!r}"),
            (self.dropout is None or 0 <= self.dropout < 1, "dropout must be in [0, 1)"),
            (self.server_lr > 0, "server_lr must be > 0"),
            (0 <= self.server_momentum < 1, "server_momentum must be in [0, 1)"),
            (0 < self.server_lr_decay <= 1, "server_lr_decay must be in (0, 1]"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)


def _fields(dc) -> set[str]:
    return {f.name for f in dataclasses.fields(dc)}


def load_config_file(path: str | Path, dataclass_types) -> dict:
    """Read a YAML/JSON config and reject keys no dataclass knows (with a suggestion)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(path)!r} must be a mapping of option: value")
    known = set().union(*(_fields(dc) for dc in dataclass_types))
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown config key {key!r} in {str(path)!r}.{hint} "
                             f"Run with --help to list every option.")
    return data


def parse_run_args(argv: list[str] | None = None, method: str | None = None, prog: str | None = None,
                   description: str | None = None, defaults: dict | None = None):
    """Parse RunArguments, DataArguments and the chosen method's config. Returns (run, data, method_config).

    ``defaults``: a recipe's own defaults (e.g. ``{"adapter": "residual"}``); precedence: dataclass defaults <
    recipe defaults < YAML file < command-line flags."""
    from transformers import HfArgumentParser

    from .algorithms import get_algorithm
    from .data import DataArguments

    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    pre.add_argument("--method")
    known, _ = pre.parse_known_args(argv)
    file_values: dict = {}
    method_name = known.method or method
    if known.config:
        raw = yaml.safe_load(Path(known.config).read_text()) if Path(known.config).is_file() else {}
        method_name = known.method or (raw or {}).get("method") or method
    method_name = method_name or "fedavg"
    algo_cls = get_algorithm(method_name)
    types = [RunArguments, DataArguments, algo_cls.Config]
    if known.config:
        file_values = load_config_file(known.config, types)
    parser = HfArgumentParser(types, prog=prog, description=description)
    parser.add_argument("--config", default=None, help="YAML/JSON file of options; command-line flags override it.")
    parser.set_defaults(**{**(defaults or {}), **file_values, "method": method_name})
    run, data, method_cfg, _extra, remaining = parser.parse_args_into_dataclasses(
        args=argv, return_remaining_strings=True)
    if remaining:
        flags = [a for a in remaining if a.startswith("--")] or remaining
        known_flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
        close = difflib.get_close_matches(flags[0].split("=")[0], known_flags, n=1)
        hint = f" Did you mean {close[0]}?" if close else ""
        raise ValueError(f"unknown option {flags[0]!r} for method {method_name!r}.{hint} "
                         f"Run with --help (and --method {method_name}) to list every option.")
    return run, data, method_cfg
