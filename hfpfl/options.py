"""Declared option checks: an option's dataclass field says which values it allows, and the one parser checks them.

An option is declared with :func:`option` (or ``dataclasses.field(metadata={"help": ..., "check": Check(...)})``)::

    @dataclass
    class FedPCEConfig:
        lr_embedding: float = option(0.1, "Learning rate of the client embedding.", check=positive())

Every dataclass a recipe parses (run, data, method and recipe options) goes through :func:`validate` after parsing
(``hfpfl.arguments.parse_run_args``), and the engine validates a method config built in Python, so an option that declares
a check cannot skip it. A bad value is one ``ValueError`` line naming the flag, the value and what is allowed; the
command-line layer turns it into ``error: ...`` and exit code 2 before anything is written.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

CHECK = "check"   # the metadata key; stripped before transformers' HfArgumentParser sees the metadata


class Check(NamedTuple):
    """``ok(value) -> bool`` and the words for what is allowed (they follow "must be")."""
    ok: Callable[[Any], bool]
    allowed: str


def _finite_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def positive() -> Check:
    return Check(lambda v: _finite_number(v) and v > 0, "> 0 and finite")


def non_negative() -> Check:
    return Check(lambda v: _finite_number(v) and v >= 0, ">= 0 and finite")


def at_least(low) -> Check:
    return Check(lambda v: _finite_number(v) and v >= low, f">= {low}")


def in_range(low, high, *, low_open: bool = False, high_open: bool = False) -> Check:
    """``low <= v <= high``; ``low_open`` / ``high_open`` exclude the end."""
    def ok(v):
        if not _finite_number(v):
            return False
        return (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
    return Check(ok, f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}")


def one_of(*choices) -> Check:
    return Check(lambda v: v in choices, "one of " + ", ".join(str(c) for c in choices))


def number_list(count: int | None = None, *, low=None, high=None, low_open: bool = False, high_open: bool = False,
                integer: bool = False, min_count: int = 1) -> Check:
    """A comma-separated list of numbers (``"16,32,64"``): ``count`` of them (or at least ``min_count``), each
    within the given bounds."""
    def ok(v):
        try:
            items = [(int if integer else float)(t) for t in str(v).split(",") if t.strip()]
        except ValueError:
            return False
        if (count is not None and len(items) != count) or len(items) < min_count:
            return False
        return all(math.isfinite(x) and (low is None or (x > low if low_open else x >= low))
                   and (high is None or (x < high if high_open else x <= high)) for x in items)
    n = f"{count}" if count is not None else (f"{min_count} or more" if min_count > 1 else "one or more")
    kind = "whole numbers" if integer else "numbers"
    bounds = []
    if low is not None:
        bounds.append(f"{'>' if low_open else '>='} {low}")
    if high is not None:
        bounds.append(f"{'<' if high_open else '<='} {high}")
    return Check(ok, f"{n} comma-separated {kind}" + (f", each {' and '.join(bounds)}" if bounds else ""))


def option(default=dataclasses.MISSING, help: str = "", check: Check | None = None, **metadata):
    """A dataclass field for an option: its help text, its check, and any further HfArgumentParser metadata
    (``choices``, ``aliases``). A list default goes through ``default_factory``."""
    md = {"help": help, **metadata}
    if check is not None:
        md[CHECK] = check
    if isinstance(default, (list, dict, set)):
        value = default
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata=md)
    return dataclasses.field(default=default, metadata=md)


def declared_check(f: dataclasses.Field) -> Check | None:
    check = f.metadata.get(CHECK)
    if check is None and "choices" in f.metadata:
        check = one_of(*f.metadata["choices"])
    return check


def validate(obj) -> None:
    """Check every field of the dataclass ``obj`` that declares a check; ``None`` passes where the field allows it
    (an optional option left unset). Raises one ValueError naming the first bad option as its flag."""
    if obj is None or not dataclasses.is_dataclass(obj):
        return
    for f in dataclasses.fields(obj):
        check = declared_check(f)
        if check is None:
            continue
        value = getattr(obj, f.name)
        if value is None:
            continue
        if not check.ok(value):
            raise ValueError(f"--{f.name} must be {check.allowed}, got {value!r}")


def parser_metadata(metadata) -> dict:
    """The metadata HfArgumentParser passes to ``add_argument``: without the keys argparse does not know."""
    return {k: v for k, v in metadata.items() if k != CHECK}
