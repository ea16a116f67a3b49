"""FedPop (dissertation ch. 4) pinned by hand computations: Evo (Eq. 3) and the Delta-box with a random source whose
draws are known, FedPop-L / FedPop-G / SHA on known scores (who is replaced, by whom, by exactly how much), and the
server vector's lr, momentum and lr decay through the FedOpt server step over three rounds, written out."""
import math

import pytest
import torch
import torch.nn.functional as F

from hfpfl.algorithms import get_algorithm
from hfpfl.algorithms.base import MODEL
from hfpfl.tuning import FedPopSHA, Tuner, TunerArguments
from hfpfl.tuning import search_space as ss

CLIENT_SPACE = {"lr": {"type": "log10", "low": -2.5, "high": -0.5},
                "momentum": {"type": "uniform", "low": 0.0, "high": 0.9},
                "weight_decay": {"type": "log10", "low": -5, "high": -1},
                "local_epochs": {"type": "choice", "values": [1, 2, 3]},
                "batch_size": {"type": "choice", "values": [8, 16, 32]},
                "dropout": {"type": "uniform", "low": 0.0, "high": 0.5}}
SAFE_SPACE = {"server": {"server_lr": {"type": "log10", "low": -0.5, "high": 0.3},
                         "server_momentum": {"type": "uniform", "low": 0.0, "high": 0.9},
                         "server_lr_decay": {"type": "log10_one_minus", "low": -4, "high": -2}},
              "client": CLIENT_SPACE}


@pytest.fixture
def make_tuner(tiny_fed, tmp_path):
    from hfpfl.config import RunArguments

    da, fed = tiny_fed

    def _make(method="fedavg", out="t", space=SAFE_SPACE, **tkw):
        import yaml

        ra = RunArguments(method=method, model="tiny-mlp", output_dir=str(tmp_path / out), clients_per_round=3,
                          progress=False, seed=0)
        kw = dict(population_size=3, rounds_per_member=4, generation_rounds=2)
        kw.update(tkw)
        p = tmp_path / f"{out}_space.yaml"
        p.write_text(yaml.safe_dump(space))
        return Tuner(ra, da, get_algorithm(method).Config(), TunerArguments(search_space=str(p), **kw), fed_data=fed)

    return _make


class UpperRng:
    """A random source whose draws are known: uniform(a, b) -> b, choice(seq) -> its last element, random() -> r,
    integers(lo, hi) -> hi - 1 (the top of numpy's half-open range)."""

    def __init__(self, r=0.99):
        self.r = r

    def uniform(self, a, b):
        return b

    def choice(self, seq, p=None):
        return list(seq)[-1]

    def random(self):
        return self.r

    def integers(self, lo, hi=None):
        return (lo if hi is None else hi) - 1


# ------------------------------------------------------------------------------------------------ Evo, Delta-box
def test_evo_moves_each_coordinate_by_eps_times_its_range_and_clips():
    """Eq. 3 with every draw at its upper end: a continuous coordinate u becomes min(b, u + eps (b - a)), a discrete
    index moves by one step floor(eps (n - 1)) >= 1 (clipped at the last value); resampling draws from U[a, b]."""
    space = ss.SearchSpace({"client": CLIENT_SPACE})
    h = {"lr": -2.0, "momentum": 0.85, "weight_decay": -3.0, "local_epochs": 0, "batch_size": 2, "dropout": 0.1}
    e = ss.evo(h, space.client, 0.1, 0.0, UpperRng())
    assert e["lr"] == pytest.approx(-2.0 + 0.1 * 2.0)                 # range [-2.5, -0.5]: width 2
    assert e["momentum"] == pytest.approx(0.9)                       # 0.85 + 0.09, clipped to 0.9
    assert e["weight_decay"] == pytest.approx(-3.0 + 0.1 * 4.0)
    assert e["dropout"] == pytest.approx(0.1 + 0.1 * 0.5)
    assert e["local_epochs"] == 1 and e["batch_size"] == 2           # +1 index; the last index stays
    # eps 0.6 on 3 values: step floor(0.6 * 2) = 1; on a 5-value choice floor(0.6 * 4) = 2
    five = ss.SearchSpace({"client": {"local_epochs": {"type": "choice", "values": [1, 2, 3, 4, 5]}}})
    assert ss.evo({"local_epochs": 0}, five.client, 0.6, 0.0, UpperRng())["local_epochs"] == 2
    # p_re: a draw below it resamples the coordinate from its whole distribution (upper end here)
    r = ss.evo(h, space.client, 0.1, 0.5, UpperRng(r=0.2))
    assert r["lr"] == -0.5 and r["momentum"] == 0.9 and r["local_epochs"] == 2 and r["dropout"] == 0.5
    # a draw above p_re perturbs
    assert ss.evo(h, space.client, 0.1, 0.5, UpperRng(r=0.7)) == e


def test_delta_box_bounds_sampling_and_projection_by_hand():
    """The Delta-box of beta^0 (appendix): continuous beta^0 +- 0.2 (b - a) within [a, b], discrete +-1 index."""
    space = ss.SearchSpace({"client": CLIENT_SPACE})
    b0 = {"lr": -2.4, "momentum": 0.5, "weight_decay": -3.0, "local_epochs": 1, "batch_size": 0, "dropout": 0.45}
    top = ss.sample_ball(b0, 1, space.client, UpperRng())[0]
    assert top["lr"] == pytest.approx(-2.4 + 0.4) and top["momentum"] == pytest.approx(0.5 + 0.18)
    assert top["weight_decay"] == pytest.approx(-3.0 + 0.8) and top["dropout"] == pytest.approx(0.5)
    assert top["local_epochs"] == 2 and top["batch_size"] == 1
    assert ss.ball_bounds(space.client["lr"], -2.4) == pytest.approx((-2.5, -2.0))
    assert ss.ball_bounds(space.client["batch_size"], 0) == (0, 1)
    far = {"lr": -0.5, "momentum": 0.0, "weight_decay": -1.0, "local_epochs": 0, "batch_size": 2, "dropout": 0.0}
    proj = ss.project_ball(far, b0, space.client)
    assert proj == pytest.approx({"lr": -2.0, "momentum": 0.5 - 0.18, "weight_decay": -2.2, "local_epochs": 0,
                                  "batch_size": 1, "dropout": 0.45 - 0.1})


# ------------------------------------------------------------------------------------------------ FedPop-L
def test_fedpop_l_on_known_scores_replaces_the_worst_third_by_the_best_perturbed_into_the_box(make_tuner):
    """K = 6 slots, rho = 3: the 2 worst slots (scores 3.0 and 2.0) take Evo(best slot drawn) projected into the
    Delta-box of beta^0; with eps = eps_0 at a configuration's first round, every draw at its upper end and the donor
    the last of the top set (slot 2, score 0.1), each replaced slot is min(box top, donor + eps (b - a))."""
    tuner = make_tuner(population_size=1, p_re0=0.0, generation_rounds=10)
    tuner.rng = UpperRng()
    m = tuner.members[0]
    m.beta0 = {"lr": -1.5, "momentum": 0.4, "weight_decay": -3.0, "local_epochs": 0, "batch_size": 1, "dropout": 0.2}
    m.betas = [dict(m.beta0, lr=-1.5 + 0.05 * k) for k in range(6)]
    # the donor sits near the box's upper edges, so Evo steps out of the box and the projection pulls it back
    m.betas[2] = dict(m.beta0, lr=-1.2, momentum=0.55, local_epochs=1)
    before = [dict(b) for b in m.betas]
    m.age = 1
    replaced = tuner.fedpop_l(m, [0.5, 2.0, 0.1, 3.0, 1.0, 0.7], r=1)
    assert sorted(replaced) == [1, 3]
    # top set {0: 0.5, 2: 0.1}; the stub's choice is the last of the sorted top indices: slot 2
    want = {"lr": -1.1,                  # -1.2 + 0.1 * 2 = -1.0, above the box top -1.5 + 0.2 * 2
            "momentum": 0.58,            # 0.55 + 0.09 = 0.64, above the box top 0.4 + 0.2 * 0.9
            "weight_decay": -2.6,        # -3.0 + 0.1 * 4, inside the box (top -2.2)
            "local_epochs": 1,           # index 1 + 1 = 2, box of index 0 is [0, 1]
            "batch_size": 2, "dropout": 0.25}
    for k in (1, 3):
        assert m.betas[k] == pytest.approx(want)
    for k in (0, 2, 4, 5):
        assert m.betas[k] == before[k]


# ------------------------------------------------------------------------------------------------ FedPop-G
def test_fedpop_g_on_known_scores_exploits_the_best_and_explores_within_eps(make_tuner):
    """Four members with known per-round scores; Eq. 5 (gamma 0.9 over T_g = 2) ranks them by
    (0.9 s_1 + s_2) / 1.9. rho = 3: the ceil(4 / 3) = 2 worst take a copy of a top member's whole state (bit for bit)
    and Evo of its (alpha, beta^0) with eps = eps_0/2 (1 + cos(pi r / R_c)); the best two are untouched."""
    tuner = make_tuner(population_size=4, rounds_per_member=4, generation_rounds=2, p_re0=0.0)
    hist = {0: [0.2, 5.0], 1: [0.3, 0.4], 2: [3.0, 0.3], 3: [0.5, 0.6]}
    # Eq. 5 by hand: m0 (0.18 + 5)/1.9 = 2.726, m1 0.389, m2 (2.7 + 0.3)/1.9 = 1.579, m3 0.568 -> worst m0, m2
    for m in tuner.members:
        m.hist = list(hist[m.idx])
        with torch.no_grad():
            for p in m.sim.model.parameters():
                p.add_(float(m.idx))  # tell the members' weights apart
        m.sim.server_state = {MODEL: {k: v.clone() for k, v in m.sim.model.state_dict().items()}}
    before = {m.idx: (dict(m.alpha), dict(m.beta0), m.sim.state_dict()) for m in tuner.members}
    events = tuner.fedpop_g(2)
    assert sorted(e["dst"] for e in events) == [0, 2] and all(e["src"] in (1, 3) for e in events)
    assert {e["dst"]: e["score_dst"] for e in events} == pytest.approx({0: (0.18 + 5) / 1.9, 2: 3.0 / 1.9})
    eps = 0.1 / 2 * (1 + math.cos(math.pi * 2 / 4))
    assert eps == pytest.approx(0.05)
    for e in events:
        dst = tuner.members[e["dst"]]
        alpha_src, beta_src, state_src = before[e["src"]]
        got = dst.sim.state_dict()["server_state"][MODEL]
        assert all(torch.equal(got[k], v) for k, v in state_src["server_state"][MODEL].items())
        for part, src, params in (("alpha", alpha_src, tuner.space.server), ("beta0", beta_src, tuner.space.client)):
            new = getattr(dst, part)
            for n, p in params.items():
                lim = eps * p.width if p.continuous else 1
                assert abs(new[n] - src[n]) <= lim + 1e-12, (part, n)
            assert new != src  # explored, not a plain copy
        assert dst.betas is None and dst.age == 0
    for idx in (1, 3):
        m = tuner.members[idx]
        assert m.alpha == before[idx][0] and m.beta0 == before[idx][1]
        got = m.sim.state_dict()["server_state"][MODEL]
        assert all(torch.equal(got[k], v) for k, v in before[idx][2]["server_state"][MODEL].items())
    assert all(m.hist == [] for m in tuner.members)


# ------------------------------------------------------------------------------------------------ SHA
def test_sha_keeps_exactly_the_best_third_by_its_stage_scores(make_tuner):
    """SHA (9 -> 3 -> 1; R_t = 60: 3 rounds each in stage 1, 11 in stage 2) on known scores. Stage 1 keeps the three
    lowest by Eq. 5 (weights 0.81, 0.9, 1): member 5 ([1, 0, 0]: 0.81 / 2.71 = 0.299) over member 7 ([0, 0, 0.95]:
    0.95 / 2.71 = 0.351), which a plain mean would rank the other way (0.333 vs 0.317). Stage 2 re-scores only on
    its own rounds: member 5, third after stage 1, is best there and is the one kept. The stage counter (what a
    resume starts from) ends at 2, so running SHA again trains nothing."""
    tuner = make_tuner(tuner="sha", sha_start=9, population_size=2, rounds_per_member=30)
    assert tuner.sha_schedule() == [(9, 3), (3, 11)]
    stage1 = {0: [0.7] * 3, 1: [0.2] * 3, 2: [0.9] * 3, 3: [0.1] * 3, 4: [0.5] * 3, 5: [1.0, 0.0, 0.0],
              6: [0.8] * 3, 7: [0.0, 0.0, 0.95], 8: [0.6] * 3}
    stage2 = {3: 0.4, 1: 0.2, 5: 0.05, 7: 0.3}
    stage = {"n": 0}

    def known_round(m):
        s = stage1[m.idx][len(m.hist)] if stage["n"] == 0 else stage2[m.idx]
        m.hist.append(s)
        m.rounds += 1
        tuner.rounds_used += 1
        return [s]

    tuner.member_round = known_round
    real_save = tuner.save

    def save():
        stage["n"] += 1
        real_save()

    tuner.save = save
    tuner._run_sha()
    assert 0.81 / 2.71 < 0.95 / 2.71 and 1 / 3 > 0.95 / 3
    assert tuner.events[0]["kept"] == [3, 1, 5] and sorted(tuner.events[0]["dropped"]) == [0, 2, 4, 6, 7, 8]
    assert tuner.events[1]["kept"] == [5] and tuner.events[1]["rounds_each"] == 11
    assert [m.idx for m in tuner.members if m.alive] == [5]
    assert all(m.alive is False for m in tuner.members if m.idx != 5)
    assert tuner.rounds_used == 9 * 3 + 3 * 11 <= 60
    # the stage counter is what a resumed run starts from: both stages done, so a resume trains no more rounds
    assert tuner.round == 2 and [(e["stage"], e["kind"]) for e in tuner.events] == [(0, "eliminate"), (1, "eliminate")]
    tuner._run_sha()
    assert tuner.rounds_used == 60 and len(tuner.events) == 2


# ------------------------------------------------------------------------------------------------ SHA wrapper
def test_fedpop_wrapped_in_sha_on_known_scores(make_tuner):
    """FedPop inside SHA (appendix, "FedPop wrapped with SHA"), 9 -> 3 -> 1 over R_t = 60 (stages of 3 and 11
    rounds, so a survivor trains 14), T_g = 2, rho = 3, on known scores and a random source whose draws are known.
    Round 2: FedPop-G over the 9 ranks by Eq. 5 (constant scores: the score itself); the worst third {4, 6, 8} each
    take the weights of the last of the best third {1, 3, 5} (member 5) and an Evo copy of its alpha, the server lr
    coordinate moved up by eps * width with eps = 0.1 / 2 (1 + cos(pi 2 / 14)) -- annealed over the survivor's 14
    rounds, not R_c = 30. Round 3 ends stage 1: member 4 scores 0.05 under its new configuration and is ranked on
    that round alone (its two earlier rounds belonged to the deleted configuration; with them, Eq. 5 gives 0.46 and it
    would be dropped); member 7 (0.4, 0.4, 0.15: Eq. 5 over the stage 0.308) stays behind member 3 (0.2), which
    ranking on round 3 alone would reverse; so SHA keeps {4, 1, 3}. Stage 2 (rounds 4-14): FedPop-G among the 3 survivors at rounds 4, 6,
    8, 10, 12 (member 4, the worst, takes member 3's state each time), not at 14, where SHA keeps member 3 alone."""
    tuner = make_tuner(tuner="fedpop_sha", sha_start=9, population_size=2, rounds_per_member=30, generation_rounds=2,
                       rho=3, eps0=0.1, p_re0=0.1)
    assert tuner.sha_schedule() == [(9, 3), (3, 11)] and tuner.horizon == 14 and len(tuner.members) == 9
    tuner.rng = UpperRng(r=0.99)   # p_re <= 0.1 < 0.99: no resampling
    tuner.save = lambda: None      # (the population checkpoint holds the rng state; not under test here)
    for m in tuner.members:
        m.sim.setup()   # the exploit copies a started simulation's state
        m.alpha = {"server_lr": -0.4, "server_momentum": 0.1, "server_lr_decay": -3.5}
    first = [0.5, 0.1, 0.6, 0.2, 0.7, 0.3, 0.8, 0.4, 0.9]        # rounds 1-2, by member
    third = {**dict(enumerate(first)), 4: 0.05, 7: 0.15}        # round 3: member 4 now holds member 5's weights
    later = {1: 0.2, 3: 0.1, 4: 0.3}                              # stage 2
    calls = {m.idx: 0 for m in tuner.members}

    def known_round(m):
        calls[m.idx] += 1
        r = calls[m.idx]
        s = first[m.idx] if r <= 2 else third[m.idx] if r == 3 else later[m.idx]
        m.hist.append(s)
        m.rounds += 1
        tuner.rounds_used += 1
        return [s]

    tuner.member_round = known_round
    tuner._run_sha_wrapped()
    exploits = [e for e in tuner.events if e["kind"] == "exploit"]
    elim = [e for e in tuner.events if e["kind"] == "eliminate"]
    assert [(e["round"], e["dst"], e["src"]) for e in exploits[:3]] == [(2, 4, 5), (2, 6, 5), (2, 8, 5)]
    assert [(e["round"], e["dst"], e["src"]) for e in exploits[3:]] == [(r, 4, 3) for r in (4, 6, 8, 10, 12)]
    eps = 0.1 / 2 * (1 + math.cos(math.pi * 2 / 14))
    for m in tuner.members:
        if m.idx in (6, 8):
            assert m.alpha["server_lr"] == pytest.approx(-0.4 + 0.8 * eps, abs=1e-12)
    assert elim[0]["kept"] == [4, 1, 3] and sorted(elim[0]["dropped"]) == [0, 2, 5, 6, 7, 8]
    assert (0.81 * 0.7 + 0.9 * 0.7 + 0.05) / 2.71 > 0.4 and 0.2 < (0.81 * 0.4 + 0.9 * 0.4 + 0.15) / 2.71
    assert elim[1]["kept"] == [3] and [m.idx for m in tuner.members if m.alive] == [3]
    assert calls == {0: 3, 1: 14, 2: 3, 3: 14, 4: 14, 5: 3, 6: 3, 7: 3, 8: 3}
    assert tuner.rounds_used == 9 * 3 + 3 * 11 == 60 and tuner.round == 2
    assert [e["rounds_each"] for e in elim] == [3, 11]


def test_fedpop_sha_resumed_after_its_first_stage_trains_only_the_later_stages():
    """4 -> 2 -> 1 (eta 2) over R_t = 16: stages (4 x 2 rounds, 2 x 4 rounds). Resumed with stage 1 done
    (round = 1; members 2 and 3 eliminated): the survivors' round counter starts at 2, so stage 2 trains members 0 and
    1 four rounds each (rounds 3-6), FedPop-G (T_g = 3) fires at round 3 only (6 ends the stage), and SHA keeps the
    lower Eq. 5 score of those four rounds."""
    from types import SimpleNamespace

    t = FedPopSHA.__new__(FedPopSHA)
    t.t = TunerArguments(tuner="fedpop_sha", sha_start=4, sha_eta=2, gamma_g=0.5)
    t.budget, t.T_g, t.round, t.events = 16, 3, 1, []
    t.members = [SimpleNamespace(idx=i, alive=i < 2, hist=[], stage_hist=[9.0]) for i in range(4)]
    assert t.sha_schedule() == [(4, 2), (2, 4)]
    trained, fired = [], []

    def member_round(m):
        trained.append(m.idx)
        m.hist.append(1.0 + m.idx)

    t.member_round, t.fedpop_g, t.save = member_round, fired.append, (lambda: None)
    t._run_sha_wrapped()
    assert trained == [0, 1] * 4 and fired == [3]
    assert t.events == [{"stage": 1, "kind": "eliminate", "kept": [0], "dropped": [1], "rounds_each": 4}]
    assert t.round == 2 and [m.alive for m in t.members] == [True, False, False, False]


def test_fedex_wrapped_in_sha_runs_fedex_in_every_member_and_eliminates_by_stage_scores(make_tuner):
    """FedEx inside SHA, 4 -> 2 -> 1 (eta 2) over R_t = 8: stage 1 trains the 4 members 1 round, stage 2 the best 2
    for 2 rounds. Every member draws its clients' vectors from its own 3 FedEx configurations and runs one
    exponentiated-gradient step per round it trains; each stage keeps the lowest Eq. 5 score of its own rounds
    (recomputed here from the recorded per-round scores)."""
    tuner = make_tuner(tuner="fedex_sha", sha_start=4, sha_eta=2, population_size=2, rounds_per_member=4,
                       fedex_configs=3)
    assert tuner.sha_schedule() == [(4, 1), (2, 2)] and len(tuner.members) == 4
    res = tuner.run()
    for m in tuner.members:
        assert len(m.fedex["configs"]) == 3 and m.fedex["t"] == m.rounds
        assert all(0 <= j < 3 for j in m.fedex["picks"])
    s1 = {m.idx: m.curve[0][1] for m in tuner.members}
    kept1 = sorted(s1, key=lambda i: (s1[i], i))[:2]
    elim = [e for e in res["events"] if e["kind"] == "eliminate"]
    assert elim[0]["kept"] == kept1
    s2 = {i: (0.9 * tuner.members[i].curve[1][1] + tuner.members[i].curve[2][1]) / 1.9 for i in kept1}
    assert elim[1]["kept"] == [min(kept1, key=lambda i: (s2[i], kept1.index(i)))]
    assert res["tuner"] == "fedex_sha" and res["budget"]["rounds_used"] == 4 + 2 * 2
    assert [m.rounds for m in tuner.members] == [3 if m.idx in kept1 else 1 for m in tuner.members]


def test_fedpop_wrapped_in_sha_trains_end_to_end(make_tuner):
    """A real FedPop+SHA run (4 -> 2 -> 1, T_g = 1): stage 1 is one round (its last: SHA eliminates, no FedPop-G),
    stage 2 rounds 2-3: FedPop-G between the two survivors after round 2 only; FedPop-L after each of the 8 member
    rounds, over slot vectors drawn in each member's Delta-box; the best member is the survivor."""
    tuner = make_tuner(tuner="fedpop_sha", sha_start=4, sha_eta=2, population_size=2, rounds_per_member=4,
                       generation_rounds=1, local_window_frac=0)
    calls = []
    real_l = tuner.fedpop_l

    def spy_l(m, scores, r):
        calls.append((m.idx, r))
        return real_l(m, scores, r)

    tuner.fedpop_l = spy_l
    res = tuner.run()
    assert len(calls) == 8
    for m in tuner.members:
        assert len(m.betas) == 3 and all(ss.in_ball(b, m.beta0, tuner.space.client, 0.2) for b in m.betas)
    kinds = [(e["kind"], e.get("round", e.get("stage"))) for e in res["events"]]
    assert kinds == [("eliminate", 0), ("exploit", 2), ("eliminate", 1)]
    survivor = res["events"][-1]["kept"][0]
    assert res["best_member"]["member"] == survivor and res["budget"]["rounds_used"] == 8


# ------------------------------------------------------------------------------------------------ server step
def _fixed_server_space(lr, momentum, decay):
    u = math.log10(lr)
    return {"server": {"server_lr": {"type": "log10", "low": u, "high": u},
                       "server_momentum": {"type": "uniform", "low": momentum, "high": momentum},
                       "server_lr_decay": {"type": "uniform", "low": decay, "high": decay}},
            "client": CLIENT_SPACE}


def _three_rounds(tuner, momenta=None):
    """Run three member rounds; return per round the server model before it and the uploads' weighted mean."""
    m = tuner.members[0]
    m.sim.keep_uploads = True
    m.sim.setup()
    rounds = []
    for r in range(3):
        if momenta is not None:
            m.alpha = dict(m.alpha, server_momentum=momenta[r])
        x = {k: v.clone().double() for k, v in m.sim.server_state[MODEL].items()}
        tuner.member_round(m)
        ups = m.sim.last_updates
        n = [float(len(m.sim.ctx.train_data(u.client_id))) for u in ups]
        mean = {k: sum(w * u.upload[MODEL][k].double() for w, u in zip(n, ups)) / sum(n) for k in x}
        rounds.append((x, mean))
    return m, rounds


def test_server_lr_momentum_and_decay_reach_the_fedopt_step_over_three_rounds(make_tuner):
    """alpha = (lr 0.5, momentum 0.5, decay 0.8) from the member's search space, through sim.step: with
    d_t = x_t - mean(uploads_t), m_t = 0.5 m_{t-1} + d_t (m_1 = d_1) and lr_t = 0.5 * 0.8^(t-1),
    x_{t+1} = x_t - lr_t m_t -- FedOpt (Reddi et al. 2021) with torch SGD's momentum buffer and an exponential lr
    decay stepped after each round, as FedEx's server (which FedPop's search space follows; ch. 4 gives no formula).
    Dropping the momentum, the decay or shifting the decay by a round each changes the result."""
    tuner = make_tuner(tuner="rs", population_size=1, rounds_per_member=3, space=_fixed_server_space(0.5, 0.5, 0.8))
    m, rounds = _three_rounds(tuner)
    mom = None
    for t, (x, mean) in enumerate(rounds, start=1):
        d = {k: x[k] - mean[k] for k in x}
        mom = d if mom is None else {k: 0.5 * mom[k] + d[k] for k in x}
        want = {k: x[k] - 0.5 * 0.8 ** (t - 1) * mom[k] for k in x}
        got = rounds[t][0] if t < 3 else {k: v.double() for k, v in m.sim.server_state[MODEL].items()}
        for k in x:
            assert torch.allclose(got[k], want[k], rtol=0, atol=1e-6), (t, k)
    # the three rounds moved the model by more than float noise, so the above distinguishes the variants
    x3 = rounds[2][0]
    assert any((x3[k] - rounds[0][0][k]).abs().max() > 1e-3 for k in x3)


def test_a_round_with_momentum_zero_leaves_no_stale_buffer(make_tuner):
    """FedPop's Evo can move a member's server momentum to 0 and back. m_t = beta_t m_{t-1} + d_t holds every round,
    so after a beta = 0 round the buffer is that round's d_t: momenta (0.5, 0, 0.5) give m_3 = 0.5 d_2 + d_3, not
    0.5 d_1 + d_3 (the buffer of round 1, left stale by round 2)."""
    tuner = make_tuner(tuner="rs", population_size=1, rounds_per_member=3, space=_fixed_server_space(0.5, 0.5, 1.0))
    m, rounds = _three_rounds(tuner, momenta=[0.5, 0.0, 0.5])
    (x1, mean1), (x2, mean2), (x3, mean3) = rounds
    d2 = {k: x2[k] - mean2[k] for k in x2}
    assert all(torch.allclose(x2[k], x1[k] - 0.5 * (x1[k] - mean1[k]), atol=1e-6) for k in x1)
    assert all(torch.allclose(x3[k], x2[k] - 0.5 * d2[k], atol=1e-6) for k in x2)
    got = {k: v.double() for k, v in m.sim.server_state[MODEL].items()}
    for k in x3:
        want = x3[k] - 0.5 * (0.5 * d2[k] + (x3[k] - mean3[k]))
        assert torch.allclose(got[k], want, rtol=0, atol=1e-6), k


# ------------------------------------------------------------------------------------------------ scores
def test_ditto_member_is_scored_on_its_uploaded_local_model_not_the_personal_one(make_tuner):
    """A2.1: a member's per-round score is the validation loss of each locally trained model w^k, the model the
    client uploads. Ditto trains a personal model after w^k; the score must be w^k's mean cross-entropy on the
    client's val split (recomputed here from the upload), which differs from the personal model's."""
    import copy

    tuner = make_tuner(method="ditto", out="ditto", tuner="rs", population_size=1, rounds_per_member=1)
    m = tuner.members[0]
    m.sim.keep_uploads = True
    scores = tuner.member_round(m)
    clients = [u.client_id for u in m.sim.last_updates]
    assert clients == sorted(clients) and len(scores) == len(clients)
    net = copy.deepcopy(m.sim.model).eval()
    for s, u in zip(scores, m.sim.last_updates):
        val = m.sim.ctx.val_data(u.client_id)
        with torch.no_grad():
            net.load_state_dict(u.upload[MODEL], strict=False)
            uploaded = F.cross_entropy(net(val.pixel_values).logits, val.labels).item()
            net.load_state_dict(m.sim.store.get(u.client_id)["personal"], strict=False)
            personal = F.cross_entropy(net(val.pixel_values).logits, val.labels).item()
        assert s == pytest.approx(uploaded, rel=1e-5, abs=1e-6)
        assert abs(uploaded - personal) > 1e-4


# ------------------------------------------------------------------------------------------------ baselines' entry points
@pytest.mark.parametrize("fn,tuner", [("random_search", "rs"), ("successive_halving", "sha"), ("fedex", "fedex"),
                                      ("fedpop", "fedpop"), ("fedpop_sha", "fedpop_sha"), ("fedex_sha", "fedex_sha")])
def test_baseline_entry_points_run_the_driver_with_their_tuner(monkeypatch, fn, tuner):
    """Each entry point runs the one driver with its tuner name, keeping every other tuner argument given (or the
    defaults), passing the run / data / method arguments and keywords through, and returns run()'s results."""
    from hfpfl.tuning import baselines

    made = []

    class FakeTuner:
        def __init__(self, run_args, data_args, method_config, targs, **kw):
            made.append((run_args, data_args, method_config, targs, kw))

        def run(self):
            return {"ran": len(made)}

    monkeypatch.setattr(baselines, "Tuner", FakeTuner)
    given = TunerArguments(tuner="fedpop", population_size=2, rounds_per_member=5)
    assert getattr(baselines, fn)("R", "D", "M", given, fed_data="F") == {"ran": 1}
    run_args, data_args, method_config, targs, kw = made[0]
    assert (run_args, data_args, method_config, kw) == ("R", "D", "M", {"fed_data": "F"})
    assert targs.tuner == tuner and (targs.population_size, targs.rounds_per_member) == (2, 5)
    assert given.tuner == "fedpop"  # the caller's arguments are not modified
    getattr(baselines, fn)("R", "D", "M")
    assert made[1][3] == TunerArguments(tuner=tuner)


# ------------------------------------------------------------------------------------------------ search-space maps
def test_coordinate_inverts_value_for_each_kind_by_hand():
    """Sampling-space coordinates: uniform v -> v, log10 0.01 -> -2, log10_one_minus 0.999 -> log10(0.001) = -3,
    choice 16 of (8, 16, 32) -> index 1; value() maps each back."""
    space = ss.SearchSpace(SAFE_SPACE)
    cases = [(space.server["server_momentum"], 0.3, 0.3), (space.client["lr"], 0.01, -2.0),
             (space.server["server_lr_decay"], 0.999, -3.0), (space.client["batch_size"], 16, 1)]
    for p, v, u in cases:
        assert p.coordinate(v) == pytest.approx(u, abs=1e-12) and type(p.coordinate(v)) is type(u), p.name
        assert p.value(u) == pytest.approx(v, abs=1e-12), p.name
    assert space.params("server") is space.server and space.params("client") is space.client
    assert space.params("method") is space.method


# ------------------------------------------------------------------------------------------------ population checkpoint
def test_population_checkpoint_restores_the_tuner_and_refuses_other_settings(make_tuner):
    """save() then load() in a fresh tuner on the same output_dir gives back the round, events, random state (the
    next draw is the same), the tried vectors, the budget counters, each member's vectors / history and its
    simulation's server model; a tuner with other settings refuses the file; no file: load() is False."""
    a = make_tuner(out="ckpt", tuner="fedpop", population_size=2, rounds_per_member=2, generation_rounds=1)
    assert a.load() is False
    for m in a.members:
        a.member_round(m)
    a.round = 1
    a.events.append({"round": 1, "kind": "exploit", "dst": 1, "src": 0})
    a.save()
    b = make_tuner(out="ckpt", tuner="fedpop", population_size=2, rounds_per_member=2, generation_rounds=1)
    assert b.load() is True
    assert (b.round, b.events, b.tried, b.loc_calls, b.rounds_used) == (1, a.events, a.tried, a.loc_calls,
                                                                          a.rounds_used)
    assert all(isinstance(t, tuple) for t in b.tried) and b.rounds_used == 2 and b.loc_calls == 6
    for ma, mb in zip(a.members, b.members):
        for k in ("alpha", "beta0", "betas", "age", "hist", "curve", "rounds", "diverged", "alive"):
            assert getattr(mb, k) == getattr(ma, k), k
        assert mb.scores == {} and mb.sim.round == ma.sim.round == 1
        for k, v in ma.sim.server_state[MODEL].items():
            assert torch.equal(mb.sim.server_state[MODEL][k], v), k
    assert b.rng.random() == a.rng.random()
    c = make_tuner(out="ckpt", tuner="fedpop", population_size=2, rounds_per_member=3, generation_rounds=1)
    with pytest.raises(ValueError, match="population.pt: the saved population was run with other settings"):
        c.load()


def test_in_ball_is_the_closed_delta_box():
    """beta0 = 0.5 on [0, 1] (uniform) with the default delta 0.2: the box is [0.3, 0.7], closed up to 1e-12 slack
    on both sides; delta 0.1 narrows it to [0.4, 0.6]."""
    p = {"m": ss.Param("m", "uniform", 0.0, 1.0)}
    lo, hi = 0.5 - 0.2 * 1.0, 0.5 + 0.2 * 1.0
    c = {"m": 0.5}
    assert ss.in_ball({"m": lo - 1e-12}, c, p) and ss.in_ball({"m": hi + 1e-12}, c, p)
    assert not ss.in_ball({"m": lo - 1e-9}, c, p) and not ss.in_ball({"m": hi + 1e-9}, c, p)
    assert ss.in_ball({"m": 0.65}, c, p) and not ss.in_ball({"m": 0.65}, c, p, delta=0.1)
    assert ss.in_ball({"m": 0.6}, c, p, delta=0.1) and not ss.in_ball({"m": 0.25}, c, p)


def test_method_values_apply_the_members_value_and_run_the_configs_checks():
    """method: {mu: choice (0.5, -1)}: index 0 gives a new FedProx config with mu 0.5 (the given one untouched);
    index 1 gives mu = -1, which FedProx's own check (mu >= 0) refuses."""
    cfg = get_algorithm("fedprox").Config()
    space = ss.SearchSpace({"method": {"mu": {"type": "choice", "values": [0.5, -1.0]}}})
    new = space.method_values({"mu": 0}, cfg)
    assert new.mu == 0.5 and cfg.mu == 0.01 and new is not cfg
    with pytest.raises(ValueError, match="mu"):
        space.method_values({"mu": 1}, cfg)
    assert ss.SearchSpace(SAFE_SPACE).method_values({}, cfg) is cfg
