"""Parsing a run's options: the command line (transformers' ``HfArgumentParser``) plus ``--config file.yaml``, for
:class:`~hfpfl.config.RunArguments`, the data options, the chosen method's config and a recipe's own options.

Precedence: dataclass defaults < YAML file < command-line flags. Unknown keys in the YAML file are an error
(with the closest valid name), as are unknown flags. Above the methods in the layering (it looks the method up by
name), below the entry points that call it."""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
import typing
from pathlib import Path

import yaml

from .config import RunArguments
from .launch import env_num_processes


#: text options whose values include the words on / off (``vectorize: off`` in a YAML file arrives as False)
ON_OFF_OPTIONS = frozenset(f.name for f in dataclasses.fields(RunArguments) if "on" in f.metadata.get("choices", ()))


def check_options(obj, checks) -> None:
    """Raise one ValueError that names the first failing option as its flag, the value given and what is allowed."""
    for name, ok, allowed in checks:
        if not ok:
            raise ValueError(f"--{name} must be {allowed}, got {getattr(obj, name)!r}")


def _fields(dc) -> set[str]:
    return {f.name for f in dataclasses.fields(dc)}


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
