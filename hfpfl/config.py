"""Run configuration: dataclasses parsed with transformers' HfArgumentParser, plus `--config file.yaml`.

Precedence: dataclass defaults < YAML file < command-line flags. Unknown keys in the YAML file are an error
(with the closest valid name), as are unknown flags.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .launch import DEFAULT_NUM_PROCESSES, ENV_NUM_PROCESSES, env_num_processes
from .options import Check, at_least, in_range, non_negative, one_of, positive, validate


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
    lr: float = field(default=0.05, metadata={"check": positive(), "help": "Local learning rate."})
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


#: text options whose values include the words on / off (``vectorize: off`` in a YAML file arrives as False)
ON_OFF_OPTIONS = frozenset(f.name for f in dataclasses.fields(RunArguments) if "on" in f.metadata.get("choices", ()))


def check_options(obj, checks) -> None:
    """Raise one ValueError that names the first failing option as its flag, the value given and what is allowed."""
    for name, ok, allowed in checks:
        if not ok:
            raise ValueError(f"--{name} must be {allowed}, got {getattr(obj, name)!r}")


def _fields(dc) -> set[str]:
    return {f.name for f in dataclasses.fields(dc)}


# Keys a saved config.yaml may hold that are where/how a run was stored, not what it computes.
LOCATION_KEYS = ("output_dir", "overwrite_output_dir", "resume_from_checkpoint")
SECTION_NAMES = ("run", "data", "method", "recipe")


def read_config_file(path: str | Path) -> dict:
    """A YAML/JSON config file as one flat ``{option: value}`` mapping. Also accepts the sectioned layout
    (``run:``/``data:``/``method:`` mappings) older hfpfl versions wrote to ``config.yaml``. Every problem is a
    one-line ValueError/FileNotFoundError naming the file."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"--config {str(path)!r} is a directory; pass a YAML/JSON file of option: value lines")
    if not path.is_file():
        raise FileNotFoundError(f"--config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" (line {where.line + 1}, column {where.column + 1})" if where is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ValueError(f"--config {str(path)!r} is not valid YAML{at}: {problem}; write one 'option: value' per "
                         f"line") from None
    except UnicodeDecodeError:
        raise ValueError(f"--config {str(path)!r} is not a text file; pass a YAML/JSON file") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {str(path)!r} must be a mapping of option: value (one per line), got a "
                         f"{type(data).__name__}")
    if data and set(data) <= set(SECTION_NAMES) and all(isinstance(v, dict) for v in data.values()):
        flat: dict = {}
        for values in data.values():
            flat.update({k: v for k, v in values.items() if k not in flat or k != "method"})
        data = flat
    for k, v in data.items():
        if not isinstance(k, str):
            raise ValueError(f"--config {str(path)!r}: option names must be text, got {k!r}")
    return data


def _field_types(dc) -> dict[str, tuple[set, bool]]:
    """name -> (allowed base types, None allowed)."""
    hints = typing.get_type_hints(dc)
    out = {}
    for f in dataclasses.fields(dc):
        tp = hints.get(f.name, f.type)
        args = typing.get_args(tp) or (tp,)
        out[f.name] = ({a for a in args if a is not type(None)}, type(None) in args)
    return out


def _check_value(path, key: str, value, allowed: set, nullable: bool):
    """Type-check (and lightly coerce) one config file value; a wrong type is a one-line error naming the key."""
    if value is None:
        if nullable:
            return None
        raise ValueError(f"config key {key!r} in {str(path)!r} cannot be null; remove the line to use the default")
    if isinstance(value, str) and value.strip().lower() in ("none", "null") and nullable:
        return None
    if bool in allowed:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ValueError(f"config key {key!r} in {str(path)!r} must be true or false, got {value!r}")
    numeric = [(int, (int,), "an integer")] if int in allowed and float not in allowed else \
        [(float, (int, float), "a number")] if float in allowed else []
    for cast, ok_types, what in numeric:
        if isinstance(value, ok_types) and not isinstance(value, bool):
            return cast(value)
        if isinstance(value, str):
            try:
                return cast(value)
            except ValueError:
                pass
        raise ValueError(f"config key {key!r} in {str(path)!r} must be {what}, got {value!r}")
    if str in allowed:
        if isinstance(value, bool) and key in ON_OFF_OPTIONS:  # YAML 1.1 reads the words on/off as booleans
            return "on" if value else "off"
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ValueError(f"config key {key!r} in {str(path)!r} must be text, got {value!r}")
    return value


def load_config_file(path: str | Path, dataclass_types) -> dict:
    """Read a YAML/JSON config, reject keys no dataclass knows (with a suggestion) and values of the wrong type."""
    data = read_config_file(path)
    types: dict = {}
    for dc in dataclass_types:
        types.update(_field_types(dc))
    out = {}
    for key, value in data.items():
        if key not in types:
            close = difflib.get_close_matches(key, list(types), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown config key {key!r} in {str(path)!r}.{hint} "
                             f"Run with --help to list every option.")
        out[key] = _check_value(path, key, value, *types[key])
    return out


class _UserError(ValueError):
    pass


def _option_parser_class():
    import copy
    import types

    from transformers import HfArgumentParser

    from .options import parser_metadata

    class OptionParser(HfArgumentParser):
        """HfArgumentParser that leaves hfpfl's declared checks (``hfpfl.options``) out of argparse's arguments."""

        @staticmethod
        def _parse_dataclass_field(parser, field):
            field = copy.copy(field)
            field.metadata = types.MappingProxyType(parser_metadata(field.metadata))
            return HfArgumentParser._parse_dataclass_field(parser, field)

    return OptionParser


def _OptionParser(*args, **kwargs):
    return _option_parser_class()(*args, **kwargs)


def make_parser(dataclass_types, prog: str | None = None, description: str | None = None):
    """An ``HfArgumentParser`` whose errors are one-line ValueErrors (not argparse's usage + exit) and whose optional
    options accept ``None`` on the command line (``--max_per_domain None``, as their help says)."""
    parser = _OptionParser(dataclass_types, prog=prog, description=description)

    def error(message):
        raise _UserError(f"{message}; run with --help to list every option")

    parser.error = error
    nullable = set()
    for dc in dataclass_types:
        nullable |= {name for name, (_, ok) in _field_types(dc).items() if ok}
    for action in parser._actions:
        if action.dest in nullable and callable(action.type):
            action.type = _none_or(action.type)
    return parser


def _none_or(convert):
    def parse(text):
        if isinstance(text, str) and text.strip().lower() in ("none", "null"):
            return None
        return convert(text)
    parse.__name__ = getattr(convert, "__name__", "value")  # argparse names the type in its error message
    return parse


def check_model_name(model: str, extra_models=()) -> None:
    """A near-miss of a built-in model name (and no such local folder) gets a 'did you mean'. ``extra_models``: names
    a recipe builds itself (FedPop's tiny-mlp)."""
    import os

    if "/" in model or os.path.exists(model):
        return
    from .models.names import TINY_CLASSIFIER_NAMES as TINY_CLASSIFIERS, TINY_VQA_MODELS
    builtins = sorted(set(TINY_CLASSIFIERS) | set(TINY_VQA_MODELS) | set(extra_models))
    if model in builtins:
        return
    close = difflib.get_close_matches(model, builtins, n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"--model {model!r} is not a built-in model ({', '.join(builtins)}), a local folder or a Hub id "
                     f"(owner/name).{hint}")


def parse_run_args(argv: list[str] | None = None, method: str | None = None, prog: str | None = None,
                   description: str | None = None, defaults=None, recipe_options=None,
                   extra_models=()):
    """Parse RunArguments, DataArguments and the chosen method's config. Returns (run, data, method_config), or
    (run, data, method_config, recipe) when ``recipe_options`` (a recipe's own options dataclass: FedPCE's benchmark
    settings, FedPop's tuner) is given: the same parser, the same ``--config`` file, the same checks.

    ``defaults``: a recipe's own defaults (e.g. ``{"adapter": "residual"}``), or a function of the chosen method's
    class that returns them (FedPop gives a method that reads no client momentum a momentum of 0); precedence: dataclass defaults <
    recipe defaults (and those the recipe options derive, ``recipe.run_defaults()``: FedDAT's --backbone picks the
    --model) < ``HFPFL_NUM_PROCESSES`` (num_processes only) < YAML file < command-line flags. Every user error is
    a one-line ValueError naming the option. ``extra_models``: model names the recipe builds itself."""
    from .algorithms import get_algorithm
    from .data import DataArguments
    from .options import validate

    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    pre.add_argument("--method")
    known, _ = pre.parse_known_args(argv)
    file_values: dict = {}
    method_name = known.method or method
    raw = read_config_file(known.config) if known.config else {}
    if known.config:
        file_method = raw.get("method")
        if file_method is not None and not isinstance(file_method, str):
            raise ValueError(f"config key 'method' in {known.config!r} must be a method name, got {file_method!r}")
        method_name = known.method or file_method or method
    method_name = method_name or "fedavg"
    algo_cls = get_algorithm(method_name)
    if callable(defaults):
        defaults = defaults(algo_cls)
    types = [RunArguments, DataArguments, algo_cls.Config]
    if recipe_options is not None:
        clash = sorted(_fields(recipe_options) & (_fields(RunArguments) | _fields(DataArguments)
                                                  | _fields(algo_cls.Config)))
        if clash:
            raise ValueError(f"--method {method_name} has an option --{clash[0]} that this recipe uses for its own "
                             f"setting; choose another --method")
        types.append(recipe_options)
    if known.config:
        file_values = load_config_file(known.config, types)
    parser = make_parser(types, prog=prog, description=description)
    parser.add_argument("--config", default=None, help="YAML/JSON file of options; command-line flags override it. "
                                                       "A run's saved config.yaml is one.")

    def parse(derived: dict):
        # precedence: dataclass < recipe defaults < derived < HFPFL_NUM_PROCESSES < --config file < command line
        parser.set_defaults(**{**(defaults or {}), **derived, **env_num_processes(), **file_values,
                               "method": method_name})
        try:
            *objs, remaining = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
        except _UserError:
            raise
        except TypeError as e:  # a dataclass rejected a value of the wrong type
            raise ValueError(f"invalid option value: {e}") from None
        if remaining:
            flags = [a for a in remaining if a.startswith("--")] or remaining
            known_flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
            close = difflib.get_close_matches(flags[0].split("=")[0], known_flags, n=1)
            hint = f" Did you mean {close[0]}?" if close else ""
            raise ValueError(f"unknown option {flags[0]!r} for method {method_name!r}.{hint} "
                             f"Run with --help (and --method {method_name}) to list every option.")
        objs = objs[:len(types)]  # without the namespace of the extra --config argument
        for obj in objs:
            validate(obj)   # every declared check (hfpfl.options), before anything is written
        return objs

    objs = parse({})
    derive = getattr(objs[-1], "run_defaults", None) if recipe_options is not None else None
    derived = derive() if derive else {}
    if derived:
        objs = parse(derived)
    check_model_name(objs[0].model, extra_models)
    return tuple(objs)


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


def check_run_against_data(run, fed) -> None:
    """Checks that need the built federated dataset (the number of clients)."""
    n = len(fed.clients)
    if run.clients_per_round is not None and run.clients_per_round > n:
        raise ValueError(f"--clients_per_round {run.clients_per_round} is more than the {n} training clients; pass "
                         f"--clients_per_round {n} or less (or raise --num_clients)")


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
