"""Scoring a simulation's models: the global model on the global test set (shared over the processes), every
client's personal model on its own test split (batched over clients where the method's personal models allow it),
and held-out clients after the method's new-client protocol. :func:`personal_models` builds each client's personal
model the one way every evaluation (the run's, a method's extra metric, a tuner's, a recipe's) uses."""
from __future__ import annotations

import logging

import numpy as np

from .context import NonFiniteError, step_size_hint
from .distributed import all_gather, evaluate_sharded
from .state import MODEL

logger = logging.getLogger("hfpfl")


def personal_models(sim, client_ids, server_state: dict, round_idx: int, *, skip_unchanged_loads: bool = False):
    """Yield ``(client_id, model)``: each client's personal model in turn, as every evaluation of ``sim`` sees it.

    For each client: torch's generator seeded with ``seed_for(round_idx, client, "eval")`` (a personal model that
    trains, FedAvg+FT's fine-tuning, comes out the same in every evaluation of that round), the client's stored
    private model keys loaded (the initial ones for a client never trained), then the method's ``load_personal``. The model is the simulation's one model: use it before taking the
    next.

    ``skip_unchanged_loads``: while the generator runs, skip copying a tensor whose source and model tensor kept
    their version counters since the previous client (:func:`~hfpfl.federated.state.load_into`'s memo; the run's
    evaluation, where the same global tensors are loaded for every client). Buffers are loaded for every client
    all the same: BatchNorm's running statistics, updated in place by a personal model that trains at load
    (FedAvg+FT's fine-tuning), do not bump their version counter, so a memo would leave one client's statistics
    in the next client's model."""
    algo = sim.algorithm
    outer = sim._load_memo
    memo = sim._load_memo = {} if skip_unchanged_loads else None
    buffers = [k for k, _ in sim.model.named_buffers()] if memo is not None else []
    try:
        for cid in client_ids:
            sim.seed_torch(sim.seed_for(round_idx, cid, "eval"))
            private = sim.store.get(cid)
            sim.ctx.load((private or {}).get(MODEL) or sim.initial_private)
            yield cid, algo.load_personal(cid, server_state, private, round_idx)
            for k in buffers:
                memo.pop(k, None)
    finally:
        sim._load_memo = outer


class Evaluator:
    """Evaluates for a :class:`~hfpfl.federated.engine.Simulation` (its method, client store and ownership)."""

    def __init__(self, sim):
        self.sim = sim

    def score(self, model, data, where: str = "", shared: bool = False) -> dict:
        """Score ``model`` on ``data``; ``shared``: every process calls this with the same model and data (the global
        model on the global test set), which then scores its own share of the batches (the same numbers)."""
        if shared:
            res = evaluate_sharded(lambda d, m: self.sim.ctx.evaluate(model, d, m), data, self.sim.ctx.metric(),
                                   self.sim.args.eval_batch_size, self.sim.accelerator)
        else:
            res = self.sim.ctx.evaluate(model, data)
        if "loss" in res and not np.isfinite(res["loss"]):  # finite weights can still overflow the logits
            raise NonFiniteError(f"training diverged by round {self.sim.round}: {where} has a non-finite evaluation loss; "
                                 f"{step_size_hint(self.sim.args, self.sim.algorithm.config, server=True)}")
        return res

    def personal_models(self, client_ids, server_state: dict, round_idx: int):
        """:func:`personal_models` of this simulation (every tensor loaded for each client)."""
        return personal_models(self.sim, client_ids, server_state, round_idx)

    def client_ids(self, round_idx: int, final: bool = False) -> list[int]:
        """The clients scored at this evaluation: all at the final one, else ``--eval_clients`` of them (drawn from
        the seed and the round, the same on every process)."""
        n, k = self.sim.num_clients, getattr(self.sim.args, "eval_clients", None)
        if final or k is None:
            return list(range(n))
        m = min(n, max(1, int(round(k * n))) if k < 1 else int(k))
        if m >= n:
            return list(range(n))
        rng = np.random.default_rng([self.sim.args.seed, round_idx, 7])
        return sorted(int(c) for c in rng.choice(n, size=m, replace=False))

    def evaluate(self, round_idx: int, server_state: dict, final: bool = False) -> dict:
        algo, acc = self.sim.algorithm, self.sim.accelerator
        out: dict = {}
        self.sim.ctx.load(self.sim.initial_private)  # the global model never carries a client's private statistics
        model = algo.load_global(server_state)
        if model is not None:
            out["global_accuracy"] = self.score(model, self.sim.global_test_data(), "the global model",
                                                shared=True)["accuracy"]
        rows = []
        ids = self.sim.ownership.owned(self.client_ids(round_idx, final))
        from . import vectorized
        if len(ids) > 1 and not self.sim._vector_failed and vectorized.can_vectorize_eval(self.sim, ids):
            try:
                rows = vectorized.evaluate_clients(self.sim, ids, server_state, round_idx)
                self.sim.seed_torch(self.sim.seed_for(round_idx, ids[-1], "eval"))  # the RNG as the loop leaves it
                ids = []
            except NonFiniteError:
                raise
            except Exception as e:  # noqa: BLE001 - an op vmap cannot batch: evaluate one by one
                logger.warning("vectorized evaluation failed (%s: %s); evaluating clients one by one",
                               type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                self.sim._vector_failed = True
                rows = []
        for cid, model in personal_models(self.sim, ids, server_state, round_idx, skip_unchanged_loads=True):
            res = self.score(model, self.sim.test_data(cid), f"client {cid}'s model")
            rows.append((cid, res["accuracy"], res["num_samples"]))
        rows = sorted(all_gather(rows, acc))
        if rows:
            out["personal_accuracy"] = float(np.mean([r[1] for r in rows]))  # mean per-client accuracy
            out["personal_accuracy_weighted"] = sum(r[1] * r[2] for r in rows) / max(1, sum(r[2] for r in rows))
            out["per_client"] = {str(c): a for c, a, _ in rows}
        out.update(algo.extra_metrics(round_idx, server_state))
        if final and self.sim.data.new_clients:
            new_rows = []
            for cid in self.sim.ownership.owned(range(self.sim.num_clients, self.sim.num_clients + len(self.sim.data.new_clients))):
                self.sim.seed_torch(self.sim.seed_for(round_idx, cid, "new-client"))
                self.sim.ctx.load(self.sim.initial_private)
                model = algo.personalize_new_client(cid, server_state, self.sim.train_data(cid), round_idx)
                new_rows.append((cid, self.score(model, self.sim.test_data(cid))["accuracy"]))
            new_rows = sorted(all_gather(new_rows, acc))
            out["new_client_accuracy"] = float(np.mean([a for _, a in new_rows]))
            out["new_clients"] = {str(c): a for c, a in new_rows}
        return out
