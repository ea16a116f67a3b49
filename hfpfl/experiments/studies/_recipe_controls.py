"""Controls for studies whose data a recipe builds (FedPCE's degradation benchmark, FedBasis' PFLBED): the generic
controls build ``hfpfl run``'s data, so these build the recipe's own (its defaults, options and data function), with
held-out new clients scored like the participants.

* ``recipe_chance``: 1 / the number of labels, for participants and new clients;
* ``recipe_majority``: each client (participant or new) predicts its own most frequent training label on its test
  split (plainly and label-re-weighted, PFLBED's metric);
* ``recipe_untrained``: the recipe's model before any round, evaluated by the engine as the trained rows are (new
  clients adapt from it exactly as they would from the trained model)."""
from __future__ import annotations

import dataclasses

import numpy as np

from .. import controls
from ..runner import _load_recipe

#: recipe -> (its method, the name of its data function ``fn(run, data, *recipe_options) -> FederatedData``)
RECIPES = {"recipes/fedpce.py": ("fedpce", "benchmark_data"), "recipes/fedbasis.py": ("fedbasis", "pflbed_data")}

_NO_TRAINING = {"trained_models": 0, "optimizer_steps": 0, "examples_seen": 0, "optimizer_steps_per_model": 0.0,
                "examples_seen_per_model": 0.0, "epochs_per_model": 0.0}


def recipe_inputs(study, variant, seed):
    """(run, data, method config, recipe options, federated data) exactly as the recipe builds them for this row."""
    from ...arguments import parse_run_args
    if variant.recipe not in RECIPES:
        raise ValueError(f"study {study.name!r}: control {variant.name!r}: recipe {variant.recipe!r} has no data "
                         f"function known to {__name__} (known: {', '.join(RECIPES)})")
    method, fn = RECIPES[variant.recipe]
    mod = _load_recipe(variant.recipe)
    run, data, cfg, *extra = parse_run_args(study.argv(variant, seed), method=method,
                                            defaults=getattr(mod, "DEFAULTS", None),
                                            recipe_options=getattr(mod, "RECIPE_OPTIONS", None))
    return run, data, cfg, extra, getattr(mod, fn)(run, data, *extra)


def _domains(clients) -> list:
    return [str(c.domain) for c in clients]


def _by_domain(values, domains) -> dict:
    out: dict = {}
    for v, d in zip(values, domains):
        out.setdefault(d, []).append(v)
    return {d: float(np.mean(v)) for d, v in sorted(out.items())}


@controls.register("recipe_chance")
def run_chance(study, variant, seed, out_dir) -> dict:
    *_, fed = recipe_inputs(study, variant, seed)
    p = 1.0 / fed.num_labels
    metrics = {k: p for k in study.metrics if "accuracy" in k}   # label re-weighting keeps 1 / labels
    return {"metrics": metrics, "per_domain": _by_domain([p] * len(fed.clients), _domains(fed.clients)),
            "per_client": {str(i): p for i in range(len(fed.clients))}, "budget": dict(_NO_TRAINING)}


@controls.register("recipe_majority")
def run_majority(study, variant, seed, out_dir) -> dict:
    *_, fed = recipe_inputs(study, variant, seed)
    n = len(fed.clients)
    train, test = fed.label_histograms("train"), fed.label_histograms("test")
    per_client, _ = controls.majority_scores(train, test)
    lw = [label_weighted_majority(tr, te) for tr, te in zip(train, test)]
    old, new = per_client[:n], per_client[n:]
    metrics = {"personal_accuracy": float(np.mean(old)), "personal_accuracy_lw": float(np.mean(lw[:n]))}
    if new:
        metrics["new_client_accuracy"] = float(np.mean(new))
        metrics["new_client_accuracy_lw"] = metrics["new_start_accuracy_lw"] = float(np.mean(lw[n:]))
        groups: dict = {}
        for c, a in zip(fed.new_clients, new):
            groups.setdefault(str(c.domain).split("-")[0], []).append(a)
        metrics.update({f"new_{g}_accuracy": float(np.mean(v)) for g, v in groups.items()})
    return {"metrics": {k: v for k, v in metrics.items() if k in study.metrics},
            "per_domain": _by_domain(old, _domains(fed.clients)),
            "per_client": {str(i): a for i, a in enumerate(old)}, "budget": dict(_NO_TRAINING)}


def label_weighted_majority(train_hist, test_hist) -> float:
    """PFLBED's label-re-weighted accuracy (each test image weighted by the client's training label frequency) of
    always predicting the client's most frequent training label: p[m] t[m] / sum_y p[y] t[y]."""
    p = np.asarray(train_hist, np.float64) / max(1, np.sum(train_hist))
    t = np.asarray(test_hist, np.float64)
    den = float((p * t).sum())
    m = int(np.argmax(train_hist))
    return float(p[m] * t[m] / den) if den else float("nan")


@controls.register("recipe_untrained")
def run_untrained(study, variant, seed, out_dir) -> dict:
    from ...federated.engine import Simulation
    run, data, cfg, extra, fed = recipe_inputs(study, variant, seed)
    run = dataclasses.replace(run, output_dir=str(out_dir), overwrite_output_dir=True, progress=False,
                              checkpoint_every=0)
    sim = Simulation(run, data, cfg, fed_data=fed,
                     recipe_settings=dataclasses.asdict(extra[0]) if extra else None)
    sim.setup()
    return controls.row_from_results(sim.finish())
