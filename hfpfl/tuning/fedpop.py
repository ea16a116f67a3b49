"""FedPop (Chen 2025, dissertation ch. 4; AAAI 2025): population-based hyperparameter tuning *while* federated training runs,
over any registered method. The RS / SHA / FedEx baselines run on the same driver (``baselines.py``).

A population member is a whole :class:`~hfpfl.federated.engine.Simulation` of the chosen method (FedAvg, FedProx,
FedBN, ...); all members live in one process and share the built ``FederatedData``. Each round a member runs one
``sim.step()`` with its server vector alpha (``server_hparams=``: the engine's FedOpt server, A2.1) and one client
vector per active-client *slot* (``client_hparams=`` as a function of the client id; the engine's client sampling is
deterministic, so the tuner knows the round's clients, in sorted order = slots 0..K-1, before the step).

Scores: the validation loss of each *locally trained* model w^k (A2.1, l.1789). The engine aggregates the uploads
inside ``step()`` and keeps no copy of w^k, so the tuner wraps the member's ``algorithm.client_update`` (an instance
attribute; no engine change): right after the method's local update it loads the uploaded model part into
``ctx.model`` (a method may train more after w^k, as Ditto's personal model) and evaluates
``ctx.evaluate(ctx.model, ctx.val_data(client))``; a method that uploads no model part (SCAFFOLD's deltas) is scored
on the model its update leaves. Evaluation is in eval mode and changes no weights or statistics.
With several accelerate processes each member's clients are sharded by the engine and the scores are all-gathered.

Where the paper is silent or ambiguous, the choice made is said in each place:
* FedPop-L runs only in the first r_0 = 0.2 T_g rounds of a new/perturbed configuration (appendix l.1936, "early
  stopping of FedPop-L"), eps annealed over that window; at toy scale 0.2 T_g < 1, so the window is at least 1 round
  (our deviation; ``local_window_frac=0`` runs FedPop-L every round as Algorithm 1, eps annealed over R_c).
* eps_G = cos_anneal(eps_0, r, R_c), p_re = cos_anneal(p_re_0, r, R_c) (appendix Eq. 3-4).
* Wrapped in SHA (``fedpop_sha``, ``fedex_sha``; appendix, "FedPop wrapped with SHA"): R_c in Eq. 4 and T_g is a
  survivor's rounds over all stages; FedPop-G skips a stage's last round, where SHA eliminates (``_run_sha_wrapped``).
* Quantile sets: ceil(n / rho) members on each side (A7.6), donors drawn with replacement.
* Final pick: the member with the lowest validation loss of its final model(s) over all clients' val splits (A7.9:
  never the test split); test accuracy is reported, not used.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..federated.context import HParams, NonFiniteError
from ..federated.registry import get_algorithm
from ..federated.state import MODEL
from ..options import at_least, in_range, option, validate
from . import search_space as ss

logger = logging.getLogger("hfpfl")

TUNERS = ("fedpop", "rs", "sha", "fedex", "fedpop_sha", "fedex_sha")
# the paper's wrappers (Table 2, "Tuning Wrapper"): RS trains N_c configurations side by side; SHA starts sha_start and
# eliminates. fedpop_sha / fedex_sha are FedPop / FedEx inside the SHA wrapper (appendix, "FedPop wrapped with SHA").
SHA_TUNERS = ("sha", "fedpop_sha", "fedex_sha")
FEDPOP_TUNERS = ("fedpop", "fedpop_sha")
FEDEX_TUNERS = ("fedex", "fedex_sha")
DIVERGED = 1e6   # the score of a member whose training became non-finite (lower = better)


@dataclass
class TunerArguments:
    """Tuning flags: the fedpop recipe's own options (hfpfl.arguments.parse_run_args parses and checks them)."""

    tuner: str = option("fedpop", "fedpop | rs | sha | fedex (all at the same budget); fedpop_sha / fedex_sha: FedPop / "
                        "FedEx wrapped in SHA (sha_start configurations, eliminated as SHA).", choices=list(TUNERS))
    population_size: int = option(4, "N_c: members (RS/FedPop/FedEx). SHA and the SHA-wrapped tuners start sha_start "
                                  "members; the budget is still population_size * rounds_per_member.",
                                  check=at_least(1))
    rounds_per_member: int = option(30, "R_c: rounds each member trains; the budget is R_t = population_size * "
                                    "rounds_per_member rounds.", check=at_least(1))
    generation_rounds: int | None = option(None, "T_g: rounds between FedPop-G steps (default max(1, round(0.1 * "
                                           "R_c)); fedpop_sha: R_c is a survivor's rounds over all SHA stages).",
                                           check=at_least(1))
    rho: int = option(3, "Quantile rate: the best/worst ceil(n / rho) are donors/replaced.", check=at_least(1))
    eps0: float = option(0.1, "Initial perturbation intensity epsilon_0 (a fraction of each range).",
                         check=in_range(0, 1))
    p_re0: float = option(0.1, "Initial resampling probability p_re^0.", check=in_range(0, 1))
    gamma_g: float = option(0.9, "Power-law decay of the FedPop-G score (Eq. 5).", check=in_range(0, 1, low_open=True))
    local_window_frac: float = option(0.2, "FedPop-L runs for ceil(frac * T_g) rounds (>= 1) after a configuration is "
                                      "(re)initialised (appendix); 0 = every round (Algorithm 1).", check=in_range(0, 1))
    delta: float = option(0.2, "Delta-box half-width as a fraction of each range.", check=in_range(0, 1))
    fedpop_l: bool = option(True, "Enable FedPop-L (ablation switch).")
    fedpop_g: bool = option(True, "Enable FedPop-G (ablation switch).")
    search_space: str | None = option(None, "YAML search space (server:/client: blocks, see "
                                      "hfpfl/tuning/search_space.py); default: the paper's (appendix).")
    sha_start: int = option(27, "SHA: initial configurations (27 -> 9 -> 3 -> 1).", check=at_least(1))
    sha_eta: int = option(3, "SHA: elimination rate (each stage keeps ceil(n / sha_eta)).", check=at_least(2))
    fedex_configs: int = option(27, "FedEx: client configurations per member.", check=at_least(1))
    final_finetune_epochs: int = option(1, "Epochs of Loc(beta^0) for the best member's fine-tuned accuracy (0 = "
                                        "none; named apart from fedavg_ft's --finetune_epochs, which a method config "
                                        "may carry).", check=at_least(0))
    resume: bool = option(False, "Continue from output_dir/population.pt if present.")


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


def eq5_score(hist, t: int, gamma: float) -> float:
    """Eq. 5: power-law weighted mean of the last T_g per-round scores (fewer if fewer exist)."""
    last = list(hist)[-t:]
    if not last:
        return float("inf")
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


@dataclass
class Member:
    idx: int
    sim: object
    alpha: dict
    beta0: dict
    mhp: dict = field(default_factory=dict)        # method hyperparameters (search space ``method:``), per member
    betas: list | None = None          # K slot vectors; None = re-sample in the Delta-box next round
    age: int = 0
    hist: list = field(default_factory=list)      # per-round mean local val loss since the last FedPop-G
    curve: list = field(default_factory=list)     # (round, mean local val loss) over the whole run
    trajectory: list = field(default_factory=list)  # per round: alpha and beta0 values, slot means
    alive: bool = True
    diverged: int = 0                  # round at which training became non-finite (0 = healthy)
    rounds: int = 0
    fedex: dict | None = None          # FedEx: configs, theta, baseline
    scores: dict = field(default_factory=dict)    # filled by the client_update wrapper during a step
    stage_hist: list = field(default_factory=list)  # SHA wrapper: round scores in this stage since (re)configured

    def meta(self) -> dict:
        return {k: getattr(self, k) for k in ("idx", "alpha", "beta0", "mhp", "betas", "age", "hist", "curve",
                                               "trajectory", "alive", "diverged", "rounds", "fedex", "stage_hist")}


class Tuner:
    """Runs a population of simulations of one method under a tuner (fedpop | rs | sha | fedex)."""

    def __init__(self, run_args, data_args, method_config, targs: TunerArguments, *, fed_data=None, accelerator=None):
        from accelerate import Accelerator

        if targs.tuner not in TUNERS:
            raise ValueError(f"--tuner {targs.tuner!r} is not one of {TUNERS}")
        validate(targs)  # the declared checks, for tuner arguments built in Python too
        self.run_args, self.data_args, self.method_config, self.t = run_args, data_args, method_config, targs
        self.space = ss.SearchSpace.from_yaml(targs.search_space)
        # refuse a search space naming what the method ignores before anything is written; the model's dropout
        # layers are known once the first member's model exists (_new_member)
        from .models import method_with_model
        self.space.fit_method(get_algorithm(method_with_model(run_args.method, run_args.model)), method_config,
                              optimizer=run_args.optimizer, has_dropout=None, name=run_args.method)
        self.out = Path(run_args.output_dir)
        self.R_c = targs.rounds_per_member
        self.budget = targs.population_size * self.R_c
        # the rounds a configuration can train: R_c under RS; under the SHA wrapper the rounds of a member that survives
        # every stage (appendix, Algorithm "FedPop wrapped with SHA": R_c is the maximum budget of a configuration).
        # Eq. 4's annealing and the default T_g = 0.1 R_c run over it.
        self.horizon = sum(per for _, per in self.sha_schedule()) if targs.tuner in ("fedpop_sha", "fedex_sha") \
            else self.R_c
        self.T_g = targs.generation_rounds or max(1, round(0.1 * self.horizon))
        if targs.tuner in SHA_TUNERS:
            # every configuration trains at least one round per stage: a smaller budget would be overrun silently and
            # the tuners would no longer compare at the same R_t (Sec. 4.1 baselines)
            need = sum(size * per for size, per in self.sha_schedule())
            if need > self.budget:
                raise ValueError(f"--tuner {targs.tuner}: --sha_start {targs.sha_start} needs {need} rounds through its "
                                 f"stages but the budget --population_size * --rounds_per_member is {self.budget}; "
                                 "raise --rounds_per_member or lower --sha_start")
        self.accelerator = accelerator or Accelerator()       # members' engines (no trackers of their own)
        torch.set_num_threads(max(1, run_args.num_threads))  # after it: see Simulation.__init__
        log_with = None if run_args.report_to == "none" else run_args.report_to
        # the population's live view (--report_to tensorboard): per-member score and hyperparameters per round
        self.tracker = Accelerator(log_with=log_with, project_dir=str(self.out)) if log_with else None
        self._trackers_started = False
        if fed_data is None:
            from ..data import build_federated_dataset
            fed_data = build_federated_dataset(data_args, seed=run_args.seed)
        self.fed_data = fed_data
        n = len(fed_data.clients)
        self.K = min(run_args.clients_per_round or max(1, int(round(run_args.client_fraction * n))), n)
        self.rng = np.random.default_rng([run_args.seed, 20250])
        self.round = 0                      # rounds completed by the synchronous population (RS/FedPop/FedEx)
        self.events: list[dict] = []        # FedPop-G exploits, SHA eliminations
        self.tried: set = set()             # distinct (alpha, beta) vectors used to train a client
        self.loc_calls = 0
        self.rounds_used = 0
        self.members: list[Member] = []
        self._fitted = False
        n_members = targs.sha_start if targs.tuner in SHA_TUNERS else targs.population_size
        fresh = [p for p in (self.out, self.out / "members", self.out / "members" / "m00") if not p.exists()]
        for i in range(n_members):
            try:
                self.members.append(self._new_member(i))
            except ValueError:
                if i == 0 and fresh:  # a refused search space leaves nothing behind (only what this call created)
                    shutil.rmtree(fresh[0], ignore_errors=True)
                raise

    # ------------------------------------------------------------------ members
    def _new_member(self, i: int) -> Member:
        from ..federated.engine import Simulation
        from .models import method_with_model

        args = dataclasses.replace(
            self.run_args, output_dir=str(self.out / "members" / f"m{i:02d}"), seed=self.run_args.seed * 1000 + i,
            num_rounds=10 ** 6, clients_per_round=self.K, eval_every=10 ** 6, checkpoint_every=0,
            overwrite_output_dir=True, resume_from_checkpoint=None, progress=False, report_to="none",
            method=method_with_model(self.run_args.method, self.run_args.model))
        sim = Simulation(args, self.data_args, copy.deepcopy(self.method_config), fed_data=self.fed_data,
                         accelerator=self.accelerator)
        if not self._fitted:   # before any vector is drawn: the space holds only what this method reads
            has_dropout = any(isinstance(x, torch.nn.modules.dropout._DropoutNd) for x in sim.model.modules())
            self.space.fit_method(type(sim.algorithm), self.method_config, optimizer=self.run_args.optimizer,
                                  has_dropout=has_dropout, name=self.run_args.method)
            self._fitted = True
        alpha = ss.sample(self.space.server, self.rng)
        beta0 = ss.sample(self.space.client, self.rng)
        m = Member(i, sim, alpha, beta0, mhp=ss.sample(self.space.method, self.rng))
        self._apply_method_hparams(m)
        if self.t.tuner in FEDEX_TUNERS:
            configs = ss.sample_ball(beta0, self.t.fedex_configs, self.space.client, self.rng, self.t.delta)
            n = len(configs)
            m.fedex = {"configs": configs, "theta": [1.0 / n] * n, "baseline": None, "t": 0}
        self._install_scorer(m)
        return m

    def _apply_method_hparams(self, m: Member) -> None:
        """The member's method hyperparameters into its own method config (the object its algorithm reads)."""
        if self.space.method:
            m.sim.algorithm.config = self.space.method_values(m.mhp, m.sim.algorithm.config)

    def _install_scorer(self, m: Member) -> None:
        algo = m.sim.algorithm
        original = algo.client_update

        def client_update(client_id, down, private, round_idx):
            upd = original(client_id, down, private, round_idx)
            if MODEL in upd.upload:  # score w^k as uploaded: Ditto, e.g., leaves its personal model in ctx.model
                algo.ctx.load(upd.upload[MODEL])
            res = algo.ctx.evaluate(algo.ctx.model, algo.ctx.val_data(client_id))
            m.scores[client_id] = float(res["loss"])
            return upd

        algo.client_update = client_update
        # the scorer reads each client's model right after its update: the engine must train clients one by one
        algo.local_update = "own"

    def _gather_scores(self, m: Member, clients: list[int]) -> list[float]:
        from ..federated.distributed import all_gather
        got = dict(all_gather(sorted(m.scores.items()), self.accelerator))
        m.scores = {}
        return [got[c] for c in clients]

    # ------------------------------------------------------------------ one round of one member
    def _slot_vectors(self, m: Member, clients: list[int]) -> list[dict]:
        tuner = self.t.tuner
        if tuner in FEDEX_TUNERS:
            fx = m.fedex
            picks = [int(self.rng.choice(len(fx["configs"]), p=np.asarray(fx["theta"]) / sum(fx["theta"])))
                     for _ in clients]
            fx["picks"] = picks
            return [fx["configs"][j] for j in picks]
        if tuner in FEDPOP_TUNERS and self.t.fedpop_l:
            if m.betas is None or len(m.betas) != len(clients):
                m.betas = ss.sample_ball(m.beta0, len(clients), self.space.client, self.rng, self.t.delta)
            return m.betas
        return [m.beta0] * len(clients)   # RS / SHA / FedPop without L: one client vector

    def member_round(self, m: Member) -> list[float]:
        sim = m.sim
        r = sim.round + 1
        clients = sim.sample_clients(r)
        vecs = self._slot_vectors(m, clients)
        slot = {c: k for k, c in enumerate(clients)}
        values = [ss.to_values(v, self.space.client) for v in vecs]
        akey = ss.key(m.alpha)
        for v in vecs:
            self.tried.add((akey, ss.key(v)))
        if not m.diverged:
            try:
                # a method that trains on the server (client id -1: Central, FedBiP) uses the run's own settings
                sim.step(client_hparams=lambda cid: values[slot[cid]] if cid in slot else {},
                         server_hparams=ss.to_values(m.alpha, self.space.server))
                scores = self._gather_scores(m, clients)
            except NonFiniteError as e:
                # a configuration that diverges is a legitimate tuning outcome: the member keeps its last finite
                # state, scores +inf-like from now on and spends its rounds idle (the budget is not refunded);
                # FedPop-G replaces it, RS/SHA never pick it
                logger.info("member %d diverged in round %d: %s", m.idx, r, e)
                m.diverged, m.scores = r, {}
        if m.diverged:
            scores = [DIVERGED] * len(clients)
        m.age += 1
        m.rounds += 1
        self.rounds_used += 1
        self.loc_calls += len(clients)
        mean = float(np.mean(scores))
        m.hist.append(mean)
        m.curve.append((r, mean))
        m.trajectory.append({"round": r, "alpha": ss.to_values(m.alpha, self.space.server),
                             "beta0": ss.to_values(m.beta0, self.space.client),
                             "method": ss.to_values(m.mhp, self.space.method), "score": mean})
        if self.tracker is not None:
            if not self._trackers_started:
                self.tracker.init_trackers(f"{self.t.tuner}-{self.run_args.method}")
                self._trackers_started = True
            t = m.trajectory[-1]
            self.tracker.log({f"m{m.idx}/val_loss": mean,
                              **{f"m{m.idx}/alpha.{k}": v for k, v in t["alpha"].items()},
                              **{f"m{m.idx}/beta0.{k}": float(v) for k, v in t["beta0"].items()}}, step=r)
        if self.t.tuner in FEDPOP_TUNERS and self.t.fedpop_l and not m.diverged:
            self.fedpop_l(m, scores, r)
        if self.t.tuner in FEDEX_TUNERS and not m.diverged:
            self.fedex_update(m, scores)
        return scores

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
        S = [eq5_score(m.hist, self.T_g, self.t.gamma_g) for m in alive]
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

    # ------------------------------------------------------------------ FedEx (Khodak et al. 2021)
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

    # ------------------------------------------------------------------ the run
    def run(self) -> dict:
        start = time.perf_counter()
        if self.t.resume:
            self.load()
        if self.t.tuner == "sha":
            self._run_sha()
        elif self.t.tuner in SHA_TUNERS:
            self._run_sha_wrapped()
        else:
            while self.round < self.R_c:
                r = self.round + 1
                for m in self.members:
                    self.member_round(m)
                self.round = r
                fire = self.t.tuner == "fedpop" and self.t.fedpop_g and r % self.T_g == 0
                if fire:
                    self.fedpop_g(r)
                if r % self.T_g == 0 or r == self.R_c:
                    self.save()
        return self.finish(time.perf_counter() - start)

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
            self._eliminate(s, alive, [eq5_score(m.hist, per, self.t.gamma_g) for m in alive], per)

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
                if self.t.tuner == "fedpop_sha" and self.t.fedpop_g and r % self.T_g == 0 and r < end:
                    self.fedpop_g(r)
            self._eliminate(s, alive, [eq5_score(m.stage_hist, per, self.t.gamma_g) for m in alive], per)

    # ------------------------------------------------------------------ population checkpoint
    def _state(self) -> dict:
        return {"round": self.round, "rng": self.rng.bit_generator.state, "events": self.events,
                "tried": sorted(self.tried), "loc_calls": self.loc_calls, "rounds_used": self.rounds_used,
                "members": [{**m.meta(), "sim": m.sim.state_dict()} for m in self.members],
                "fingerprint": self.fingerprint()}

    def fingerprint(self) -> dict:
        t = {k: v for k, v in dataclasses.asdict(self.t).items() if k != "resume"}
        run = {k: v for k, v in dataclasses.asdict(self.run_args).items()
               if k not in ("output_dir", "overwrite_output_dir", "progress", "num_threads", "report_to")}
        return {"tuner": t, "run": run, "space": self.space.to_dict()}

    def save(self) -> None:
        """Population state, written atomically (tmp file + os.replace) after every generation / stage."""
        if not self.accelerator.is_main_process:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / "population.pt.tmp"
        torch.save(self._state(), tmp)
        os.replace(tmp, self.out / "population.pt")

    def load(self) -> bool:
        path = self.out / "population.pt"
        if not path.exists():
            return False
        state = torch.load(path, weights_only=False)
        if state["fingerprint"] != self.fingerprint():
            raise ValueError(f"{path}: the saved population was run with other settings; use another --output_dir")
        self.round, self.events = int(state["round"]), list(state["events"])
        self.rng.bit_generator.state = state["rng"]
        self.tried = {_tuplify(x) for x in state["tried"]}
        self.loc_calls, self.rounds_used = int(state["loc_calls"]), int(state["rounds_used"])
        for m, saved in zip(self.members, state["members"]):
            for k, v in saved.items():
                if k != "sim":
                    setattr(m, k, v)
            m.sim.load_state_dict(saved["sim"])
            m.scores = {}
            self._apply_method_hparams(m)
        logger.info("resumed the population at %s %d", "stage" if self.t.tuner in SHA_TUNERS else "round", self.round)
        return True

    # ------------------------------------------------------------------ final evaluation and results
    def member_val_loss(self, m: Member) -> float:
        """Sample-weighted validation loss of the member's final model(s) over every client's val split (each
        client's personal model where the method has one, the global model otherwise)."""
        sim, tot, n = m.sim, 0.0, 0
        for cid in range(len(self.fed_data.clients)):
            private = sim.store.get(cid)
            sim.ctx.load((private or {}).get(MODEL) or sim.initial_private)
            model = sim.algorithm.load_personal(cid, sim.server_state, private, sim.round)
            res = sim.ctx.evaluate(model, sim.ctx.val_data(cid))
            tot += res["loss"] * res["num_samples"]
            n += res["num_samples"]
        return tot / max(1, n)

    def finetuned_accuracy(self, m: Member) -> float:
        """A2.10: the final model fine-tuned on each client with Loc(beta^0), evaluated on its test split."""
        sim = m.sim
        hp = HParams.from_args(sim.args).replace(**ss.to_values(m.beta0, self.space.client))
        accs = []
        for cid in range(len(self.fed_data.clients)):
            private = sim.store.get(cid)
            sim.ctx.load((private or {}).get(MODEL) or sim.initial_private)
            sim.algorithm.load_personal(cid, sim.server_state, private, sim.round)
            if self.t.final_finetune_epochs > 0:
                sim.ctx.train(cid, sim.round + 1, hp=hp, epochs=self.t.final_finetune_epochs, tag="fedpop-finetune")
            accs.append(sim.ctx.evaluate(sim.model, sim.ctx.test_data(cid))["accuracy"])
        return float(np.mean(accs))

    def finish(self, wall: float) -> dict:
        rows = []
        for m in self.members:
            if not m.alive or m.diverged:
                rows.append({"member": m.idx, "alive": False, "diverged": m.diverged, "rounds": m.rounds,
                             "curve": m.curve,
                             "alpha": ss.to_values(m.alpha, self.space.server),
                             "beta0": ss.to_values(m.beta0, self.space.client),
                             "method": ss.to_values(m.mhp, self.space.method)})
                continue
            val = self.member_val_loss(m)
            res = m.sim.finish()
            rows.append({"member": m.idx, "alive": True, "rounds": m.rounds, "val_loss": val,
                         "global_accuracy": res["final"].get("global_accuracy"),
                         "personal_accuracy": res["final"].get("personal_accuracy"),
                         "alpha": ss.to_values(m.alpha, self.space.server),
                         "beta0": ss.to_values(m.beta0, self.space.client),
                         "method": ss.to_values(m.mhp, self.space.method), "curve": m.curve})
        alive = [r for r in rows if r["alive"]]
        if not alive:
            raise NonFiniteError("every member of the population diverged; narrow the search space (lower lr)")
        best = min(alive, key=lambda r: (r["val_loss"], r["member"]))
        best_m = next(m for m in self.members if m.idx == best["member"])
        best = {**best, "finetuned_accuracy": self.finetuned_accuracy(best_m)}
        if best_m.fedex:
            j = int(np.argmax(best_m.fedex["theta"]))
            best["fedex_best_client_config"] = ss.to_values(best_m.fedex["configs"][j], self.space.client)
        alphas = {a for a, _ in self.tried}
        results = {
            "tuner": self.t.tuner, "method": self.run_args.method, "seed": self.run_args.seed,
            "budget": {"R_t": self.budget, "rounds_used": self.rounds_used, "loc_calls": self.loc_calls,
                       "R_c": self.R_c, "T_g": self.T_g, "K": self.K,
                       "members": len(self.members), "retraining_rounds": 0},
            "tried": {"alpha": len(alphas), "beta": len({b for _, b in self.tried}), "pairs": len(self.tried)},
            "best_member": best, "members": rows, "events": self.events, "wall_time_s": wall,
        }
        if self.accelerator.is_main_process:
            from ..tracking import atomic_write_text, write_config
            write_config(self.out, tuner=self.t, run=self.run_args, data=self.data_args, method=self.method_config)
            (self.out / "search_space.yaml").write_text(__import__("yaml").safe_dump(self.space.to_dict()))
            atomic_write_text(self.out / "results.json", json.dumps(results, indent=2, default=str))
            plot_population(self.out, self.members, self.events, title=f"{self.t.tuner} on {self.run_args.method}")
        if self.tracker is not None and self._trackers_started:
            self.tracker.end_training()
        return results


def _tuplify(x):
    if isinstance(x, (list, tuple)):
        return tuple(_tuplify(v) for v in x)
    return x


def plot_population(out: Path, members: list[Member], events: list[dict], title: str = "") -> None:
    """curves.png: per-member mean local validation loss per round (x marks exploits); hparams.png: alpha and beta^0
    of every member over rounds."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 - plots are optional
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for m in members:
        if m.curve:
            xs, ys = zip(*m.curve)
            ax.plot(xs, ys, label=f"m{m.idx}", lw=1)
    for e in events:
        if e.get("kind") == "exploit":
            ax.axvline(e["round"], color="gray", lw=0.3)
    ax.set_xlabel("round")
    ax.set_ylabel("mean val loss of local models")
    ax.set_yscale("log")
    ax.set_title(title)
    if len(members) <= 12:
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=110)
    plt.close(fig)
    names = []
    for m in members:
        for t in m.trajectory[:1]:
            names = [("alpha", k) for k in t["alpha"]] + [("beta0", k) for k in t["beta0"]] + \
                [("method", k) for k in t.get("method", {})]
        if names:
            break
    if not names:
        return
    cols = 3
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.6 * rows), squeeze=False)
    for ax, (part, k) in zip(axes.flat, names):
        for m in members:
            if m.trajectory:
                ax.plot([t["round"] for t in m.trajectory], [t[part][k] for t in m.trajectory], lw=1)
        ax.set_title(f"{part}.{k}", fontsize=8)
        if k in ("lr", "server_lr", "weight_decay"):
            ax.set_yscale("log")
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out / "hparams.png", dpi=110)
    plt.close(fig)
