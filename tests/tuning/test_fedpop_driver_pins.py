"""FedPop's driver pinned by hand (dissertation ch. 4, Algorithm 1 and Sec. 4.1's equal budget R_t = N_c R_c): one
member's round on a stand-in simulation (its clients' vectors, the server vector, the scores, the counters, the
trajectory, the tracker, divergence), the run loop's FedPop-G firings and checkpoints, SHA's stage schedule and
stages, the score wrapper, and on real tiny members (``--model tiny-mlp``) how the population is built: budget,
horizon, T_g, K, each member's engine arguments and seed, its first draws from the tuner's generator, FedEx's
configurations, the one-time fit of the search space, and what a refused space leaves behind."""
import logging
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hfpfl.algorithms import get_algorithm
from hfpfl.federated.context import NonFiniteError
from hfpfl.federated.state import MODEL
from hfpfl.tuning import Member, Tuner, TunerArguments, tuner_class
from hfpfl.tuning import base as tb
from hfpfl.tuning import search_space as ss
from hfpfl.tuning.scoring import ValidationScorer
from hfpfl.tuning.sha import SHAStages

SPACE = {"server": {"server_lr": {"type": "log10", "low": -1.0, "high": 1.0}},
         "client": {"lr": {"type": "log10", "low": -3.0, "high": -1.0},
                    "local_epochs": {"type": "choice", "values": [1, 2, 3]}}}


def bare(tuner="fedpop", space=SPACE, **targs):
    cls = tuner_class(tuner)
    t = cls.__new__(cls)
    t.t = TunerArguments(tuner=tuner, **targs)
    t.space = ss.SearchSpace(space)
    t.run_args = SimpleNamespace(method="fedavg")
    t.accelerator = SimpleNamespace(num_processes=1, is_main_process=True)
    t.tracker, t._trackers_started = None, False
    t.members, t.events, t.tried = [], [], set()
    t.round, t.loc_calls, t.rounds_used, t.T_g, t.R_c, t.horizon = 0, 0, 0, 2, 5, 5
    t.rng = np.random.default_rng(0)
    return t


class StepSim:
    """One member's engine: sample_clients gives clients 1, 4, 7; step records what each client (and the server
    side, id -1) would train with and the server vector, and leaves the scores the wrapper would have recorded."""

    def __init__(self, m_scores, fail=False):
        self.round, self.steps, self.sampled, self.m_scores, self.fail = 2, [], [], m_scores, fail
        self.member = None

    def sample_clients(self, r):
        self.sampled.append(r)
        return [1, 4, 7]

    def step(self, client_hparams=None, server_hparams=None):
        self.steps.append(({c: client_hparams(c) for c in (1, 4, 7, -1)}, server_hparams))
        if self.fail:
            raise NonFiniteError("loss is nan")
        self.member.scores = dict(self.m_scores)
        self.round += 1


def _member(sim, **kw):
    m = Member(0, sim, {"server_lr": 0.0}, {"lr": -2.0, "local_epochs": 2}, **kw)
    sim.member = m
    return m


# ------------------------------------------------------------------------------------------------ one round
def test_member_round_trains_each_client_with_its_slot_vector_and_records_the_round():
    """FedPop with L: the round is sim.round + 1 = 3; the three sorted clients train with slot vectors 0, 1, 2 as
    hyperparameter values (10^lr, epochs = values[index]); the server side (-1) with the run's own; the server
    vector as values (10^0 = 1). Scores (0.5, 1, 3) in client order; their mean 1.5 goes to hist, curve and the
    trajectory; the counters move by one round and K local updates; the tried pairs are (alpha, slot vector);
    FedPop-L gets the scores and the round."""
    t = bare(tuner="fedpop", space={**SPACE, "method": {"mu": {"type": "choice", "values": [0.5, 0.25]}}})
    sim = StepSim({7: 3.0, 1: 0.5, 4: 1.0})
    m = _member(sim, mhp={"mu": 1}, hist=[9.0], age=4)
    m.betas = [{"lr": -2.0, "local_epochs": 0}, {"lr": -1.0, "local_epochs": 1}, {"lr": -3.0, "local_epochs": 2}]
    t.members, t.rounds_used, t.loc_calls = [m], 4, 10
    seen = []
    t.fedpop_l = lambda mm, scores, r: seen.append(("L", mm.idx, list(scores), r))
    t.fedex_update = lambda mm, scores: seen.append(("fedex",))
    assert t.member_round(m) == [0.5, 1.0, 3.0]
    assert sim.sampled == [3]
    hps, server = sim.steps[0]
    assert hps[1] == {"lr": pytest.approx(0.01), "local_epochs": 1}
    assert hps[4] == {"lr": pytest.approx(0.1), "local_epochs": 2}
    assert hps[7] == {"lr": pytest.approx(0.001), "local_epochs": 3} and hps[-1] == {}
    assert server == {"server_lr": 1.0}
    assert (m.age, m.rounds, t.rounds_used, t.loc_calls) == (5, 1, 5, 13)
    assert m.hist == [9.0, 1.5] and m.curve == [(3, 1.5)] and m.scores == {}
    assert m.trajectory == [{"round": 3, "alpha": {"server_lr": 1.0},
                             "beta0": {"lr": pytest.approx(0.01), "local_epochs": 3}, "method": {"mu": 0.25},
                             "score": 1.5}]
    akey = ss.key(m.alpha)
    assert t.tried == {(akey, ss.key(b)) for b in m.betas} and len(t.tried) == 3
    assert seen == [("L", 0, [0.5, 1.0, 3.0], 3)]
    t.t.fedpop_l = False    # without L: one client vector (beta^0), no FedPop-L
    seen.clear()
    t.member_round(m)
    assert sim.steps[1][0][1] == sim.steps[1][0][7] == {"lr": pytest.approx(0.01), "local_epochs": 3}
    assert seen == [] and m.curve[-1] == (4, 1.5)


@pytest.mark.parametrize("tuner,calls", [("rs", []), ("sha", []), ("fedpop_sha", ["L"]), ("fedex", ["fedex"]),
                                         ("fedex_sha", ["fedex"])])
def test_member_round_runs_the_tuners_own_inner_step(tuner, calls):
    t = bare(tuner=tuner)
    m = _member(StepSim({1: 1.0, 4: 1.0, 7: 1.0}))
    m.fedex = {"configs": [m.beta0], "theta": [1.0]}
    seen = []
    t.fedpop_l = lambda mm, scores, r: seen.append(("L", mm, scores, r))
    t.fedex_update = lambda mm, scores: seen.append(("fedex", mm, scores))
    t.member_round(m)
    want = {"L": ("L", m, [1.0, 1.0, 1.0], 3), "fedex": ("fedex", m, [1.0, 1.0, 1.0])}
    assert seen == [want[c] for c in calls]


def test_a_member_that_diverges_scores_1e6_from_then_on_and_trains_no_more(caplog):
    """NonFiniteError in round 3: the member is marked diverged at 3, scores DIVERGED = 1e6 for its K clients, its
    partial scores are dropped, one log line says so; the next round does not step it (the budget still counts);
    neither FedPop-L nor FedEx runs for it."""
    t = bare(tuner="fedpop")
    sim = StepSim({}, fail=True)
    m = _member(sim, scores={4: 0.1})
    m.betas = [m.beta0] * 3
    seen = []
    t.fedpop_l = lambda *a: seen.append("L")
    with caplog.at_level(logging.INFO, logger="hfpfl"):
        assert t.member_round(m) == [1e6] * 3
    assert [r.getMessage() for r in caplog.records] == ["member 0 diverged in round 3: loss is nan"]
    assert m.diverged == 3 and m.scores == {} and m.hist == [1e6] and m.curve == [(3, 1e6)]
    assert t.member_round(m) == [1e6] * 3 and len(sim.steps) == 1
    assert (m.rounds, t.rounds_used, t.loc_calls) == (2, 2, 6) and seen == []
    assert tb.DIVERGED == 1e6


def test_member_round_logs_each_members_score_and_vectors_to_the_tracker():
    """--report_to: the trackers start once (named <tuner>-<method>), then each round logs m<idx>/val_loss and every
    alpha / beta^0 value at step = the round."""
    t = bare(tuner="rs")
    log = []
    t.tracker = SimpleNamespace(init_trackers=lambda name: log.append(("init", name)),
                                log=lambda d, step: log.append(("log", d, step)))
    m = _member(StepSim({1: 1.0, 4: 2.0, 7: 3.0}))
    m.idx = 2
    t.member_round(m)
    t.member_round(m)
    row = {"m2/val_loss": 2.0, "m2/alpha.server_lr": 1.0, "m2/beta0.lr": pytest.approx(0.01),
           "m2/beta0.local_epochs": 3.0}
    assert log == [("init", "rs-fedavg"), ("log", row, 3), ("log", row, 4)]
    assert t._trackers_started is True and type(log[1][1]["m2/beta0.local_epochs"]) is float


def test_gather_scores_reads_the_round_in_client_order_and_clears_them():
    t = bare()
    m = _member(StepSim({}), scores={7: 0.3, 1: 0.1, 4: 0.2, 9: 5.0})
    assert t._gather_scores(m, [1, 4, 7]) == [0.1, 0.2, 0.3] and m.scores == {}


def test_the_scorer_is_installed_as_a_callback_that_sees_each_client():
    """_install_scorer adds one ValidationScorer of the member to its simulation's callbacks, declared to see each
    client's upload (so the engine trains clients one by one); the method is left as it is."""
    algo = SimpleNamespace()
    m = _member(StepSim({}))
    m.sim = SimpleNamespace(algorithm=algo, callbacks=["defaults"])
    bare()._install_scorer(m)
    assert m.sim.callbacks[0] == "defaults" and len(m.sim.callbacks) == 2
    scorer = m.sim.callbacks[1]
    assert isinstance(scorer, ValidationScorer) and scorer.member is m and scorer.needs_each_client is True
    assert vars(algo) == {}


def test_the_validation_scorer_as_a_callback_scores_its_member():
    """ValidationScorer.after_client_update(sim, client_id, update), called on its own (as a simulation callback
    calls it): loads the uploaded model part into the member's context, evaluates ctx.model on the client's val
    split and records the loss as a float under the client id; an update without a model part is not loaded."""
    log = []

    class Ctx:
        model = "ctx-model"

        def load(self, x):
            log.append(("load", x))

        def val_data(self, cid):
            return f"val{cid}"

        def evaluate(self, model, data):
            log.append(("evaluate", model, data))
            return {"loss": 3, "accuracy": 0.5}

    m = _member(StepSim({}))
    sim = SimpleNamespace(algorithm=SimpleNamespace(ctx=Ctx()))
    scorer = ValidationScorer(m)
    assert scorer.member is m
    scorer.after_client_update(sim, 2, SimpleNamespace(upload={MODEL: "w_2"}))
    scorer.after_client_update(sim, 5, SimpleNamespace(upload={"deltas": 1}))
    assert log == [("load", "w_2"), ("evaluate", "ctx-model", "val2"), ("evaluate", "ctx-model", "val5")]
    assert m.scores == {2: 3.0, 5: 3.0} and type(m.scores[2]) is float


def test_each_tuner_name_builds_its_registered_class():
    """The registry holds one class per --tuner name; Tuner(...) builds the class targs.tuner names (targs given by
    position or keyword); the SHA-wrapped tuners are FedPop / FedEx with SHA's stages."""
    from hfpfl.tuning import REGISTRY, TUNERS, FedEx, FedPop, RandomSearch, SuccessiveHalving
    from hfpfl.tuning.sha import FedExSHA, FedPopSHA, SHAWrapper

    assert REGISTRY == {"fedpop": FedPop, "rs": RandomSearch, "sha": SuccessiveHalving, "fedex": FedEx,
                        "fedpop_sha": FedPopSHA, "fedex_sha": FedExSHA} and set(REGISTRY) == set(TUNERS)
    for name, cls in REGISTRY.items():
        assert cls.name == name and tuner_class(name) is cls
        assert type(Tuner.__new__(Tuner, "run", "data", "cfg", TunerArguments(tuner=name))) is cls
        assert type(Tuner.__new__(Tuner, "run", "data", "cfg", targs=TunerArguments(tuner=name))) is cls
    assert issubclass(FedPopSHA, FedPop) and issubclass(FedPopSHA, SHAWrapper) and issubclass(FedExSHA, FedEx)
    assert (FedPop.resume_unit, SuccessiveHalving.resume_unit, FedExSHA.resume_unit) == ("round", "stage", "stage")
    with pytest.raises(ValueError, match=r"^--tuner 'grid' is not one of \('fedpop', 'rs'"):
        tuner_class("grid")


def test_register_files_the_class_under_its_name_and_only_a_listed_tuner_is_built():
    """register() stores the class itself under its ``name`` (and returns it, as a decorator must); a class
    registered under a name that is not one of TUNERS (the --tuner choices) is still refused by tuner_class: a
    tuner answers to --tuner only when it is both listed and registered."""
    from hfpfl.tuning import REGISTRY

    class Stray(Tuner):
        name = "stray"

    try:
        assert tb.register(Stray) is Stray and REGISTRY["stray"] is Stray
        with pytest.raises(ValueError, match=r"^--tuner 'stray' is not one of"):
            tuner_class("stray")
    finally:
        REGISTRY.pop("stray", None)


def test_apply_method_hparams_sets_the_members_config():
    t = bare(space={**SPACE, "method": {"mu": {"type": "choice", "values": [0.5, 0.25]}}})
    cfg = get_algorithm("fedprox").Config()
    m = _member(StepSim({}), mhp={"mu": 1})
    m.sim = SimpleNamespace(algorithm=SimpleNamespace(config=cfg))
    t._apply_method_hparams(m)
    assert m.sim.algorithm.config.mu == 0.25 and cfg.mu == 0.01
    t = bare()
    m.sim.algorithm.config = cfg
    t._apply_method_hparams(m)
    assert m.sim.algorithm.config is cfg


# ------------------------------------------------------------------------------------------------ the run loop
def _loop_tuner(tuner="fedpop", R_c=5, T_g=2, **targs):
    t = bare(tuner=tuner, **targs)
    t.R_c, t.T_g = R_c, T_g
    t.members = [Member(i, None, {}, {}) for i in range(2)]
    log = []
    t.member_round = lambda m: log.append(("round", m.idx, t.round + 1))
    t.fedpop_g = lambda r: log.append(("G", r))
    t.save = lambda: log.append(("save", t.round))
    t.finish = lambda wall: (log.append(("finish", type(wall) is float and wall >= 0)), {"done": True})[1]
    t.load = lambda: (log.append(("load",)), setattr(t, "round", 3))
    t._run_sha = lambda: log.append(("sha",))
    t._run_sha_wrapped = lambda: log.append(("sha_wrapped",))
    return t, log


def test_run_trains_every_member_each_round_fires_fedpop_g_every_T_g_and_saves(monkeypatch):
    """R_c = 5, T_g = 2: rounds 1..5 for both members; FedPop-G after rounds 2 and 4; the population saved after
    rounds 2, 4 and 5 (the last); then finish with the wall time (a clock reading 100 s, then 112.5 s: 12.5 s)."""
    t, log = _loop_tuner()
    clock = iter([100.0, 112.5])
    monkeypatch.setattr(tb.time, "perf_counter", lambda: next(clock))
    walls = []
    t.finish = lambda wall: (walls.append(wall), log.append(("finish", True)), {"done": True})[2]
    assert t.run() == {"done": True} and walls == [12.5]
    want = []
    for r in range(1, 6):
        want += [("round", 0, r), ("round", 1, r)]
        if r % 2 == 0:
            want.append(("G", r))
        if r % 2 == 0 or r == 5:
            want.append(("save", r))
    assert log == want + [("finish", True)] and t.round == 5


@pytest.mark.parametrize("tuner,kw", [("rs", {}), ("fedex", {}), ("fedpop", {"fedpop_g": False})])
def test_run_without_fedpop_g_only_trains_and_saves(tuner, kw):
    t, log = _loop_tuner(tuner=tuner, R_c=3, T_g=3, **kw)
    t.run()
    assert log == [("round", 0, 1), ("round", 1, 1), ("round", 0, 2), ("round", 1, 2), ("round", 0, 3),
                   ("round", 1, 3), ("save", 3), ("finish", True)]


def test_run_resumes_after_the_saved_round_and_dispatches_the_sha_tuners():
    t, log = _loop_tuner(resume=True)
    t.run()
    assert log == [("load",), ("round", 0, 4), ("round", 1, 4), ("G", 4), ("save", 4), ("round", 0, 5),
                   ("round", 1, 5), ("save", 5), ("finish", True)]
    for tuner, name in (("sha", "sha"), ("fedpop_sha", "sha_wrapped"), ("fedex_sha", "sha_wrapped")):
        t, log = _loop_tuner(tuner=tuner)
        t.run()
        assert log == [(name,), ("finish", True)]


# ------------------------------------------------------------------------------------------------ SHA
def _schedule(budget, **targs):
    return SHAStages.sha_schedule(SimpleNamespace(t=TunerArguments(tuner="sha", **targs), budget=budget))


def test_sha_schedule_by_hand():
    """Stages n -> ceil(n / eta) while n > 1; each of the E stages gets (R_t // E) // n rounds per member, at least
    1; the last stage takes what is left: (R_t - used) // n."""
    # 27 -> 9 -> 3, R_t = 120: 40 // 27 = 1, 40 // 9 = 4, (120 - 27 - 36) // 3 = 19
    assert _schedule(120) == [(27, 1), (9, 4), (3, 19)]
    # 10 -> 3 (eta 4), R_t = 50: E = 2: 25 // 10 = 2, (50 - 20) // 3 = 10
    assert _schedule(50, sha_start=10, sha_eta=4) == [(10, 2), (3, 10)]
    # 9 -> 3, R_t = 10: E = 2: 5 // 9 = 0 -> 1, (10 - 9) // 3 = 0 -> 1
    assert _schedule(10, sha_start=9) == [(9, 1), (3, 1)]
    # 2 -> 1 (eta 2): one stage, all of it
    assert _schedule(7, sha_start=2, sha_eta=2) == [(2, 3)]
    assert _schedule(7, sha_start=1) == []
    # 4 -> 2 -> 1 (eta 2), R_t = 40: E = 2: 20 // 4 = 5, (40 - 20) // 2 = 10
    assert _schedule(40, sha_start=4, sha_eta=2) == [(4, 5), (2, 10)]


def test_run_sha_trains_each_stages_survivors_and_eliminates_by_eq5_over_the_stage():
    """Stages (4 x 2 rounds, 2 x 3 rounds), started at stage 0 or resumed at stage 1: each stage clears the
    survivors' history, trains each of them its rounds, and hands _eliminate the Eq. 5 score (gamma 0.5) of those
    rounds only."""
    t = bare(tuner="sha", gamma_g=0.5)
    t.sha_schedule = lambda: [(4, 2), (2, 3)]
    t.members = [Member(i, None, {}, {}, hist=[99.0]) for i in range(4)]
    log = []

    def member_round(m):
        m.hist.append(float(m.idx + len(m.hist)))
        log.append(m.idx)

    def eliminate(s, alive, S, per):
        log.append(("eliminate", s, [m.idx for m in alive], S, per))
        for m in alive[len(alive) // 2:]:
            m.alive = False

    t.member_round, t._eliminate = member_round, eliminate
    t._run_sha()
    # stage 0: member i scores (i, i + 1): (0.5 i + i + 1) / 1.5
    s0 = [(0.5 * i + i + 1) / 1.5 for i in range(4)]
    # stage 1 (3 rounds, gamma 0.5): (0.25 i + 0.5 (i + 1) + (i + 2)) / 1.75
    s1 = [(0.25 * i + 0.5 * (i + 1) + i + 2) / 1.75 for i in range(2)]
    assert log == [0, 0, 1, 1, 2, 2, 3, 3, ("eliminate", 0, [0, 1, 2, 3], pytest.approx(s0), 2),
                   0, 0, 0, 1, 1, 1, ("eliminate", 1, [0, 1], pytest.approx(s1), 3)]
    for m in t.members:
        m.alive, m.hist = True, []
    t.round = 1
    log.clear()
    t._run_sha()
    assert log[:6] == [0, 0, 0, 1, 1, 1] and log[-1][:3] == ("eliminate", 1, [0, 1, 2, 3])[:2] + ([0, 1, 2, 3],)


# ------------------------------------------------------------------------------------------------ building the population
TINY_SPACE = {"server": {"server_lr": {"type": "log10", "low": -0.5, "high": 0.3},
                         "server_momentum": {"type": "uniform", "low": 0.0, "high": 0.9}},
              "client": {"lr": {"type": "log10", "low": -2.5, "high": -0.5},
                         "local_epochs": {"type": "choice", "values": [1, 2, 3]},
                         "dropout": {"type": "uniform", "low": 0.0, "high": 0.5}}}


@pytest.fixture
def build(tiny_fed, tmp_path):
    from hfpfl.config import RunArguments

    da, fed = tiny_fed

    def _make(method="fedavg", out="t", space=TINY_SPACE, run_kw=None, method_kw=None, fed_data=fed, cls=Tuner,
              **tkw):
        import yaml

        ra = RunArguments(method=method, model="tiny-mlp", output_dir=str(tmp_path / out),
                          **{"seed": 0, "clients_per_round": 3, "progress": False, **(run_kw or {})})
        kw = dict(population_size=2, rounds_per_member=4, generation_rounds=2)
        kw.update(tkw)
        p = tmp_path / f"{out}_space.yaml"
        p.write_text(yaml.safe_dump(space))
        return cls(ra, da, get_algorithm(method).Config(**(method_kw or {})), TunerArguments(search_space=str(p), **kw),
                   fed_data=fed_data)

    return _make


def test_the_population_is_built_with_its_budget_horizon_and_members(build, tmp_path):
    """N_c = 2, R_c = 4: budget 8, horizon R_c, T_g as given; K = clients_per_round; each member an engine of
    <method>+tiny-mlp writing under members/m<i>, seed 1000 s + i, never evaluating or checkpointing by itself, one
    round at a time (num_rounds huge), K clients, sharing the federation and the accelerator; its own copy of the
    method config; alpha then beta^0 drawn from the tuner's generator seeded (seed, 20250)."""
    threads = torch.get_num_threads()
    try:
        t = build(method="fedprox", method_kw={"mu": 0.3},
                  run_kw={"seed": 3, "num_threads": 1, "progress": True, "resume_from_checkpoint": "latest"})
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert (t.R_c, t.budget, t.horizon, t.T_g, t.K) == (4, 8, 4, 2, 3)
    assert (t.round, t.events, t.tried, t.loc_calls, t.rounds_used, t.tracker) == (0, [], set(), 0, 0, None)
    assert t.out == tmp_path / "t" and t._fitted is True and len(t.members) == 2
    g = np.random.default_rng([3, 20250])
    for i, m in enumerate(t.members):
        a = m.sim.args
        assert m.idx == i and a.output_dir == str(tmp_path / "t" / "members" / f"m{i:02d}") and a.seed == 3000 + i
        assert (a.num_rounds, a.clients_per_round, a.eval_every, a.checkpoint_every) == (10 ** 6, 3, 10 ** 6, 0)
        assert (a.overwrite_output_dir, a.resume_from_checkpoint, a.progress, a.report_to) == (True, None, False,
                                                                                                "none")
        assert a.method == "fedprox+tiny-mlp" and m.sim.accelerator is t.accelerator
        assert m.sim.data is t.fed_data and m.sim.data_args is t.data_args
        assert m.sim.algorithm.config is not t.method_config and m.sim.algorithm.config.mu == 0.3
        want_alpha = {"server_lr": g.uniform(-0.5, 0.3), "server_momentum": g.uniform(0.0, 0.9)}
        # the space file is written with sorted keys: dropout, local_epochs, lr
        want_beta = {"dropout": g.uniform(0.0, 0.5), "local_epochs": int(g.integers(3)), "lr": g.uniform(-2.5, -0.5)}
        assert m.alpha == want_alpha and m.beta0 == want_beta and m.mhp == {} and m.fedex is None
        # the scorer: a callback of this member's simulation that sees each client's upload (nothing on the instance)
        scorers = [c for c in m.sim.callbacks if isinstance(c, ValidationScorer)]
        assert [s.member for s in scorers] == [m] and m.sim.each_client
        assert "client_update" not in vars(m.sim.algorithm) and m.sim.algorithm.local_update == "engine"
    assert t.rng.random() == g.random()   # nothing else drawn


def test_default_T_g_K_and_the_horizon_of_the_sha_wrapped_tuners(build):
    """T_g defaults to max(1, round(0.1 horizon)): R_c 4 -> 1, R_c 26 -> 3 (round(2.6)); K defaults to
    round(client_fraction * clients) = round(0.5 * 6) = 3, at most all 6 clients; the SHA-wrapped tuners' horizon
    is a survivor's rounds over all stages (3 -> 1 with R_t = 2 * 6 = 12: one stage of 12 // 3 = 4 rounds) and SHA
    builds sha_start members."""
    t = build(generation_rounds=None, population_size=1)
    assert t.T_g == 1 and t.K == 3
    assert build(out="b", generation_rounds=None, population_size=1, rounds_per_member=26).T_g == 3
    t = build(out="c", population_size=1, run_kw={"clients_per_round": None, "client_fraction": 0.5})
    assert t.K == 3 and t.members[0].sim.args.clients_per_round == 3
    t = build(out="d", population_size=1, run_kw={"clients_per_round": None, "client_fraction": 0.01})
    assert t.K == 1
    t = build(out="e", tuner="fedpop_sha", sha_start=3, population_size=2, rounds_per_member=6, generation_rounds=None)
    assert (t.horizon, t.T_g, len(t.members), t.budget) == (4, max(1, round(0.4)), 3, 12)
    t = build(out="f", tuner="sha", sha_start=3, population_size=2, rounds_per_member=6)
    assert (t.horizon, len(t.members)) == (6, 3)
    t = build(out="g", tuner="fedex_sha", sha_start=3, population_size=2, rounds_per_member=6)
    assert (t.horizon, len(t.members)) == (4, 3)


def test_fedex_members_get_their_configurations_in_the_box(build, monkeypatch):
    """FedEx: per member fedex_configs client configurations drawn in beta^0's Delta-box (delta as given) from the
    tuner's generator; theta uniform, no baseline, step 0."""
    drawn = []
    real = ss.sample_ball

    def spy(b0, k, params, rng, delta):
        drawn.append((dict(b0), k, list(params), delta))
        return real(b0, k, params, rng, delta)

    monkeypatch.setattr(ss, "sample_ball", spy)
    t = build(tuner="fedex", fedex_configs=4, delta=0.3)
    for m, d in zip(t.members, drawn):
        assert d == (m.beta0, 4, ["dropout", "local_epochs", "lr"], 0.3)
        assert set(m.fedex) == {"configs", "theta", "baseline", "t"} and len(m.fedex["configs"]) == 4
        assert (m.fedex["theta"], m.fedex["baseline"], m.fedex["t"]) == ([0.25] * 4, None, 0)
        assert all(ss.in_ball(c, m.beta0, t.space.client, 0.3) for c in m.fedex["configs"])
    assert len(drawn) == 2


def test_a_tuner_class_built_directly_records_its_own_name(build):
    """FedEx(...) with tuner arguments naming another tuner (the default, fedpop) runs as FedEx and records "fedex"
    (in the fingerprint, hence results and checkpoint)."""
    from hfpfl.tuning import FedEx

    t = build(cls=FedEx, population_size=1, fedex_configs=2)
    assert type(t) is FedEx and t.t.tuner == "fedex" and t.fingerprint()["tuner"]["tuner"] == "fedex"
    assert len(t.members[0].fedex["configs"]) == 2


def test_the_space_is_fitted_once_with_the_models_dropout_and_method_hparams_are_drawn(build, monkeypatch):
    """fit_method runs at construction (dropout not known yet) and once more with the first member's model (the
    tiny MLP has dropout layers), the run's optimizer and method name; a method: section is drawn per member after
    alpha and beta^0 and applied to its config."""
    calls = []
    real = ss.SearchSpace.fit_method

    def spy(self, algo_cls, cfg, **kw):
        calls.append((algo_cls.name, kw))
        return real(self, algo_cls, cfg, **kw)

    monkeypatch.setattr(ss.SearchSpace, "fit_method", spy)
    space = {**TINY_SPACE, "method": {"mu": {"type": "choice", "values": [0.5, 0.25]}}}
    t = build(method="fedprox", space=space, run_kw={"optimizer": "adam"})
    kw = {"optimizer": "adam", "name": "fedprox"}
    assert calls == [("fedprox+tiny-mlp", {**kw, "has_dropout": None}), ("fedprox+tiny-mlp", {**kw, "has_dropout": True})]
    g = np.random.default_rng([0, 20250])
    for m in t.members:
        g.uniform(), g.uniform(), g.uniform(), g.integers(3), g.uniform()   # alpha (2), beta^0 (3, sorted names)
        assert m.mhp == {"mu": int(g.integers(2))}
        assert m.sim.algorithm.config.mu == (0.5, 0.25)[m.mhp["mu"]]


def test_bad_tuner_arguments_are_refused_with_their_message(build):
    with pytest.raises(ValueError) as e:
        build(tuner="bogus")
    assert str(e.value) == ("--tuner 'bogus' is not one of ('fedpop', 'rs', 'sha', 'fedex', 'fedpop_sha', "
                            "'fedex_sha')")
    with pytest.raises(ValueError, match="population_size"):
        build(population_size=0)
    with pytest.raises(ValueError) as e:   # 9 -> 3 needs 9 + 3 rounds at least; R_t = 2 * 5 = 10
        build(tuner="fedex_sha", sha_start=9, rounds_per_member=5)
    assert str(e.value) == ("--tuner fedex_sha: --sha_start 9 needs 12 rounds through its stages but the budget "
                            "--population_size * --rounds_per_member is 10; raise --rounds_per_member or lower "
                            "--sha_start")
    build(out="ok", tuner="sha", sha_start=9, rounds_per_member=6)   # exactly 12 = R_t: accepted


def test_a_space_refused_at_the_first_member_leaves_nothing_it_created(build, tmp_path, monkeypatch):
    """The first member's fit refuses the space: the output folder this construction created is removed; a folder
    that existed before keeps its files and loses only the members/ folder made now."""
    real = ss.SearchSpace.fit_method

    def refuse_with_model(self, algo_cls, cfg, **kw):
        if kw.get("has_dropout") is not None:
            raise ValueError("refused")
        return real(self, algo_cls, cfg, **kw)

    monkeypatch.setattr(ss.SearchSpace, "fit_method", refuse_with_model)
    with pytest.raises(ValueError, match="refused"):
        build(out="new")
    assert not (tmp_path / "new").exists()
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="refused"):
        build(out="old")
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == ["keep.txt"]
    (tmp_path / "mem" / "members").mkdir(parents=True)   # only the first member's folder is new: it goes
    (tmp_path / "mem" / "members" / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="refused"):
        build(out="mem")
    assert sorted(p.name for p in (tmp_path / "mem" / "members").iterdir()) == ["keep.txt"]


def test_a_failure_after_the_first_member_or_before_anything_is_written(build, tmp_path, monkeypatch):
    """A ValueError building the second member (the space was accepted) keeps what the first member wrote; one
    raised before the first member's engine wrote anything reaches the caller as it is."""
    real = Tuner._install_scorer
    n = []

    def second_fails(self, m):
        n.append(m.idx)
        if m.idx == 1:
            raise ValueError("second member")
        return real(self, m)

    monkeypatch.setattr(Tuner, "_install_scorer", second_fails)
    with pytest.raises(ValueError, match="second member"):
        build(out="two")
    assert (tmp_path / "two" / "members" / "m00").exists()
    monkeypatch.undo()
    import hfpfl.federated.engine as engine

    def early(*a, **k):
        raise ValueError("engine refused")

    monkeypatch.setattr(engine, "Simulation", early)
    with pytest.raises(ValueError, match="engine refused"):
        build(out="none")
    assert not (tmp_path / "none").exists()


def test_without_a_federation_the_tuner_builds_it_from_the_data_arguments_and_seed(build, tiny_fed, monkeypatch):
    import hfpfl.data

    calls = []
    monkeypatch.setattr(hfpfl.data, "build_federated_dataset",
                        lambda da, seed: (calls.append((da, seed)), tiny_fed[1])[1])
    t = build(fed_data=None, population_size=1, run_kw={"seed": 4})
    assert calls == [(tiny_fed[0], 4)] and t.fed_data is tiny_fed[1] and t.members[0].sim.data is tiny_fed[1]


def test_a_tracker_is_made_only_for_report_to(build, monkeypatch, tmp_path):
    """--report_to tensorboard: a second Accelerator logging there, with the tuner's output folder as project dir;
    none: no tracker."""
    import accelerate

    made = []
    real = accelerate.Accelerator

    def spy(*a, **k):
        made.append(k)
        return real(**{kk: v for kk, v in k.items() if kk != "log_with"})

    monkeypatch.setattr(accelerate, "Accelerator", spy)
    t = build(population_size=1, run_kw={"report_to": "tensorboard"})
    assert made[:2] == [{}, {"log_with": "tensorboard", "project_dir": str(tmp_path / "t")}]
    assert t.members[0].sim.args.report_to == "none"   # the members log nothing themselves
    assert t.tracker is not None and t._trackers_started is False
    made.clear()
    assert build(out="n", population_size=1).tracker is None and made[:1] == [{}]
    assert math.isfinite(1.0)
