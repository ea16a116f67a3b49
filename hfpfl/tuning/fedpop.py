"""FedPop (Chen 2025, dissertation ch. 4; AAAI 2025): population-based hyperparameter tuning *while* federated training
runs, over any registered method. FedPop-L tunes each member's client vectors (one per active-client slot) inside the
Delta-box of its beta^0; FedPop-G replaces the worst members by perturbed copies of the best (exploit and explore).
The population, its rounds and scores are :mod:`hfpfl.tuning.base`'s; FedPop wrapped in SHA is in :mod:`.sha`.

Where the paper is silent or ambiguous, the choice made is said in each place:
* FedPop-L runs only in the first r_0 = 0.2 T_g rounds of a new/perturbed configuration (appendix l.1936, "early
  stopping of FedPop-L"), eps annealed over that window; at toy scale 0.2 T_g < 1, so the window is at least 1 round
  (our deviation; ``local_window_frac=0`` runs FedPop-L every round as Algorithm 1, eps annealed over R_c).
* FedPop-G (and SHA's elimination) rank by Eq. 5 unless ``--score avg|last`` (appendix Table 5's ablation).
* eps_G = cos_anneal(eps_0, r, R_c), p_re = cos_anneal(p_re_0, r, R_c) (appendix Eq. 3-4).
* Wrapped in SHA (``fedpop_sha``, ``fedex_sha``; appendix, "FedPop wrapped with SHA"): R_c in Eq. 4 and T_g is a
  survivor's rounds over all stages; FedPop-G skips a stage's last round, where SHA eliminates
  (:meth:`hfpfl.tuning.sha.SHAWrapper._run_sha_wrapped`).
* Quantile sets: ceil(n / rho) members on each side (A7.6), donors drawn with replacement.
* Final pick: the member with the lowest validation loss of its final model(s) over all clients' val splits (A7.9:
  never the test split); test accuracy is reported, not used.
"""
from __future__ import annotations

import copy
import math

import numpy as np
import torch

from . import search_space as ss
from .base import Member, Tuner, register


def cos_anneal(x0: float, r: float, r0: float) -> float:
    """Appendix Eq. 3-4: x0/2 (1 + cos(pi r / r0)) for r < r0, else 0."""
    return 0.0 if r >= r0 else x0 / 2.0 * (1.0 + math.cos(math.pi * r / r0))


def quantile_sets(scores, rho: int) -> tuple[list[int], list[int]]:
    """(bottom = worst, top = best) index lists of ceil(n / rho) each; lower score = better; ties by index."""
    n = len(scores)
    q = max(1, math.ceil(n / rho))
    order = sorted(range(n), key=lambda i: (scores[i], i))
    return sorted(order[n - q:]), sorted(order[:q])


def eq5_weights(t: int, gamma: float) -> np.ndarray:
    w = np.array([gamma ** (t - r) for r in range(1, t + 1)], dtype=float)
    return w / w.sum()


def eq5_score(hist, t: int, gamma: float, how: str = "power_law") -> float:
    """Eq. 5: power-law weighted mean of the last T_g per-round scores (fewer if fewer exist); ``how="avg"``: their
    plain mean, ``how="last"``: the last one (appendix Table 5's alternatives)."""
    last = list(hist)[-t:]
    if not last:
        return float("inf")
    if how == "last":
        return float(last[-1])
    if how == "avg":
        return float(np.mean(np.asarray(last, dtype=float)))
    return float(np.dot(eq5_weights(len(last), gamma), np.asarray(last, dtype=float)))


def clone_state(obj):
    """Deep copy with tensors cloned (exploit must not alias the donor's tensors)."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: clone_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clone_state(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(clone_state(v) for v in obj)
    return copy.deepcopy(obj)


@register
class FedPop(Tuner):
    """FedPop: FedPop-L every round over each member's slot vectors, FedPop-G every T_g rounds over the members."""

    name = "fedpop"

    def slot_vectors(self, m: Member, clients: list[int]) -> list[dict]:
        """FedPop-L's K slot vectors, sampled in beta^0's Delta-box when there are none or the client count changed
        (then kept and evolved); without FedPop-L, beta^0 for every client."""
        if not self.t.fedpop_l:
            return super().slot_vectors(m, clients)
        if m.betas is None or len(m.betas) != len(clients):
            m.betas = ss.sample_ball(m.beta0, len(clients), self.space.client, self.rng, self.t.delta)
        return m.betas

    def after_member_round(self, m: Member, scores: list[float], r: int) -> None:
        if self.t.fedpop_l:
            self.fedpop_l(m, scores, r)

    def after_population_round(self, r: int) -> None:
        if self.t.fedpop_g and r % self.T_g == 0:
            self.fedpop_g(r)

    # ------------------------------------------------------------------ FedPop-L / FedPop-G
    def local_window(self) -> int:
        return max(1, math.ceil(self.t.local_window_frac * self.T_g)) if self.t.local_window_frac > 0 else 0

    def fedpop_l(self, m: Member, scores: list[float], r: int) -> list[int]:
        """Algorithm 1, FedPop-L over the K slot vectors; returns the replaced slots."""
        win = self.local_window()
        if win:
            if m.age > win:
                return []
            eps = cos_anneal(self.t.eps0, m.age - 1, win)
        else:
            eps = cos_anneal(self.t.eps0, r, self.horizon)
        p_re = cos_anneal(self.t.p_re0, r, self.horizon)
        if len(scores) < 2:
            return []
        bottom, top = quantile_sets(scores, self.t.rho)
        for kb in bottom:
            kt = int(self.rng.choice(top))
            new = ss.evo(m.betas[kt], self.space.client, eps, p_re, self.rng)
            m.betas[kb] = ss.project_ball(new, m.beta0, self.space.client, self.t.delta)
        return bottom

    def fedpop_g(self, r: int) -> list[dict]:
        """Algorithm 1 / Eq. 5: the worst ceil(N/rho) members take a top member's whole state (exploit) and an
        Evo-perturbed copy of its (alpha, beta^0) (explore)."""
        alive = [m for m in self.members if m.alive]
        S = [eq5_score(m.hist, self.T_g, self.t.gamma_g, self.t.score) for m in alive]
        bottom, top = quantile_sets(S, self.t.rho)
        eps, p_re = cos_anneal(self.t.eps0, r, self.horizon), cos_anneal(self.t.p_re0, r, self.horizon)
        events = []
        donors_state = {}
        for ib in bottom:
            it = int(self.rng.choice(top))
            if it == ib:
                continue
            dst, src = alive[ib], alive[it]
            if it not in donors_state:
                donors_state[it] = clone_state(src.sim.state_dict())
            dst.sim.load_state_dict(clone_state(donors_state[it]))
            dst.alpha = ss.evo(src.alpha, self.space.server, eps, p_re, self.rng)
            dst.beta0 = ss.evo(src.beta0, self.space.client, eps, p_re, self.rng)
            if self.space.method:   # after the exploit: load_state_dict does not touch the method config
                dst.mhp = ss.evo(src.mhp, self.space.method, eps, p_re, self.rng)
                self._apply_method_hparams(dst)
            dst.betas, dst.age, dst.diverged = None, 0, src.diverged
            dst.stage_hist = []   # SHA wrapper: the deleted configuration's scores do not rank the new one
            events.append({"round": r, "kind": "exploit", "dst": dst.idx, "src": src.idx,
                           "score_dst": S[ib], "score_src": S[it]})
        for m in alive:
            m.hist = []
        self.events.extend(events)
        return events
