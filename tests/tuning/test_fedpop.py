"""FedPop and its baselines (hfpfl/tuning): CPU-scale checks of the paper's behaviour, the search space file, per-slot
client hyperparameters reaching the engine, the server vector reaching the FedOpt step, FedEx and SHA mechanics,
and resume of the whole population after a kill. Tiny MLP on 8x8 USPS-like digits, a few rounds per member."""
import math

import numpy as np
import pytest
import torch
from scipy import stats

from hfpfl.algorithms import get_algorithm
from hfpfl.algorithms.base import MODEL, weighted_average
from hfpfl.tuning import FedEx, SuccessiveHalving, Tuner, TunerArguments, cos_anneal, eq5_score, eq5_weights, quantile_sets
from hfpfl.tuning import search_space as ss


@pytest.fixture
def make_tuner(tiny_fed, tmp_path):
    from hfpfl.config import RunArguments

    da, fed = tiny_fed

    def _make(method="fedavg", out="t", space=None, **tkw):
        ra = RunArguments(method=method, model="tiny-mlp", output_dir=str(tmp_path / out), clients_per_round=3,
                          progress=False, seed=tkw.pop("seed", 0))
        kw = dict(population_size=3, rounds_per_member=4, generation_rounds=2)
        kw.update(tkw)
        targs = TunerArguments(**kw)
        if space is not None:
            p = tmp_path / f"{out}_space.yaml"
            import yaml
            p.write_text(yaml.safe_dump(space))
            targs.search_space = str(p)
        return Tuner(ra, da, get_algorithm(method).Config(), targs, fed_data=fed)

    return _make


# a space whose runs do not diverge at toy scale (the paper's lr up to 1 with momentum up to 1 often does)
SAFE_SPACE = {
    "server": {"server_lr": {"type": "log10", "low": -0.5, "high": 0.3},
               "server_momentum": {"type": "uniform", "low": 0.0, "high": 0.9},
               "server_lr_decay": {"type": "log10_one_minus", "low": -4, "high": -2}},
    "client": {"lr": {"type": "log10", "low": -2.5, "high": -0.5},
               "momentum": {"type": "uniform", "low": 0.0, "high": 0.9},
               "weight_decay": {"type": "log10", "low": -5, "high": -1},
               "local_epochs": {"type": "choice", "values": [1, 2, 3]},
               "batch_size": {"type": "choice", "values": [8, 16, 32]},
               "dropout": {"type": "uniform", "low": 0.0, "high": 0.5}},
}


# ------------------------------------------------------------------------------------------------ 1. annealing
def test_cos_anneal_endpoints_and_stop():
    assert cos_anneal(0.1, 0, 10) == pytest.approx(0.1)
    assert cos_anneal(0.1, 5, 10) == pytest.approx(0.05)
    assert cos_anneal(0.1, 10, 10) == 0.0 and cos_anneal(0.1, 11, 10) == 0.0
    vals = [cos_anneal(0.1, r, 10) for r in range(11)]
    assert all(a > b for a, b in zip(vals[:10], vals[1:]))  # strictly decreasing until r0


# ------------------------------------------------------------------------------------------------ search space file
def test_search_space_defaults_and_unknown_keys(tmp_path):
    space = ss.SearchSpace()
    assert (space.client["lr"].low, space.client["lr"].high) == (-4.0, 0.0)
    assert (space.server["server_lr"].low, space.server["server_lr"].high) == (-1.0, 1.0)
    assert space.client["batch_size"].values == (8, 16, 32, 64, 128)
    assert space.server["server_lr_decay"].value(-2.0) == pytest.approx(0.99)
    for bad, msg in [({"client": {"learning_rate": {"type": "log10", "low": -3, "high": 0}}}, "unknown"),
                     ({"client": {"lr": {"type": "log10", "low": -3, "high": 0, "step": 1}}}, "unknown key"),
                     ({"clients": {}}, "unknown top-level"),
                     ({"client": {"lr": {"type": "loguniform", "low": -3, "high": 0}}}, "type")]:
        p = tmp_path / "s.yaml"
        import yaml
        p.write_text(yaml.safe_dump(bad))
        with pytest.raises(ValueError, match=msg):
            ss.SearchSpace.from_yaml(p)


# ------------------------------------------------------------------------------------------------ 2. Evo
def test_evo_identity_bounds_and_resampling():
    space = ss.SearchSpace()
    rng = np.random.default_rng(0)
    for params in (space.server, space.client):
        for _ in range(50):
            h = ss.sample(params, rng)
            assert ss.evo(h, params, 0.0, 0.0, rng) == h
            e = ss.evo(h, params, 0.1, 0.0, rng)
            for n, p in params.items():
                if p.continuous:
                    assert abs(e[n] - h[n]) <= 0.1 * p.width + 1e-12 and p.low <= e[n] <= p.high
                else:
                    assert abs(e[n] - h[n]) <= 1 and 0 <= e[n] < len(p.values)
    # p_re = 1: every coordinate is a fresh draw from its distribution (KS against U[a, b]; uniform discrete counts)
    h = {n: p.high if p.continuous else 0 for n, p in space.client.items()}
    draws = [ss.evo(h, space.client, 0.0, 1.0, rng) for _ in range(600)]
    lr = space.client["lr"]
    assert stats.kstest([d["lr"] for d in draws], stats.uniform(loc=lr.low, scale=lr.width).cdf).pvalue > 0.01
    counts = np.bincount([d["batch_size"] for d in draws], minlength=5)
    assert stats.chisquare(counts).pvalue > 0.01
    # a literal floor(delta) would freeze discrete HPs; ours moves them (A7.3)
    moved = {ss.evo({**h, "local_epochs": 2}, space.client, 0.1, 0.0, rng)["local_epochs"] for _ in range(60)}
    assert moved == {1, 2, 3}


# ------------------------------------------------------------------------------------------------ 3. Delta-box
def test_delta_box_sampling():
    space = ss.SearchSpace()
    rng = np.random.default_rng(1)
    seen_edges = set()
    for _ in range(30):
        b0 = ss.sample(space.client, rng)
        for b in ss.sample_ball(b0, 10, space.client, rng):
            for n, p in space.client.items():
                if p.continuous:
                    assert abs(b[n] - b0[n]) <= 0.2 * p.width + 1e-12 and p.low <= b[n] <= p.high
                else:
                    assert abs(b[n] - b0[n]) <= 1 and 0 <= b[n] < len(p.values)
                    seen_edges.add(b[n] - b0[n])
    assert seen_edges == {-1, 0, 1}
    far = {n: (p.high if p.continuous else len(p.values) - 1) for n, p in space.client.items()}
    b0 = {n: (p.low if p.continuous else 0) for n, p in space.client.items()}
    proj = ss.project_ball(far, b0, space.client)
    assert ss.in_ball(proj, b0, space.client) and not ss.in_ball(far, b0, space.client)


# ------------------------------------------------------------------------------------------------ 4. FedPop-L
def test_fedpop_l_replaces_only_the_worst_slots_with_perturbed_best(make_tuner):
    tuner = make_tuner(population_size=1, p_re0=0.0, generation_rounds=10, local_window_frac=0.2)
    m, K = tuner.members[0], 6
    m.betas = ss.sample_ball(m.beta0, K, tuner.space.client, tuner.rng)
    before = [dict(b) for b in m.betas]
    scores = [0.5, 2.0, 0.1, 3.0, 1.0, 0.7]
    m.age = 1
    replaced = tuner.fedpop_l(m, scores, r=1)
    bottom, top = quantile_sets(scores, 3)
    assert sorted(replaced) == bottom == [1, 3] and top == [0, 2] and len(bottom) == math.ceil(K / 3)
    eps = cos_anneal(0.1, 0, tuner.local_window())
    for k in range(K):
        if k not in bottom:
            assert m.betas[k] == before[k]
            continue
        assert m.betas[k] != before[k]
        assert ss.in_ball(m.betas[k], m.beta0, tuner.space.client)
        near = [all(abs(m.betas[k][n] - before[t][n]) <= (eps * p.width + 1e-12 if p.continuous else 1)
                    for n, p in tuner.space.client.items()) for t in top]
        assert any(near)
    # the window: after ceil(0.2 T_g) rounds of a configuration's age FedPop-L stops (appendix)
    m.age = tuner.local_window() + 1
    frozen = [dict(b) for b in m.betas]
    assert tuner.fedpop_l(m, scores, r=5) == [] and m.betas == frozen


def test_slot_vectors_reach_the_engine(make_tuner):
    tuner = make_tuner(population_size=1, rounds_per_member=1, space=SAFE_SPACE)
    m = tuner.members[0]
    seen = {}
    algo = m.sim.algorithm
    orig = algo.client_update

    def spy(cid, down, private, r):
        seen[cid] = algo.ctx.hparams(cid)
        return orig(cid, down, private, r)

    algo.client_update = spy
    tuner._install_scorer(m)  # outermost wrapper scores, the spy records the hyperparameters
    clients = m.sim.sample_clients(1)
    m.betas = ss.sample_ball(m.beta0, len(clients), tuner.space.client, tuner.rng)
    expect = [ss.to_values(b, tuner.space.client) for b in m.betas]
    scores = tuner.member_round(m)
    assert sorted(seen) == clients and len(scores) == len(clients)
    for k, c in enumerate(clients):
        hp = seen[c]
        for n, v in expect[k].items():
            assert getattr(hp, n) == pytest.approx(v), (c, n)
    assert len({seen[c].lr for c in clients}) == len(clients)  # every slot its own vector
    # the score is the validation loss of that client's locally trained model: finite, positive, not all equal
    assert all(s > 0 and np.isfinite(s) for s in scores) and len(set(scores)) == len(scores)


# ------------------------------------------------------------------------------------------------ 5, 6, 9, 10
def test_fedpop_g_exploit_explore_budget_and_tried_vectors(make_tuner, monkeypatch):
    from hfpfl.federated.rounds import RoundRunner

    calls = []
    orig_work = RoundRunner.client_work
    monkeypatch.setattr(RoundRunner, "client_work", lambda self, cid, r, st: calls.append((id(self.sim), r, cid))
                        or orig_work(self, cid, r, st))
    tuner = make_tuner(population_size=4, rounds_per_member=6, generation_rounds=2, space=SAFE_SPACE, p_re0=0.0)
    initial_alpha = [dict(m.alpha) for m in tuner.members]
    firings = []
    orig_g = tuner.fedpop_g

    def spy_g(r):
        before = {m.idx: ({k: v.clone() for k, v in m.sim.server_state[MODEL].items()}, dict(m.alpha),
                          dict(m.beta0), m.sim.state_dict()["store"]) for m in tuner.members}
        events = orig_g(r)
        firings.append(r)
        replaced = {e["dst"]: e["src"] for e in events}
        assert len(replaced) <= math.ceil(4 / 3) * 1 + 1
        eps = cos_anneal(0.1, r, tuner.R_c)
        for m in tuner.members:
            state = m.sim.server_state[MODEL]
            if m.idx in replaced:
                src = replaced[m.idx]
                donor_w, donor_a, donor_b, _ = before[src]
                assert all(torch.equal(state[k], donor_w[k]) for k in donor_w)          # bit-identical copy
                assert any(not torch.equal(state[k], before[m.idx][0][k]) for k in state)
                for n, p in tuner.space.server.items():
                    assert abs(m.alpha[n] - donor_a[n]) <= eps * p.width + 1e-12
                for n, p in tuner.space.client.items():
                    lim = eps * p.width + 1e-12 if p.continuous else 1
                    assert abs(m.beta0[n] - donor_b[n]) <= lim
                assert m.betas is None and m.age == 0 and m.sim.round == tuner.members[src].sim.round
            else:
                assert all(torch.equal(state[k], before[m.idx][0][k]) for k in state)  # untouched
                assert m.alpha == before[m.idx][1]
        return events

    tuner.fedpop_g = spy_g
    res = tuner.run()
    R_c, N_c, K = 6, 4, 3
    assert firings == [2, 4, 6]  # floor(R_c / T_g) firings
    assert any(e["kind"] == "exploit" for e in res["events"])
    # budget: N_c * R_c rounds, N_c * R_c * K local updates, nothing retrained afterwards
    assert len(calls) == N_c * R_c * K and res["budget"]["rounds_used"] == N_c * R_c
    assert all(m.sim.round == R_c for m in tuner.members)
    assert res["best_member"]["member"] in [m.idx for m in tuner.members]
    best = next(m for m in tuner.members if m.idx == res["best_member"]["member"])
    assert res["best_member"]["val_loss"] == pytest.approx(tuner.member_val_loss(best))
    assert res["best_member"]["val_loss"] == min(r["val_loss"] for r in res["members"] if r["alive"])
    # 9: server hyperparameters moved for at least one member
    assert any(m.alpha != a0 for m, a0 in zip(tuner.members, initial_alpha))
    # 10: many more (alpha, beta) vectors than RS's N_c
    assert res["tried"]["pairs"] > N_c and res["tried"]["alpha"] > N_c
    for f in ("results.json", "curves.png", "hparams.png", "population.pt", "config.yaml"):
        assert (tuner.out / f).exists(), f


def test_random_search_keeps_its_vectors(make_tuner):
    tuner = make_tuner(tuner="rs", population_size=3, rounds_per_member=2, space=SAFE_SPACE)
    a0 = [(dict(m.alpha), dict(m.beta0)) for m in tuner.members]
    res = tuner.run()
    assert res["tried"]["pairs"] == 3 and res["events"] == []
    assert [(m.alpha, m.beta0) for m in tuner.members] == a0
    assert res["budget"]["rounds_used"] == 6


# ------------------------------------------------------------------------------------------------ 7. Eq. 5
def test_eq5_power_law_score():
    w = eq5_weights(3, 0.9)
    assert w.sum() == pytest.approx(1.0)
    assert w == pytest.approx(np.array([0.81, 0.9, 1.0]) / 2.71)
    assert eq5_score([2.5, 2.5, 2.5], 3, 0.9) == pytest.approx(2.5)
    assert eq5_score([9.0, 1.0, 2.0, 3.0], 3, 0.9) == pytest.approx((0.81 * 1 + 0.9 * 2 + 1.0 * 3) / 2.71)


# ------------------------------------------------------------------------------------------------ 8. Agg
@pytest.mark.parametrize("server_lr", [1.0, 0.5])
def test_server_vector_reaches_the_fedopt_step(make_tuner, server_lr):
    u = math.log10(server_lr)
    space = {"server": {"server_lr": {"type": "log10", "low": u, "high": u},
                        "server_momentum": {"type": "uniform", "low": 0.0, "high": 0.0},
                        "server_lr_decay": {"type": "uniform", "low": 1.0, "high": 1.0}},
             "client": SAFE_SPACE["client"]}
    tuner = make_tuner(tuner="rs", population_size=1, rounds_per_member=1, space=space)
    m = tuner.members[0]
    m.sim.keep_uploads = True
    m.sim.setup()
    x0 = {k: v.clone() for k, v in m.sim.server_state[MODEL].items()}
    tuner.member_round(m)
    ups = m.sim.last_updates
    mean = weighted_average([u.upload[MODEL] for u in ups], [len(m.sim.ctx.train_data(u.client_id)) for u in ups])
    for k, v in m.sim.server_state[MODEL].items():
        want = x0[k].double() - server_lr * (x0[k].double() - mean[k].double())
        assert torch.allclose(v.double(), want, atol=1e-6), k
    assert any(not torch.allclose(v, x0[k]) for k, v in m.sim.server_state[MODEL].items())


# ------------------------------------------------------------------------------------------------ baselines
def test_fedex_exponentiated_gradient_steps_by_hand():
    """FedEx (Khodak et al. 2021) on 4 configurations, two rounds written out. Round 1: theta = 1/4 each, picks
    (0, 1, 2), losses (0.5, 2, 1), no baseline yet so b = the round's mean 7/6; d = loss - b = (-2/3, 5/6, -1/6),
    gradient g_j = sum over the slots that picked j of d / (K theta_j), K = 3: (-8/9, 10/9, -2/9, 0); step
    eta_1 = sqrt(2 ln 4) / sqrt(1), scaled by max |d| = 5/6: theta_j <- theta_j exp(-eta g_j / (5/6)), normalised.
    Round 2: b = 7/6 (round 1's mean), picks (3, 3, 0), losses (1, 1, 4): d = (-1/6, -1/6, 17/6), scale 17/6,
    eta_2 = sqrt(2 ln 4) / sqrt(2)."""
    from types import SimpleNamespace

    m = SimpleNamespace(fedex={"configs": [{}] * 4, "theta": [0.25] * 4, "baseline": None, "t": 0})
    m.fedex["picks"] = [0, 1, 2]
    FedEx.fedex_update(None, m, [0.5, 2.0, 1.0])
    eta = math.sqrt(2 * math.log(4))
    w = [0.25 * math.exp(-eta * g / (5 / 6)) for g in (-8 / 9, 10 / 9, -2 / 9, 0.0)]
    th1 = [x / sum(w) for x in w]
    assert m.fedex["theta"] == pytest.approx(th1, rel=1e-12)
    assert m.fedex["baseline"] == pytest.approx(7 / 6) and m.fedex["t"] == 1
    assert th1[0] > th1[2] > th1[3] > th1[1]
    m.fedex["picks"] = [3, 3, 0]
    FedEx.fedex_update(None, m, [1.0, 1.0, 4.0])
    g = [(17 / 6) / (3 * th1[0]), 0.0, 0.0, 2 * (-1 / 6) / (3 * th1[3])]
    w = [th1[j] * math.exp(-eta / math.sqrt(2) * g[j] / (17 / 6)) for j in range(4)]
    assert m.fedex["theta"] == pytest.approx([x / sum(w) for x in w], rel=1e-12)
    assert m.fedex["baseline"] == pytest.approx(2.0) and m.fedex["t"] == 2


def test_sha_schedule_27_9_3_within_budget():
    from types import SimpleNamespace

    sched = SuccessiveHalving.sha_schedule(SimpleNamespace(t=TunerArguments(tuner="sha"), budget=120))
    assert [n for n, _ in sched] == [27, 9, 3]
    assert sum(n * r for n, r in sched) <= 120 and sum(n * r for n, r in sched) > 120 - 3
    assert sched[-1][1] > sched[0][1]  # survivors train longer: the budget per stage is about R_t / 3


def test_sha_keeps_the_best_by_each_stages_power_law_score(make_tuner):
    """SHA 9 -> 3 -> 1 on real training: each stage's kept members are the ceil(n / 3) lowest by Eq. 5 over that
    stage's rounds only (weights 0.9^(R - r), written out here from each member's recorded curve), ties by index;
    the budget is within R_t and the survivor is the best member."""
    tuner = make_tuner(tuner="sha", sha_start=9, population_size=2, rounds_per_member=6, space=SAFE_SPACE)
    res = tuner.run()
    assert [n for n, _ in tuner.sha_schedule()] == [9, 3]
    done = {m.idx: 0 for m in tuner.members}  # rounds of each member's curve already read
    for ev in tuner.events:
        per, members = ev["rounds_each"], sorted(ev["kept"] + ev["dropped"])
        score = {}
        for i in members:
            curve = [s for _, s in tuner.members[i].curve[done[i]: done[i] + per]]
            assert len(curve) == per
            w = [0.9 ** (per - r) for r in range(1, per + 1)]
            score[i] = sum(wr * sr for wr, sr in zip(w, curve)) / sum(w)
            done[i] += per
        keep = math.ceil(len(members) / 3)
        assert ev["kept"] == sorted(members, key=lambda i: (score[i], i))[:keep]
    assert [m.idx for m in tuner.members if m.alive] == tuner.events[-1]["kept"]
    assert res["budget"]["rounds_used"] <= 12 and res["best_member"]["alive"]
    assert res["best_member"]["member"] == tuner.events[-1]["kept"][0]


# ------------------------------------------------------------------------------------------------ resume
class _Killed(Exception):
    pass


def _full_killed_resumed(make_tuner, **kw):
    """The uninterrupted run, the run killed right after its first checkpoint, and that run resumed."""
    full = make_tuner(out="full", **kw).run()
    killed = make_tuner(out="resumed", **kw)
    orig_save = killed.save

    def save_then_die():
        orig_save()
        raise _Killed

    killed.save = save_then_die
    with pytest.raises(_Killed):
        killed.run()
    return full, killed, make_tuner(out="resumed", resume=True, **kw).run()


@pytest.mark.slow
def test_resume_after_a_kill_gives_identical_results(make_tuner):
    full, killed, again = _full_killed_resumed(make_tuner, population_size=2, rounds_per_member=4,
                                               generation_rounds=2, space=SAFE_SPACE)
    assert killed.round == 2
    for a, b in zip(full["members"], again["members"]):
        assert a["curve"] == b["curve"] and a["val_loss"] == b["val_loss"] and a["alpha"] == b["alpha"]
    assert full["best_member"]["member"] == again["best_member"]["member"]
    assert full["events"] == again["events"]


@pytest.mark.slow
def test_fedpop_sha_resumed_after_a_stage_gives_identical_results(make_tuner):
    """FedPop wrapped in SHA (4 -> 2 -> 1, T_g = 1) killed right after stage 1's checkpoint and resumed: the same
    eliminations, exploits, curves and best member as the uninterrupted run (the stage counter, the rng and each
    member's FedPop-L state come back from population.pt)."""
    full, killed, again = _full_killed_resumed(make_tuner, tuner="fedpop_sha", sha_start=4, sha_eta=2,
                                               population_size=2, rounds_per_member=4, generation_rounds=1,
                                               space=SAFE_SPACE)
    assert killed.round == 1
    assert [e["kind"] for e in full["events"]] == ["eliminate", "exploit", "eliminate"]
    assert full["events"] == again["events"]
    for a, b in zip(full["members"], again["members"]):
        assert a["curve"] == b["curve"] and a["alpha"] == b["alpha"] and a.get("val_loss") == b.get("val_loss")
    assert full["best_member"]["member"] == again["best_member"]["member"]
    assert again["budget"]["rounds_used"] == full["budget"]["rounds_used"] == 8


# ------------------------------------------------------------------------------------------------ any method
@pytest.mark.parametrize("method", ["fedprox", "ditto"])
def test_exploit_copies_private_client_state_of_any_method(make_tuner, method):
    tuner = make_tuner(method=method, out=method, population_size=2, rounds_per_member=1, generation_rounds=1,
                       space=SAFE_SPACE)
    copies = []
    orig_g = tuner.fedpop_g

    def spy_g(r):
        events = orig_g(r)
        for e in events:
            dst = next(m for m in tuner.members if m.idx == e["dst"]).sim
            src = next(m for m in tuner.members if m.idx == e["src"]).sim
            a, b = dst.store.flatten(), src.store.flatten()
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
            assert all(torch.equal(dst.server_state[p][k], src.server_state[p][k])
                       for p in src.server_state for k in src.server_state[p])
            copies.append((r, len(a)))
        return events

    tuner.fedpop_g = spy_g
    res = tuner.run()
    assert copies and res["method"] == method and res["budget"]["rounds_used"] == 2
    if method == "ditto":
        assert all(n > 0 for _, n in copies)  # personal models travelled with the exploit
