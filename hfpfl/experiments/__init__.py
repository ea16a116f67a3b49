"""Studies: every claim of a paper table as code (variants, seeds, controls, claims), one runner, generated tables.

    python -m hfpfl.experiments list
    python -m hfpfl.experiments run baselines_digits --seeds 0 1 2
    python -m hfpfl.experiments verify baselines_digits fedbn --seed 0
    python -m hfpfl.experiments docs

A study spec is a module of :mod:`hfpfl.experiments.studies` defining ``STUDY`` (a :class:`Study`), one per paper
table. What a table needs, and where it goes:

* a method on built-in data: a :class:`Variant` of ``hfpfl run`` flags (``studies/baselines_digits.py``);
* a benchmark a recipe builds (PFLBED, the degradation benchmark, easy-vqa): ``Variant(..., recipe="recipes/x.py")``;
* a metric the engine does not report (label-re-weighted or corrupted-test accuracy): ``metrics_hook="pkg.mod:fn"``,
  ``fn(sim, results)`` adding to ``results["final"]``;
* a task-specific control (question-only or shuffled-image VQA, a classifier on pooled real data):
  ``controls.register("kind", fn)`` and variants of that kind;
* a method that is not one ``Simulation.run`` (a tuner driving several simulations): ``controls.register("kind", fn,
  control=False)``; its rows report a budget like any trained row.

Rows are matched by training budget (``matched_by``); a claim across unequal budgets needs
``budgets_differ_because``."""
from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from pathlib import Path

from . import controls
from .spec import Claim, Study, Variant, greater, margin, within

__all__ = ["Claim", "Study", "Variant", "controls", "greater", "margin", "within", "load_study", "study_names"]


def study_names() -> list[str]:
    from . import studies
    return sorted(m.name for m in pkgutil.iter_modules(studies.__path__) if not m.name.startswith("_"))


def load_study(name: str) -> Study:
    """A study by name (a module of hfpfl.experiments.studies) or by the path of a ``.py`` file defining STUDY."""
    if name.endswith(".py"):
        path = Path(name)
        if not path.is_file():
            raise FileNotFoundError(f"study file {name!r} not found")
        spec = importlib.util.spec_from_file_location(f"hfpfl_study_{path.stem}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    else:
        if name not in study_names():
            raise KeyError(f"unknown study {name!r}; studies: {', '.join(study_names())}")
        mod = importlib.import_module(f"{__name__}.studies.{name}")
    study = getattr(mod, "STUDY", None)
    if not isinstance(study, Study):
        raise ValueError(f"study {name!r} defines no STUDY = Study(...)")
    return study
