"""What every tuner shares (dissertation ch. 4, Sec. 4.1: the tuners compare at one budget R_t = N_c * R_c rounds):
a population of members, each a whole :class:`~hfpfl.federated.engine.Simulation` of the chosen method (FedAvg,
FedProx, FedBN, ...), all in one process and sharing the built ``FederatedData``; one round of one member; the run
loop; the population checkpoint (:mod:`.checkpoint`) and the final pick and files (:mod:`.results`).

Each round a member runs one ``sim.step()`` with its server vector alpha (``server_hparams=``: the engine's FedOpt
server, A2.1) and one client vector per active-client *slot* (``client_hparams=`` as a function of the client id; the
engine's client sampling is deterministic, so the tuner knows the round's clients, in sorted order = slots 0..K-1,
before the step). Scores: :mod:`.scoring`. With several accelerate processes each member's clients are sharded by
the engine and the scores are all-gathered.

A tuner is a subclass registered under its ``--tuner`` name (:func:`register`); ``Tuner(run_args, data_args,
method_config, targs)`` builds the one ``targs.tuner`` names. Subclasses fill the hooks: :meth:`Tuner.n_members`,
:meth:`Tuner.configuration_rounds`, :meth:`Tuner.check_budget`, :meth:`Tuner.init_member`,
:meth:`Tuner.slot_vectors`, :meth:`Tuner.after_member_round`, :meth:`Tuner.after_population_round`,
:meth:`Tuner.run_rounds`, :meth:`Tuner.best_extras`.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..federated.context import NonFiniteError
from ..federated.registry import get_algorithm
from ..options import validate
from . import search_space as ss
from .arguments import TUNERS, TunerArguments
from .checkpoint import PopulationCheckpoint
from .results import PopulationResults
from .scoring import ValidationScorer

logger = logging.getLogger("hfpfl")

DIVERGED = 1e6   # the score of a member whose training became non-finite (lower = better)

#: --tuner name -> its class (filled by :func:`register`)
REGISTRY: dict[str, type] = {}


def register(cls):
    """Class decorator: the tuner answers to ``--tuner cls.name``."""
    REGISTRY[cls.name] = cls
    return cls


def tuner_class(name: str) -> type:
    if name not in TUNERS or name not in REGISTRY:
        raise ValueError(f"--tuner {name!r} is not one of {TUNERS}")
    return REGISTRY[name]


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
    scores: dict = field(default_factory=dict)    # filled by the member's ValidationScorer during a step
    stage_hist: list = field(default_factory=list)  # SHA wrapper: round scores in this stage since (re)configured

    def meta(self) -> dict:
        return {k: getattr(self, k) for k in ("idx", "alpha", "beta0", "mhp", "betas", "age", "hist", "curve",
                                               "trajectory", "alive", "diverged", "rounds", "fedex", "stage_hist")}


class Tuner(PopulationCheckpoint, PopulationResults):
    """Runs a population of simulations of one method under a tuner; ``Tuner(...)`` builds the registered class
    that ``targs.tuner`` names (fedpop | rs | sha | fedex | fedpop_sha | fedex_sha)."""

    name = ""
    resume_unit = "round"   # what population.pt counts (the log line on resume)

    def __new__(cls, *args, **kwargs):
        if cls is Tuner:
            targs = kwargs.get("targs", args[3] if len(args) > 3 else None)
            if targs is not None:
                cls = tuner_class(targs.tuner)
        return super().__new__(cls)

    def __init__(self, run_args, data_args, method_config, targs: TunerArguments, *, fed_data=None, accelerator=None):
        from accelerate import Accelerator

        if targs.tuner != self.name:   # a tuner class built directly: its own name is the one recorded
            targs = dataclasses.replace(targs, tuner=self.name)
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
        # Eq. 4's annealing and the default T_g = 0.1 R_c run over the rounds a configuration can train
        self.horizon = self.configuration_rounds()
        self.T_g = targs.generation_rounds or max(1, round(0.1 * self.horizon))
        self.check_budget()
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
        fresh = [p for p in (self.out, self.out / "members", self.out / "members" / "m00") if not p.exists()]
        for i in range(self.n_members()):
            try:
                self.members.append(self._new_member(i))
            except ValueError:
                if i == 0 and fresh:  # a refused search space leaves nothing behind (only what this call created)
                    shutil.rmtree(fresh[0], ignore_errors=True)
                raise

    # ------------------------------------------------------------------ hooks
    def n_members(self) -> int:
        """How many members the population starts with."""
        return self.t.population_size

    def configuration_rounds(self) -> int:
        """The rounds a configuration can train (the horizon of Eq. 4 and of the default T_g): R_c."""
        return self.R_c

    def check_budget(self) -> None:
        """Refuse settings that cannot be run at the budget R_t (a one-line ValueError)."""

    def init_member(self, m: Member) -> None:
        """Tuner state of a new member (after its vectors are drawn)."""

    def slot_vectors(self, m: Member, clients: list[int]) -> list[dict]:
        """The client vector of each of this round's clients: beta^0 for every client."""
        return [m.beta0] * len(clients)

    def after_member_round(self, m: Member, scores: list[float], r: int) -> None:
        """After a healthy member's round r with its clients' scores (in client order)."""

    def after_population_round(self, r: int) -> None:
        """After every member trained round r (before the checkpoint)."""

    def best_extras(self, m: Member) -> dict:
        """What results.json adds about the picked member."""
        return {}

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
        self.init_member(m)
        self._install_scorer(m)
        return m

    def _apply_method_hparams(self, m: Member) -> None:
        """The member's method hyperparameters into its own method config (the object its algorithm reads)."""
        if self.space.method:
            m.sim.algorithm.config = self.space.method_values(m.mhp, m.sim.algorithm.config)

    def _install_scorer(self, m: Member) -> None:
        m.sim.callbacks.append(ValidationScorer(m))

    def _gather_scores(self, m: Member, clients: list[int]) -> list[float]:
        from ..federated.distributed import all_gather
        got = dict(all_gather(sorted(m.scores.items()), self.accelerator))
        m.scores = {}
        return [got[c] for c in clients]

    # ------------------------------------------------------------------ one round of one member
    def member_round(self, m: Member) -> list[float]:
        sim = m.sim
        r = sim.round + 1
        clients = sim.sample_clients(r)
        vecs = self.slot_vectors(m, clients)
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
        if not m.diverged:
            self.after_member_round(m, scores, r)
        return scores

    # ------------------------------------------------------------------ the run
    def run(self) -> dict:
        start = time.perf_counter()
        if self.t.resume:
            self.load()
        self.run_rounds()
        return self.finish(time.perf_counter() - start)

    def run_rounds(self) -> None:
        """The population side by side: every member trains round r, then :meth:`after_population_round`; the
        population is saved every T_g rounds and after the last."""
        while self.round < self.R_c:
            r = self.round + 1
            for m in self.members:
                self.member_round(m)
            self.round = r
            self.after_population_round(r)
            if r % self.T_g == 0 or r == self.R_c:
                self.save()
