"""A run's results (``results.json``): settings, final metrics per client and domain, communication, parameter
counts, and the training budget read from the round history."""
from __future__ import annotations

import numpy as np

from .comm import num_elements
from .state import GLOBAL, PRIVATE


def parameter_counts(sim) -> dict:
    """The model's parameters: total, trainable, and the state elements that travel (global) and stay (private)."""
    params = dict(sim.model.named_parameters())
    trainable = sum(p.numel() for p in params.values() if p.requires_grad)
    comm = {k: sim.model_state[k] for k in sim.keys_by_role[GLOBAL]}
    return {"total": sum(p.numel() for p in params.values()), "trainable": trainable,
            "global_state_elements": num_elements(comm), "private_state_elements":
                num_elements({k: sim.model_state[k] for k in sim.keys_by_role[PRIVATE]})}


def _dataset_name(sim) -> str:
    return getattr(sim.data_args, "dataset", "custom") if sim.data_args is not None else "custom"

def run_results(sim, final_eval: dict, wall: float) -> dict:
    """What ``results.json`` holds: the run's settings, its final evaluation, communication, parameters and budget."""
    a = sim.args
    per_client = final_eval.get("per_client", {})
    per_domain: dict[str, list[float]] = {}
    for cid, accv in per_client.items():
        dom = sim.data.clients[int(cid)].domain
        if dom is not None:
            per_domain.setdefault(str(dom), []).append(accv)
    return {
        "method": a.method, "model": a.model, "adapter": a.adapter, "dataset": _dataset_name(sim),
        "partition": getattr(sim.data_args, "partition", None), "num_clients": sim.num_clients,
        "num_rounds": sim.round, "seed": a.seed, "world_size": sim.accelerator.num_processes,
        "process_train_examples": sim.process_train_examples(),
        "final": {k: v for k, v in final_eval.items() if not isinstance(v, dict)},
        "per_client_accuracy": per_client,
        "per_domain_accuracy": {d: float(np.mean(v)) for d, v in sorted(per_domain.items())},
        "new_client_accuracy": final_eval.get("new_clients", {}),
        "communication": sim.ledger.totals(),
        "parameters": parameter_counts(sim),
        "budget": budget(sim),
        "wall_time_s": wall,
    }

def budget(sim) -> dict:
    """Client training spent so far, from the round history (so a resumed run counts every round):
    optimizer steps and examples seen in total and per trained model (each client that trained keeps or uploads
    its own model, so the per-model figure is the total over the clients that trained at least once). None where
    a round's updates did not report them."""
    trained = {int(c) for h in sim.history for c in h.get("clients", [])}
    out: dict = {"trained_models": len(trained)}
    for name in ("optimizer_steps", "examples_seen"):
        known = all(name in h for h in sim.history)
        total = int(sum(h[name] for h in sim.history)) if known else None
        out[name] = total
        out[f"{name}_per_model"] = (total / len(trained) if trained else 0.0) if known else None
    if any("server_optimizer_steps" in h for h in sim.history):
        # one model, trained on the server, is what this run evaluates: its steps are the budget to match (what
        # the clients trained for it, e.g. FedBiP's concepts, stays as client_*)
        out["trained_models"] = 1
        for name in ("optimizer_steps", "examples_seen"):
            out[f"client_{name}"] = out[name]
            out[name] = out[f"{name}_per_model"] = int(sum(h.get(f"server_{name}", 0) for h in sim.history))
    return out
