"""FedEx (Khodak et al. 2021) wrapped in RS, as the dissertation's baseline (ch. 4, Sec. 4.1): per member one alpha
and ``fedex_configs`` client configurations in the Delta-box of beta^0; each round every active client draws a
configuration from a categorical distribution theta that is updated by exponentiated gradient on the local
validation losses (weight sharing: one model per member). FedEx wrapped in SHA is in :mod:`.sha`."""
from __future__ import annotations

import math

import numpy as np

from . import search_space as ss
from .base import Member, Tuner, register


@register
class FedEx(Tuner):
    """FedEx: each member's clients draw from its configurations; theta follows their scores."""

    name = "fedex"

    def init_member(self, m: Member) -> None:
        configs = ss.sample_ball(m.beta0, self.t.fedex_configs, self.space.client, self.rng, self.t.delta)
        n = len(configs)
        m.fedex = {"configs": configs, "theta": [1.0 / n] * n, "baseline": None, "t": 0}

    def slot_vectors(self, m: Member, clients: list[int]) -> list[dict]:
        """Each client draws a configuration index from theta / sum(theta) (recorded as the round's picks)."""
        fx = m.fedex
        picks = [int(self.rng.choice(len(fx["configs"]), p=np.asarray(fx["theta"]) / sum(fx["theta"])))
                 for _ in clients]
        fx["picks"] = picks
        return [fx["configs"][j] for j in picks]

    def after_member_round(self, m: Member, scores: list[float], r: int) -> None:
        self.fedex_update(m, scores)

    def best_extras(self, m: Member) -> dict:
        """The picked member's most probable client configuration."""
        if not m.fedex:
            return {}
        j = int(np.argmax(m.fedex["theta"]))
        return {"fedex_best_client_config": ss.to_values(m.fedex["configs"][j], self.space.client)}

    def fedex_update(self, m: Member, scores: list[float]) -> None:
        """Exponentiated gradient on the categorical distribution over the member's client configurations, with the
        previous round's mean loss as the baseline; step eta_t = sqrt(2 log n) / sqrt(t), gradient scaled by the
        largest |s - baseline| (losses are not bounded)."""
        fx = m.fedex
        theta = np.asarray(fx["theta"], dtype=float)
        n = len(theta)
        base = fx["baseline"] if fx["baseline"] is not None else float(np.mean(scores))
        dev = np.asarray(scores) - base
        scale = max(1e-12, float(np.abs(dev).max()))
        grad = np.zeros(n)
        for j, d in zip(fx["picks"], dev):
            grad[j] += d / (len(scores) * theta[j])
        fx["t"] += 1
        eta = math.sqrt(2 * math.log(max(n, 2))) / math.sqrt(fx["t"])
        logits = np.log(theta) - eta * grad / scale
        logits -= logits.max()
        theta = np.exp(logits)
        theta = np.maximum(theta / theta.sum(), 1e-12)
        fx["theta"] = (theta / theta.sum()).tolist()
        fx["baseline"] = float(np.mean(scores))
