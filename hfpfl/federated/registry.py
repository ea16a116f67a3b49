"""The method registry: ``@register`` puts a method class under its name, :func:`get_algorithm` finds it (importing a
lazily loaded built-in method on first use)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .protocol import Algorithm


REGISTRY: dict[str, type[Algorithm]] = {}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    REGISTRY[cls.name] = cls
    return cls


def get_algorithm(name: str) -> type[Algorithm]:
    if name not in REGISTRY:
        import importlib
        # plug-in discovery: the built-in methods register on import (those that build transformers models on first use)
        importlib.import_module("hfpfl.algorithms").load_builtin_methods(name)
    try:
        return REGISTRY[name]
    except KeyError:
        import difflib
        close = difflib.get_close_matches(name, REGISTRY, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown method {name!r}.{hint} Available methods: {', '.join(sorted(REGISTRY))}") from None
