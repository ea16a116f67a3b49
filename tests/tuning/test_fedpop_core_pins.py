"""FedPop's population steps pinned by hand without running a simulation (dissertation ch. 4, Algorithm 1 and
Eq. 3-5; FedEx, Khodak et al. 2021): the tuner is built bare (``tuner_class(name).__new__``) around stand-in members whose
simulations are a single tensor, and ``ss.evo`` / ``ss.project_ball`` are replaced by spies where the test pins what
they are called with. Pinned: the annealing schedule, the quantile sets, Eq. 5's weights, the state copy, FedPop-L's
window / eps / p_re / donors, FedPop-G's exploit and explore, FedEx's slot draws and its 2-configuration step, the
population checkpoint's state, fingerprint, atomic save and load."""
import logging
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hfpfl.config import RunArguments
from hfpfl.tuning import FedEx, Member, TunerArguments, tuner_class
from hfpfl.tuning import checkpoint as ck
from hfpfl.tuning import search_space as ss
from hfpfl.tuning.fedpop import clone_state, cos_anneal, eq5_score, eq5_weights, quantile_sets

SPACE = {"server": {"server_lr": {"type": "log10", "low": -1.0, "high": 1.0}},
         "client": {"lr": {"type": "log10", "low": -3.0, "high": -1.0},
                    "local_epochs": {"type": "choice", "values": [1, 2, 3]}}}


class Rng:
    """Known draws: choice(seq) -> its last element (recorded with p), random() -> 0.5."""

    def __init__(self):
        self.calls = []

    def choice(self, seq, p=None):
        self.calls.append((list(seq) if not isinstance(seq, int) else seq, None if p is None else list(p)))
        return (seq - 1) if isinstance(seq, int) else list(seq)[-1]

    def random(self):
        return 0.5

    def uniform(self, a, b):
        return (a + b) / 2

    def integers(self, lo, hi=None):
        return lo


class FakeSim:
    """A member's simulation reduced to one weight tensor (state_dict / load_state_dict count their calls)."""

    def __init__(self, w):
        self.w, self.dumps, self.loaded = torch.tensor([float(w)]), 0, None

    def state_dict(self):
        self.dumps += 1
        return {"w": self.w, "nested": [self.w, (self.w,)]}

    def load_state_dict(self, st):
        self.loaded, self.w = st, st["w"]


def bare(tuner="fedpop", space=SPACE, T_g=2, horizon=12, rng=None, **targs):
    cls = tuner_class(tuner)
    t = cls.__new__(cls)
    t.t = TunerArguments(tuner=tuner, **targs)
    t.space = ss.SearchSpace(space)
    t.T_g, t.horizon, t.R_c = T_g, horizon, horizon
    t.rng = rng or Rng()
    t.members, t.events, t.tried = [], [], set()
    t.round, t.loc_calls, t.rounds_used = 0, 0, 0
    return t


def member(i, w=0.0, hist=(), **kw):
    return Member(i, FakeSim(w), {"server_lr": 0.1 * i}, {"lr": -2.0 - 0.1 * i, "local_epochs": 1}, hist=list(hist),
                  **kw)


# ------------------------------------------------------------------------------------------------ Eq. 3-5 helpers
def test_cos_anneal_values_by_hand():
    """x0/2 (1 + cos(pi r / r0)) before r0, 0 from r0 on."""
    assert cos_anneal(0.4, 0, 8) == pytest.approx(0.4)
    assert cos_anneal(0.4, 2, 8) == pytest.approx(0.2 * (1 + math.sqrt(0.5)))
    assert cos_anneal(0.4, 6, 8) == pytest.approx(0.2 * (1 - math.sqrt(0.5)))
    assert cos_anneal(0.4, 7.9, 8) > 0 and cos_anneal(0.4, 8, 8) == 0.0 and cos_anneal(0.4, 9, 8) == 0.0


def test_quantile_sets_take_ceil_n_over_rho_on_each_side_ties_by_index():
    """7 scores, rho 3: q = 3; lower is better; the bottom (worst) and top (best) sets come back sorted; equal scores
    rank by index (the earlier is the better). rho above n still takes one on each side."""
    s = [0.5, 0.1, 0.9, 0.3, 0.9, 0.2, 0.4]
    assert quantile_sets(s, 3) == ([0, 2, 4], [1, 3, 5])     # by score: 1 5 3 6 0 2 4
    assert quantile_sets(s, 2) == ([0, 2, 4, 6], [1, 3, 5, 6])       # q = ceil(7 / 2) = 4
    assert quantile_sets(s, 10) == ([4], [1])
    assert quantile_sets([1.0, 1.0, 1.0], 3) == ([2], [0])
    assert quantile_sets([2.0, 1.0], 1) == ([0, 1], [0, 1])


def test_eq5_weights_and_score_by_hand():
    """Eq. 5: weights gamma^(t - r), r = 1..t, normalised; the score is their dot product with the last t scores
    (fewer if fewer exist, none: +inf)."""
    assert eq5_weights(3, 0.5) == pytest.approx(np.array([0.25, 0.5, 1.0]) / 1.75)
    assert eq5_weights(1, 0.5) == pytest.approx([1.0])
    assert eq5_score([9.0, 1.0, 2.0, 4.0], 3, 0.5) == pytest.approx((0.25 * 1 + 0.5 * 2 + 4) / 1.75)
    assert eq5_score([2.0, 4.0], 3, 0.5) == pytest.approx((0.5 * 2 + 4) / 1.5)
    assert eq5_score((x for x in [2.0, 4.0]), 2, 0.5) == pytest.approx(10 / 3)
    assert eq5_score([], 3, 0.5) == float("inf") and type(eq5_score([1], 1, 0.5)) is float


def test_clone_state_copies_tensors_and_containers_without_aliasing():
    t = torch.tensor([1.0, 2.0])
    obj = {"a": t, "b": [t, (t, {"c": 3})], "d": np.array([1, 2]), "e": SimpleNamespace(v=[1])}
    c = clone_state(obj)
    assert torch.equal(c["a"], t) and c["a"] is not t and c["b"][0] is not t and c["b"][1][0] is not t
    assert isinstance(c["b"], list) and isinstance(c["b"][1], tuple) and c["b"][1][1] == {"c": 3}
    assert c["d"] is not obj["d"] and c["d"].tolist() == [1, 2]
    t.add_(1.0)
    obj["d"][0] = 9
    obj["e"].v.append(2)   # any other object is copied deeply too
    assert c["e"].v == [1]
    assert c["a"].tolist() == [1.0, 2.0] and c["b"][1][0].tolist() == [1.0, 2.0] and c["d"].tolist() == [1, 2]


def test_local_window_is_ceil_frac_times_T_g_at_least_one_or_off():
    assert bare(T_g=10, local_window_frac=0.2).local_window() == 2
    assert bare(T_g=10, local_window_frac=0.25).local_window() == 3
    assert bare(T_g=10, local_window_frac=0.01).local_window() == 1
    assert bare(T_g=3, local_window_frac=1.0).local_window() == 3
    assert bare(T_g=10, local_window_frac=0.0).local_window() == 0


# ------------------------------------------------------------------------------------------------ FedPop-L
@pytest.fixture
def spies(monkeypatch):
    calls = {"evo": [], "proj": []}

    def evo(h, params, eps, p_re, rng):
        calls["evo"].append((dict(h), list(params), eps, p_re))
        calls.setdefault("rng", []).append(rng)
        return {**h, "evolved": True}

    def proj(beta, beta0, params, delta):
        calls["proj"].append((dict(beta), dict(beta0), list(params), delta))
        return {**beta, "projected": True}

    monkeypatch.setattr(ss, "evo", evo)
    monkeypatch.setattr(ss, "project_ball", proj)
    return calls


def test_fedpop_l_in_its_window_anneals_eps_over_the_window_and_p_re_over_the_horizon(spies):
    """Window = ceil(0.2 * 10) = 2 rounds: at age 2, eps = cos_anneal(0.4, 1, 2) = 0.2; p_re = cos_anneal(0.2, 3,
    12) = 0.1 (1 + cos(pi / 4)). 4 slots, rho 2: the worst two (slots 0, 2) take Evo(the drawn best slot, 3),
    projected into beta^0's box (delta 0.3). Past the window (age 3): nothing changes."""
    t = bare(T_g=10, horizon=12, local_window_frac=0.2, eps0=0.4, p_re0=0.2, rho=2, delta=0.3)
    m = member(0, age=2)
    m.betas = [{"lr": -2.0 - k, "local_epochs": k % 3} for k in range(4)]
    donor = dict(m.betas[3])
    assert t.fedpop_l(m, [5.0, 1.0, 4.0, 0.5], r=3) == [0, 2]
    assert t.rng.calls == [([1, 3], None)] * 2
    p_re = 0.1 * (1 + math.cos(math.pi / 4))
    assert spies["evo"] == [(donor, ["lr", "local_epochs"], pytest.approx(0.2), pytest.approx(p_re))] * 2
    assert spies["proj"] == [({**donor, "evolved": True}, m.beta0, ["lr", "local_epochs"], 0.3)] * 2
    assert m.betas[0] == m.betas[2] == {**donor, "evolved": True, "projected": True}
    assert m.betas[3] == donor and m.betas[1] == {"lr": -3.0, "local_epochs": 1}
    m.age = 3
    before = [dict(b) for b in m.betas]
    assert t.fedpop_l(m, [5.0, 1.0, 4.0, 0.5], r=4) == [] and m.betas == before and len(spies["evo"]) == 2


def test_fedpop_l_every_round_anneals_eps_over_the_horizon_and_needs_two_slots(spies):
    """local_window_frac = 0 (Algorithm 1): eps = cos_anneal(0.4, r, 12) at r = 4: 0.2 (1 + cos(pi / 3)) = 0.3,
    whatever the age; one slot: no quantiles, nothing replaced; two slots, rho 3: one each side."""
    t = bare(T_g=10, horizon=12, local_window_frac=0.0, eps0=0.4, p_re0=0.0, rho=3)
    m = member(0, age=50)
    m.betas = [{"lr": -2.0, "local_epochs": 0}]
    assert t.fedpop_l(m, [1.0], r=4) == [] and spies["evo"] == []
    m.betas = [{"lr": -2.0, "local_epochs": 0}, {"lr": -2.5, "local_epochs": 1}]
    assert t.fedpop_l(m, [1.0, 2.0], r=4) == [1]
    assert spies["evo"] == [({"lr": -2.0, "local_epochs": 0}, ["lr", "local_epochs"], pytest.approx(0.3), 0.0)]
    assert spies["proj"][0][3] == 0.2                       # the default delta
    t = bare(T_g=10, horizon=12, local_window_frac=0.2, eps0=0.4, rho=3)
    m = member(0, age=1)                                     # age 1 = the window's first round: eps = eps0
    m.betas = [{"lr": -2.0, "local_epochs": 0}, {"lr": -2.5, "local_epochs": 1}]
    t.fedpop_l(m, [1.0, 2.0], r=4)
    assert spies["evo"][-1][2] == pytest.approx(0.4)


# ------------------------------------------------------------------------------------------------ FedPop-G
def _population(t):
    # Eq. 5 over T_g = 2 with gamma 0.5: (0.5 s1 + s2) / 1.5
    hists = {0: [1.0, 4.0], 1: [2.0, 1.0], 2: [6.0, 0.0], 3: [0.0, 0.3]}   # 3.0, 4/3, 2.0, 0.2
    t.members = [member(i, w=i, hist=hists[i], stage_hist=[9.0], diverged=(5 if i == 0 else 0)) for i in range(4)]
    t.members.append(member(4, w=4, hist=[100.0, 100.0], alive=False))     # eliminated: never ranked or touched
    t.events = [{"kind": "earlier"}]
    return t.members


def test_fedpop_g_exploits_the_best_and_explores_its_vectors_by_hand(spies):
    """rho 2 over the 4 alive members: the worst two by Eq. 5 (m0 3.0, m2 2.0) take the last of the best two (m3,
    0.2): a copy of its state (one state_dict of the donor, each taker its own tensors) and Evo of its alpha and
    beta^0 with eps = cos_anneal(0.4, 3, 12), p_re = cos_anneal(0.2, 3, 12); their slots, age, stage scores are
    reset and they take the donor's divergence flag; every alive member's T_g history is cleared."""
    t = bare(T_g=2, horizon=12, gamma_g=0.5, rho=2, eps0=0.4, p_re0=0.2)
    ms = _population(t)
    for m in ms:
        m.betas, m.age = [{"lr": 0.0}], 7
    applied = []
    t._apply_method_hparams = applied.append
    src_alpha, src_beta = dict(ms[3].alpha), dict(ms[3].beta0)
    ev = t.fedpop_g(3)
    want = [{"round": 3, "kind": "exploit", "dst": 0, "src": 3, "score_dst": pytest.approx(3.0),
             "score_src": pytest.approx(0.2)},
            {"round": 3, "kind": "exploit", "dst": 2, "src": 3, "score_dst": pytest.approx(2.0),
             "score_src": pytest.approx(0.2)}]
    assert ev == want and t.events == [{"kind": "earlier"}] + want
    assert t.rng.calls == [([1, 3], None)] * 2
    eps, p_re = 0.2 * (1 + math.cos(math.pi / 4)), 0.1 * (1 + math.cos(math.pi / 4))
    assert spies["evo"] == [(src_alpha, ["server_lr"], pytest.approx(eps), pytest.approx(p_re)),
                            (src_beta, ["lr", "local_epochs"], pytest.approx(eps), pytest.approx(p_re))] * 2
    assert ms[3].sim.dumps == 1 and applied == []             # one copy of the donor; no method: section
    for i in (0, 2):
        d = ms[i]
        assert d.sim.w.tolist() == [3.0] and d.sim.w is not ms[3].sim.w
        assert d.sim.loaded["nested"][0] is not ms[3].sim.w and d.sim.loaded["nested"][1][0].tolist() == [3.0]
        assert d.alpha == {**src_alpha, "evolved": True} and d.beta0 == {**src_beta, "evolved": True}
        assert (d.betas, d.age, d.diverged, d.stage_hist) == (None, 0, 0, [])
    assert ms[0].sim.w is not ms[2].sim.w
    for i in (1, 3):
        assert ms[i].sim.loaded is None and ms[i].betas == [{"lr": 0.0}] and ms[i].age == 7
        assert ms[i].stage_hist == [9.0]
    assert ms[3].alpha == src_alpha and ms[3].beta0 == src_beta
    assert [m.hist for m in ms] == [[], [], [], [], [100.0, 100.0]]
    assert ms[4].sim.loaded is None and ms[4].sim.dumps == 0


def test_fedpop_g_evolves_the_method_hparams_and_applies_them(spies):
    """A method: section: the takers' method hyperparameters are Evo of the donor's (same eps and p_re) and then
    applied to their method config."""
    space = {**SPACE, "method": {"mu": {"type": "uniform", "low": 0.0, "high": 1.0}}}
    t = bare(space=space, T_g=2, horizon=12, gamma_g=0.5, rho=2, eps0=0.4, p_re0=0.2)
    ms = _population(t)
    for m in ms:
        m.mhp = {"mu": 0.1 * m.idx, "lr": 0.0}
    applied = []
    t._apply_method_hparams = lambda m: applied.append((m.idx, dict(m.mhp)))
    t.fedpop_g(3)
    mevo = [c for c in spies["evo"] if c[1] == ["mu"]]
    eps, p_re = 0.2 * (1 + math.cos(math.pi / 4)), 0.1 * (1 + math.cos(math.pi / 4))
    assert mevo == [({"mu": pytest.approx(0.3), "lr": 0.0}, ["mu"], pytest.approx(eps), pytest.approx(p_re))] * 2
    assert len(spies["rng"]) == 6 and all(r is t.rng for r in spies["rng"])   # the tuner's generator
    assert applied == [(0, {"mu": pytest.approx(0.3), "lr": 0.0, "evolved": True}),
                       (2, {"mu": pytest.approx(0.3), "lr": 0.0, "evolved": True})]


def test_fedpop_g_skips_a_worst_member_that_draws_itself_and_goes_on(spies):
    """3 members, rho 2: q = 2, so the middle member (m1) is both among the worst and the best. m1 draws itself
    (the stub takes the last of the top set [0, 1]) and keeps its state; m2 still takes m1's."""
    t = bare(T_g=2, horizon=12, gamma_g=0.5, rho=2)
    t.members = [member(0, w=0, hist=[0.1, 0.1]), member(1, w=1, hist=[0.5, 0.5]), member(2, w=2, hist=[0.9, 0.9])]
    ev = t.fedpop_g(2)
    assert [(e["dst"], e["src"]) for e in ev] == [(2, 1)]
    assert t.members[1].sim.loaded is None and t.members[2].sim.w.tolist() == [1.0]


def test_fedpop_g_with_one_member_replaces_nobody(spies):
    """One alive member is both the worst and the best: it is not its own donor; its history is still cleared."""
    t = bare(T_g=2, horizon=12, rho=3)
    t.members = [member(0, hist=[1.0, 2.0])]
    assert t.fedpop_g(2) == [] and spies["evo"] == [] and t.members[0].hist == [] and t.members[0].sim.dumps == 0


# ------------------------------------------------------------------------------------------------ FedEx
def test_fedex_slot_draws_follow_theta_and_fedpop_slots_are_drawn_in_the_box_once(monkeypatch):
    """FedEx: each client draws a configuration index from theta / sum(theta) (recorded as the round's picks);
    FedPop with L: K slot vectors sampled in beta^0's Delta-box (delta given) when there are none or the client count
    changed, then kept; RS / SHA / FedPop without L: beta^0 for every client."""
    t = bare(tuner="fedex")
    m = member(0)
    m.fedex = {"configs": [{"lr": -1.0}, {"lr": -2.0}, {"lr": -3.0}], "theta": [1.0, 1.0, 2.0]}
    assert t.slot_vectors(m, [4, 7]) == [{"lr": -3.0}, {"lr": -3.0}]
    assert t.rng.calls == [(3, [0.25, 0.25, 0.5])] * 2 and m.fedex["picks"] == [2, 2]
    drawn = []

    def sample_ball(b0, k, params, rng, delta):
        drawn.append((dict(b0), k, list(params), delta))
        assert rng is t.rng
        return [{"slot": j} for j in range(k)]

    monkeypatch.setattr(ss, "sample_ball", sample_ball)
    t = bare(tuner="fedpop_sha", delta=0.35)
    m = member(0)
    assert t.slot_vectors(m, [1, 2, 3]) == [{"slot": 0}, {"slot": 1}, {"slot": 2}]
    assert drawn == [(m.beta0, 3, ["lr", "local_epochs"], 0.35)]
    m.betas[1] = {"slot": "kept"}
    assert t.slot_vectors(m, [5, 6, 8])[1] == {"slot": "kept"} and len(drawn) == 1
    assert t.slot_vectors(m, [5, 6]) == [{"slot": 0}, {"slot": 1}] and len(drawn) == 2
    for tuner, kw in (("rs", {}), ("sha", {}), ("fedpop", {"fedpop_l": False})):
        t = bare(tuner=tuner, **kw)
        m = member(0)
        assert t.slot_vectors(m, [1, 2]) == [m.beta0, m.beta0] and m.betas is None
    assert len(drawn) == 2


def test_fedex_with_two_configurations_steps_by_hand():
    """n = 2: eta_t = sqrt(2 ln 2) / sqrt(t). Round 1: theta (1/2, 1/2), picks (0, 1, 1), losses (1, 3, 2); baseline
    = the mean 2: d = (-1, 1, 0), scale 1, g = (-1 / (3 / 2), 1 / (3 / 2)) = (-2/3, 2/3). Round 2: baseline 2,
    pick 0 with loss 2.5: d = 0.5 = scale, g_0 = 0.5 / theta_0."""
    m = SimpleNamespace(fedex={"configs": [{}, {}], "theta": [0.5, 0.5], "baseline": None, "t": 0, "picks": [0, 1, 1]})
    FedEx.fedex_update(None, m, [1.0, 3.0, 2.0])
    eta = math.sqrt(2 * math.log(2))
    w = [0.5 * math.exp(-eta * (-2 / 3)), 0.5 * math.exp(-eta * (2 / 3))]
    th = [x / sum(w) for x in w]
    assert m.fedex["theta"] == pytest.approx(th, rel=1e-12) and m.fedex["baseline"] == 2.0 and m.fedex["t"] == 1
    m.fedex["picks"] = [0]
    FedEx.fedex_update(None, m, [2.5])
    w = [th[0] * math.exp(-eta / math.sqrt(2) * (0.5 / th[0]) / 0.5), th[1]]
    assert m.fedex["theta"] == pytest.approx([x / sum(w) for x in w], rel=1e-12) and m.fedex["baseline"] == 2.5


def test_fedex_keeps_theta_finite_and_floored_when_a_configuration_collapses():
    """A configuration at probability 1e-12 whose slot scored far better than the baseline gets a logit near
    +5.9e11 (= log 1e-12 + sqrt(2 ln 2) * 0.5 / (2e-12) / 0.5): subtracting the largest logit before exp keeps theta
    finite: (1, 1e-12) / (1 + 1e-12). Three configurations, the third (1e-6) scoring 4 above the baseline: its
    logit drops by sqrt(2 ln 3) 4e6, exp underflows to 0 and the floor puts it back at 1e-12 of the normalised
    (1/2, 1/2, 0), which is normalised once more: it sums to 1."""
    m = SimpleNamespace(fedex={"theta": [1e-12, 1 - 1e-12], "baseline": None, "t": 0, "picks": [0, 1]})
    FedEx.fedex_update(None, m, [0.0, 1.0])
    th = m.fedex["theta"]
    assert all(math.isfinite(x) for x in th)
    assert th == pytest.approx([1 / (1 + 1e-12), 1e-12 / (1 + 1e-12)], rel=1e-9, abs=0)
    half = (1 - 1e-6) / 2
    m = SimpleNamespace(fedex={"theta": [half, half, 1e-6], "baseline": 1.0, "t": 0, "picks": [2]})
    FedEx.fedex_update(None, m, [5.0])
    th = m.fedex["theta"]
    assert th[2] == pytest.approx(1e-12 / (1 + 1e-12), rel=1e-9, abs=0)
    assert th[0] == th[1] == pytest.approx(0.5 / (1 + 1e-12), rel=1e-12)
    assert abs(math.fsum(th) - 1.0) < 1e-15


# ------------------------------------------------------------------------------------------------ checkpoint
def _ckpt_tuner(tmp_path, tuner="fedpop", main=True, **run_kw):
    t = bare(tuner=tuner, rng=np.random.default_rng(7), population_size=2, rounds_per_member=6)
    t.run_args = RunArguments(method="fedavg", output_dir=str(tmp_path / "out"), **run_kw)
    t.out = tmp_path / "out"
    t.accelerator = SimpleNamespace(is_main_process=main)
    t.members = [member(0, w=1.0), member(1, w=2.0)]
    return t


def test_member_meta_and_population_state_hold_every_field():
    m = member(3, hist=[1.0], mhp={"mu": 0.5}, betas=[{"lr": -2}], age=4, curve=[(1, 1.0)], trajectory=[{"r": 1}],
               alive=False, diverged=2, rounds=6, fedex={"t": 1}, stage_hist=[0.5])
    m.scores = {1: 0.1}
    assert m.meta() == {"idx": 3, "alpha": m.alpha, "beta0": m.beta0, "mhp": {"mu": 0.5}, "betas": [{"lr": -2}],
                        "age": 4, "hist": [1.0], "curve": [(1, 1.0)], "trajectory": [{"r": 1}], "alive": False,
                        "diverged": 2, "rounds": 6, "fedex": {"t": 1}, "stage_hist": [0.5]}


def test_state_and_fingerprint_by_hand(tmp_path):
    """_state: round, the generator's state, events, tried sorted, the budget counters, each member's meta plus its
    simulation's state, the fingerprint. The fingerprint leaves out what may change on a resume (--resume, the
    output dir, overwrite, progress, threads, trackers) and keeps everything else, and the search space."""
    t = _ckpt_tuner(tmp_path)
    t.round, t.events, t.loc_calls, t.rounds_used = 2, [{"e": 1}], 12, 4
    t.tried = {((("a", 1.0),), (("b", 2.0),)), ((("a", 0.0),), (("b", 2.0),))}
    st = t._state()
    assert set(st) == {"round", "rng", "events", "tried", "loc_calls", "rounds_used", "members", "fingerprint"}
    assert (st["round"], st["events"], st["loc_calls"], st["rounds_used"]) == (2, [{"e": 1}], 12, 4)
    assert st["rng"] == np.random.default_rng(7).bit_generator.state
    assert st["tried"] == [((("a", 0.0),), (("b", 2.0),)), ((("a", 1.0),), (("b", 2.0),))]
    assert st["members"][1] == {**t.members[1].meta(), "sim": {"w": t.members[1].sim.w,
                                                               "nested": [t.members[1].sim.w, (t.members[1].sim.w,)]}}
    fpr = t.fingerprint()
    assert st["fingerprint"] == fpr and set(fpr) == {"tuner", "run", "space"}
    assert "resume" not in fpr["tuner"] and fpr["tuner"]["tuner"] == "fedpop" and fpr["tuner"]["rounds_per_member"] == 6
    for k in ("output_dir", "overwrite_output_dir", "progress", "num_threads", "report_to"):
        assert k not in fpr["run"], k
    assert fpr["run"]["method"] == "fedavg" and fpr["run"]["seed"] == t.run_args.seed
    assert fpr["space"] == t.space.to_dict()
    other = _ckpt_tuner(tmp_path / "x", overwrite_output_dir=True, progress=False, num_threads=3, report_to="none")
    other.t.resume = True
    assert other.fingerprint() == fpr
    assert _ckpt_tuner(tmp_path, seed=5).fingerprint() != fpr


def test_save_is_atomic_and_only_on_the_main_process(tmp_path):
    t = _ckpt_tuner(tmp_path, main=False)
    t.save()
    assert not t.out.exists()
    t = _ckpt_tuner(tmp_path)
    t.out = tmp_path / "deep" / "out"   # its parents are made too
    t.save()
    assert sorted(p.name for p in t.out.iterdir()) == ["population.pt"]
    assert torch.load(t.out / "population.pt", weights_only=False)["members"][0]["sim"]["w"].tolist() == [1.0]
    t.members[0].sim.w = torch.tensor([5.0])
    t.save()
    assert torch.load(t.out / "population.pt", weights_only=False)["members"][0]["sim"]["w"].tolist() == [5.0]


@pytest.mark.parametrize("tuner,unit", [("fedpop", "round"), ("sha", "stage"), ("fedex_sha", "stage")])
def test_load_restores_the_population_and_says_where(tmp_path, caplog, tuner, unit):
    """A saved population loads back into a fresh tuner: counters as ints, events, the generator (the next draw is
    the same), tried as tuples, every member's fields, its simulation's state; scores are reset and the method
    hyperparameters re-applied; one log line names the round (stage under SHA)."""
    a = _ckpt_tuner(tmp_path, tuner=tuner)
    a.round, a.events, a.loc_calls, a.rounds_used = 3, [{"e": 1}], 9, 6
    a.tried = {((("a", 1.0),), (("b", 2.0),))}
    a.members[1].hist, a.members[1].age, a.members[1].mhp = [0.5, 0.25], 5, {"mu": 0.5}
    a.rng.random()
    a.save()
    b = _ckpt_tuner(tmp_path, tuner=tuner)
    b.members[0].scores = {1: 0.3}
    applied = []
    b._apply_method_hparams = lambda m: applied.append((m.idx, dict(m.mhp)))
    with caplog.at_level(logging.INFO, logger="hfpfl"):
        assert b.load() is True
    assert [r.getMessage() for r in caplog.records] == [f"resumed the population at {unit} 3"]
    assert (b.round, b.events, b.loc_calls, b.rounds_used) == (3, [{"e": 1}], 9, 6)
    assert type(b.round) is int and type(b.loc_calls) is int and type(b.rounds_used) is int
    assert b.tried == a.tried and b.rng.random() == a.rng.random()
    for ma, mb in zip(a.members, b.members):
        assert mb.meta() == ma.meta() and mb.scores == {}
        assert mb.sim.w.tolist() == ma.sim.w.tolist() and mb.sim.loaded["w"].tolist() == ma.sim.w.tolist()
    assert applied == [(0, {}), (1, {"mu": 0.5})]


def test_load_without_a_file_and_with_other_settings(tmp_path):
    assert _ckpt_tuner(tmp_path).load() is False
    _ckpt_tuner(tmp_path).save()
    other = _ckpt_tuner(tmp_path, seed=9)
    with pytest.raises(ValueError) as e:
        other.load()
    assert str(e.value) == (f"{tmp_path / 'out' / 'population.pt'}: the saved population was run with other "
                            "settings; use another --output_dir")


def test_tuplify_turns_nested_lists_into_tuples():
    assert ck._tuplify([[["a", 1.0]], [("b", [2.0])]]) == ((("a", 1.0),), (("b", (2.0,)),))
    assert ck._tuplify(3) == 3 and ck._tuplify("ab") == "ab"
