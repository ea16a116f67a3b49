"""FedNova (Wang et al., NeurIPS 2020): normalized averaging. Client i runs tau_i local steps; its update
x - y_i is divided by ||a_i||_1, the sum of its local solver's step coefficients (tau_i for plain SGD; with momentum
rho: sum_t (1 - rho^t)/(1 - rho)), and the server applies x <- x - tau_eff * sum_i p_i (x - y_i)/||a_i||_1 with
p_i = n_i/n and tau_eff = sum_i p_i ||a_i||_1 (the paper's choice; the official code uses sum_i p_i tau_i when
momentum is on). With equal steps this is exactly FedAvg.

Only trainable parameters are normalized; buffers (BN running statistics) are averaged; a client whose update is
non-finite is skipped and logged (the adapters paper reports NaN events with FedNova).
"""
import logging
import math

import torch

from .base import MODEL, Algorithm, Update, register, weighted_average

logger = logging.getLogger("hfpfl")
NORM = "fednova"  # upload part holding the client's ||a_i||_1 ("a", a 1-element tensor) beside its model


def normalizer(steps: int, momentum: float) -> float:
    """||a_i||_1 for `steps` local SGD steps with heavy-ball momentum (1 step of momentum 0 = 1)."""
    if momentum == 0:
        return float(steps)
    return sum((1 - momentum ** t) / (1 - momentum) for t in range(1, steps + 1))


@register
class FedNova(Algorithm):
    """FedNova: client updates normalized by their local step counts before averaging."""

    name = "fednova"
    aggregation = "gather"
    local_update = "own"
    on_non_finite = "skip"  # a diverged client is skipped and logged (as the adapters paper observes), not a run-ending error
    uses_server_hparams = frozenset()  # aggregate applies tau_eff * the normalized mean itself: no FedOpt step

    def __init__(self, ctx, config):
        super().__init__(ctx, config)
        if ctx.run_hparams.optimizer != "sgd":
            raise ValueError(f"fednova normalizes SGD updates; got --optimizer {ctx.run_hparams.optimizer} (use sgd)")

    def client_update(self, client_id, down, private, round_idx):
        hp = self.ctx.hparams(client_id)
        if hp.optimizer != "sgd":
            raise ValueError(f"fednova normalizes SGD updates; client {client_id} got optimizer {hp.optimizer}")
        upd = super().client_update(client_id, down, private, round_idx)
        a = normalizer(upd.metrics["steps"], hp.momentum)
        upd.upload[NORM] = {"a": torch.tensor([a], dtype=torch.float64)}
        upd.metrics["fednova_a"] = a
        return upd

    def _param_keys(self):
        params = dict(self.model.named_parameters())
        return [k for k in self.global_keys if k in params and params[k].requires_grad]

    def aggregate(self, server_state, updates: list[Update], round_idx):
        ok = [u for u in updates if all(torch.isfinite(v).all() for v in u.upload[MODEL].values() if v.is_floating_point())]
        for u in updates:
            if u not in ok:
                logger.warning("fednova: round %d: client %d sent a non-finite update; skipped", round_idx, u.client_id)
        if not ok:
            return server_state
        total = float(sum(u.num_samples for u in ok))
        p = [u.num_samples / total for u in ok]
        a = [float(u.upload[NORM]["a"]) for u in ok]
        tau_eff = sum(pi * ai for pi, ai in zip(p, a))
        if not math.isfinite(tau_eff):
            raise ValueError("fednova: non-finite tau_eff")
        # buffers (and non-float tensors): plain weighted average / max, as FedAvg
        model = {**server_state[MODEL], **weighted_average([u.upload[MODEL] for u in ok], [u.num_samples for u in ok])}
        for k in self._param_keys():
            x = server_state[MODEL][k].double()
            step = sum(pi * (x - u.upload[MODEL][k].double()) / ai for pi, ai, u in zip(p, a, ok))
            model[k] = (x - tau_eff * step).to(server_state[MODEL][k].dtype)
        return {**server_state, MODEL: model}
