"""Controls as variants: what a table's numbers must be read against.

* :func:`chance`: 1 / the number of labels, computed from the data the runs use;
* :func:`majority`: each client predicts its own most frequent *training* label, scored on its test split (the
  global metric: the pooled training majority on the global test set) -- what a personalized model gets from the
  label skew alone;
* :func:`untrained`: the model of a run before any federated round, evaluated by the engine exactly as the trained run
  is (same flags and seed, so the same initial weights and data).

Task-specific controls (question-only and shuffled-image VQA models, a classifier on pooled real data for one-shot
methods) are hooks: :func:`register` a function for a new ``kind`` and build variants of that kind."""
from __future__ import annotations

from typing import Callable

import numpy as np

from .spec import Variant

#: kind -> fn(study, variant, seed, out_dir) -> row fields (metrics, per_domain, per_client, budget)
RUNNERS: dict[str, Callable] = {}
#: registered kinds that train (drivers such as a tuner): their rows are compared under the budget rule
DRIVERS: set[str] = set()


def is_control(kind: str) -> bool:
    return kind != "run" and kind not in DRIVERS

_NO_TRAINING = {"trained_models": 0, "optimizer_steps": 0, "examples_seen": 0, "optimizer_steps_per_model": 0.0,
                "examples_seen_per_model": 0.0, "epochs_per_model": 0.0}


def register(kind: str, fn: Callable | None = None, *, control: bool = True):
    """Register ``fn(study, variant, seed, out_dir) -> dict`` as the runner of variants of ``kind`` (usable as a
    decorator). The dict has ``metrics`` (name -> value) and optionally ``per_domain`` / ``per_client`` / ``budget``.
    ``control=False``: the kind trains (a driver that is not one ``Simulation.run``, e.g. a hyperparameter tuner);
    its rows must report a budget and claims on them follow the budget rule."""
    def deco(f):
        if kind == "run":
            raise ValueError("'run' is the engine's kind, not a control")
        RUNNERS[kind] = f
        (DRIVERS.discard if control else DRIVERS.add)(kind)
        return f
    return deco(fn) if fn is not None else deco


def chance(name: str = "chance", label: str = "chance (1 / labels)") -> Variant:
    return Variant(name, kind="chance", label=label)


def majority(name: str = "majority", label: str = "label majority (train labels)") -> Variant:
    return Variant(name, kind="majority", label=label)


def untrained(of: Variant, name: str = "untrained", label: str = "before training (0 rounds)") -> Variant:
    """The model ``of`` starts from, scored before any round (same flags, same seed)."""
    return Variant(name, argv=of.argv, kind="untrained", label=label, recipe=of.recipe)


def _data(study, variant, seed):
    from ..arguments import parse_run_args
    from ..data import build_federated_dataset
    run, data, _ = parse_run_args(study.argv(variant, seed))
    return run, build_federated_dataset(data, seed=run.seed)


def _domains(fed) -> list:
    return [c.domain for c in fed.clients]


def _by_domain(values, domains) -> dict:
    out: dict = {}
    for v, d in zip(values, domains):
        if d is not None:
            out.setdefault(str(d), []).append(v)
    return {d: float(np.mean(v)) for d, v in sorted(out.items())}


@register("chance")
def run_chance(study, variant, seed, out_dir) -> dict:
    return chance_row(_data(study, variant, seed)[1], study.metrics)


def chance_row(fed, metrics) -> dict:
    """The row of guessing uniformly: 1 / the number of labels for every accuracy in ``metrics``."""
    p = 1.0 / fed.num_labels
    n = len(fed.clients)
    return {"metrics": {k: p for k in metrics if k.endswith("accuracy")},
            "per_domain": _by_domain([p] * n, _domains(fed)), "per_client": {str(i): p for i in range(n)},
            "budget": dict(_NO_TRAINING)}


def majority_scores(train_hist: np.ndarray, test_hist: np.ndarray) -> tuple[list[float], float]:
    """Per-client accuracy of predicting each client's most frequent training label on its test labels, and the
    pooled training majority's accuracy on the pooled test labels (rows: clients, columns: label counts; ties go to
    the smaller label)."""
    per_client = []
    for tr, te in zip(train_hist, test_hist):
        per_client.append(float(te[int(np.argmax(tr))] / te.sum()) if te.sum() else float("nan"))
    pooled = test_hist.sum(0)
    return per_client, float(pooled[int(np.argmax(train_hist.sum(0)))] / max(pooled.sum(), 1))


@register("majority")
def run_majority(study, variant, seed, out_dir) -> dict:
    return majority_row(_data(study, variant, seed)[1], study.metrics)


def majority_row(fed, metrics) -> dict:
    """The row of predicting each client's most frequent training label (the global metric: the pooled one)."""
    train = fed.label_histograms("train", include_new=False)
    test = fed.label_histograms("test", include_new=False)
    per_client, _ = majority_scores(train, test)
    g = np.asarray(fed.global_test.with_format(None)["labels"])
    global_acc = float(np.mean(g == int(np.argmax(train.sum(0))))) if len(g) else float("nan")
    out = {}
    for k in metrics:
        if k == "personal_accuracy":
            out[k] = float(np.mean(per_client))
        elif k == "global_accuracy":
            out[k] = global_acc
    return {"metrics": out, "per_domain": _by_domain(per_client, _domains(fed)),
            "per_client": {str(i): a for i, a in enumerate(per_client)}, "budget": dict(_NO_TRAINING)}


@register("untrained")
def run_untrained(study, variant, seed, out_dir) -> dict:
    from ..arguments import parse_run_args
    run, data, cfg = parse_run_args(study.argv(variant, seed))
    return untrained_row(run, data, cfg, out_dir)


def untrained_row(run, data, cfg, out_dir, fed=None) -> dict:
    """The engine's own final evaluation of a simulation that ran no round (setup, then finish)."""
    import dataclasses

    from ..federated.engine import Simulation
    run = dataclasses.replace(run, output_dir=str(out_dir), overwrite_output_dir=True, progress=False,
                              checkpoint_every=0)
    sim = Simulation(run, data, cfg, fed_data=fed)
    sim.setup()
    return row_from_results(sim.finish())


def row_from_results(res: dict) -> dict:
    """The row fields of one engine ``results.json``."""
    budget = dict(res.get("budget") or {})
    train = sum(res.get("process_train_examples") or [])
    if budget.get("examples_seen_per_model") is not None and train:
        # passes over a trained model's data: examples seen per model / the mean client training split
        budget["epochs_per_model"] = budget["examples_seen_per_model"] / (train / res["num_clients"])
    return {"metrics": {k: v for k, v in res["final"].items() if isinstance(v, (int, float))},
            "per_domain": res.get("per_domain_accuracy", {}), "per_client": res.get("per_client_accuracy", {}),
            "budget": budget or None, "num_rounds": res.get("num_rounds"), "wall_time_s": res.get("wall_time_s")}
