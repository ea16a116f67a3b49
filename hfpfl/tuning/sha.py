"""Successive halving and the SHA wrapper (dissertation ch. 4, Sec. 4.1 baselines; Tables 2-3 "Tuning Wrapper";
appendix, "FedPop wrapped with SHA"):

* SHA: ``sha_start`` (27) configurations, keep the best 1/sha_eta after each stage (27 -> 9 -> 3 -> 1); each stage
  spends about R_t / E rounds; survivors continue training (no retraining); total rounds <= R_t.
* FedPop+SHA and FedEx+SHA: SHA's starting configurations and eliminations, with FedPop (L every round, G every T_g
  rounds) or FedEx inside each stage.
"""
from __future__ import annotations

import math

from .base import Member, Tuner, register
from .fedex import FedEx
from .fedpop import FedPop, eq5_score


class SHAStages(Tuner):
    """What SHA and the SHA wrapper share: sha_start members, the stage schedule within R_t, the elimination."""

    resume_unit = "stage"

    def n_members(self) -> int:
        return self.t.sha_start

    def check_budget(self) -> None:
        # every configuration trains at least one round per stage: a smaller budget would be overrun silently and
        # the tuners would no longer compare at the same R_t (Sec. 4.1 baselines)
        need = sum(size * per for size, per in self.sha_schedule())
        if need > self.budget:
            raise ValueError(f"--tuner {self.t.tuner}: --sha_start {self.t.sha_start} needs {need} rounds through its "
                             f"stages but the budget --population_size * --rounds_per_member is {self.budget}; "
                             "raise --rounds_per_member or lower --sha_start")

    def sha_schedule(self) -> list[tuple[int, int]]:
        """(members, rounds each) per stage: 27 -> 9 -> 3 (-> 1 kept): each of the E stages spends about R_t / E
        rounds; the remainder goes to the last stage; total <= R_t = population_size * R_c."""
        n, eta, stages = self.t.sha_start, self.t.sha_eta, []
        sizes = []
        while n > 1:
            sizes.append(n)
            n = max(1, math.ceil(n / eta))
        E = len(sizes) or 1
        used = 0
        for s, size in enumerate(sizes):
            per = max(1, (self.budget // E) // size)
            if s == len(sizes) - 1:
                per = max(1, (self.budget - used) // size)
            stages.append((size, per))
            used += size * per
        return stages

    def _eliminate(self, s: int, alive: list[Member], S: list[float], per: int) -> None:
        """SHA's elimination: keep the best ceil(n / sha_eta) by score S (lower = better, ties by position)."""
        keep = max(1, math.ceil(len(alive) / self.t.sha_eta))
        order = sorted(range(len(alive)), key=lambda i: (S[i], i))
        for i in order[keep:]:
            alive[i].alive = False
        self.events.append({"stage": s, "kind": "eliminate", "kept": [alive[i].idx for i in order[:keep]],
                            "dropped": [alive[i].idx for i in order[keep:]], "rounds_each": per})
        self.round = s + 1
        self.save()


@register
class SuccessiveHalving(SHAStages):
    """SHA: each stage trains its survivors one after the other for the stage's rounds, then eliminates."""

    name = "sha"

    def run_rounds(self) -> None:
        self._run_sha()

    def _run_sha(self) -> None:
        stages = self.sha_schedule()
        stage0 = self.round            # on resume: the number of completed stages
        for s in range(stage0, len(stages)):
            size, per = stages[s]
            alive = [m for m in self.members if m.alive]
            for m in alive:
                m.hist = []
                for _ in range(per):
                    self.member_round(m)
            self._eliminate(s, alive, [eq5_score(m.hist, per, self.t.gamma_g, self.t.score) for m in alive], per)


class SHAWrapper(SHAStages):
    """A tuner (FedPop, FedEx) inside SHA's stages; its own steps are the hooks of the class it is combined with."""

    def configuration_rounds(self) -> int:
        """R_c of a configuration is the rounds of a member that survives every stage (appendix, Algorithm "FedPop
        wrapped with SHA": R_c is the maximum budget of a configuration)."""
        return sum(per for _, per in self.sha_schedule())

    def run_rounds(self) -> None:
        self._run_sha_wrapped()

    def _run_sha_wrapped(self) -> None:
        """FedPop or FedEx inside the SHA wrapper (appendix, Algorithm "FedPop wrapped with SHA"): the stages of
        :meth:`sha_schedule`; within a stage the surviving members train round by round side by side (FedPop-L /
        FedEx every round, FedPop-G every T_g rounds over the survivors, r counted over all stages), and a stage ends
        with SHA's elimination. Choices where the algorithm is silent: FedPop-G does not fire on a stage's last round
        (the elimination is that round's inter-configuration step; a member replaced there would be ranked on its
        donor's scores); the elimination ranks each member by Eq. 5 over its scores in the stage since it was last
        (re)configured: an exploited member's earlier scores belonged to the deleted configuration."""
        stages = self.sha_schedule()
        r = sum(per for _, per in stages[:self.round])   # rounds done by the survivors (resume: completed stages)
        for s in range(self.round, len(stages)):
            _, per = stages[s]
            end = r + per
            alive = [m for m in self.members if m.alive]
            for m in alive:
                m.hist, m.stage_hist = [], []
            while r < end:
                r += 1
                for m in alive:
                    self.member_round(m)
                    m.stage_hist.append(m.hist[-1])
                if r < end:
                    self.after_population_round(r)
            self._eliminate(s, alive, [eq5_score(m.stage_hist, per, self.t.gamma_g, self.t.score)
                                    for m in alive], per)


@register
class FedPopSHA(SHAWrapper, FedPop):
    """FedPop wrapped in SHA."""

    name = "fedpop_sha"


@register
class FedExSHA(SHAWrapper, FedEx):
    """FedEx wrapped in SHA."""

    name = "fedex_sha"
