"""How a member's per-round scores become the one score that ranks it (dissertation ch. 4, appendix "Ablation Study on
Score Computation", Table 5): the power-law decay of Eq. 5, the plain average, or the last score; pinned by hand on
known score lists, in FedPop-G's replacement and in SHA's (and the SHA wrapper's) elimination."""
import pytest

from hfpfl.algorithms import get_algorithm
from hfpfl.tuning import Tuner, TunerArguments, eq5_score

SPACE = {"server": {"server_lr": {"type": "log10", "low": -0.5, "high": 0.3}},
         "client": {"lr": {"type": "log10", "low": -2.5, "high": -0.5}}}


@pytest.fixture
def make_tuner(tiny_fed, tmp_path):
    from hfpfl.config import RunArguments

    da, fed = tiny_fed

    def _make(**tkw):
        import yaml

        ra = RunArguments(method="fedavg", model="tiny-mlp", output_dir=str(tmp_path / "t"), clients_per_round=3,
                          progress=False, seed=0)
        p = tmp_path / "space.yaml"
        p.write_text(yaml.safe_dump(SPACE))
        return Tuner(ra, da, get_algorithm("fedavg").Config(), TunerArguments(search_space=str(p), **tkw), fed_data=fed)

    return _make


def test_score_list_power_law_avg_and_last_by_hand():
    """The last T_g = 3 of [3, 1, 2, 5] are [1, 2, 5]: power law (gamma 0.9) (0.81 * 1 + 0.9 * 2 + 5) / 2.71,
    average 8 / 3, last 5; the default is the power law; an empty list ranks last (+inf) under each."""
    hist = [3.0, 1.0, 2.0, 5.0]
    assert eq5_score(hist, 3, 0.9, "power_law") == pytest.approx((0.81 + 1.8 + 5.0) / 2.71, abs=1e-12)
    assert eq5_score(hist, 3, 0.9) == pytest.approx((0.81 + 1.8 + 5.0) / 2.71, abs=1e-12)
    assert eq5_score(hist, 3, 0.9, "avg") == pytest.approx(8.0 / 3.0, abs=1e-12)
    assert eq5_score(hist, 3, 0.9, "last") == 5.0
    assert eq5_score([2.0], 3, 0.9, "avg") == 2.0 and eq5_score([2.0], 3, 0.9, "last") == 2.0
    assert all(eq5_score([], 3, 0.9, how) == float("inf") for how in ("power_law", "avg", "last"))


# three members' last two round scores, gamma_g = 0.5 (weights 0.5, 1 over 1.5):
#   m0 [1.0, 3.0]: avg 2.0,  last 3.0, power law (0.5 + 3) / 1.5    = 2.333
#   m1 [2.2, 2.2]: avg 2.2,  last 2.2, power law                      2.2
#   m2 [2.9, 2.1]: avg 2.5,  last 2.1, power law (1.45 + 2.1) / 1.5 = 2.367
# rho = 3: the worst one takes the best one's state -> (worst, best) = avg (2, 0), last (0, 2), power law (2, 1)
@pytest.mark.parametrize("how,dst,src", [("avg", 2, 0), ("last", 0, 2), ("power_law", 2, 1)])
def test_fedpop_g_replaces_the_worst_by_the_best_under_the_chosen_score(make_tuner, how, dst, src):
    """FedPop-G ranks members by ``--score``: the three score rules pick three different (replaced, donor) pairs
    on the same score lists (hand numbers above)."""
    tuner = make_tuner(population_size=3, rounds_per_member=4, generation_rounds=2, gamma_g=0.5, rho=3, score=how)
    hist = {0: [1.0, 3.0], 1: [2.2, 2.2], 2: [2.9, 2.1]}
    for m in tuner.members:
        m.sim.setup()
        m.hist = list(hist[m.idx])
    events = tuner.fedpop_g(2)
    assert [(e["dst"], e["src"]) for e in events] == [(dst, src)]
    expected = {"avg": {0: 2.0, 1: 2.2, 2: 2.5}, "last": {0: 3.0, 1: 2.2, 2: 2.1},
                "power_law": {0: 3.5 / 1.5, 1: 2.2, 2: 3.55 / 1.5}}[how]
    assert events[0]["score_dst"] == pytest.approx(expected[dst], abs=1e-12)
    assert events[0]["score_src"] == pytest.approx(expected[src], abs=1e-12)


# one SHA stage of three rounds, 3 -> 1, gamma_g = 0.5 (weights 0.25, 0.5, 1 over 1.75):
#   m0 [0.0, 0.0, 1.0]:   avg 0.333, last 1.0,  power law 1 / 1.75                    = 0.571
#   m1 [0.9, 0.9, 0.45]:  avg 0.75,  last 0.45, power law (0.225 + 0.45 + 0.45) / 1.75 = 0.643
#   m2 [0.6, 0.6, 0.5]:   avg 0.567, last 0.5,  power law (0.15 + 0.3 + 0.5) / 1.75   = 0.543
# kept: avg m0, last m1, power law m2
STAGE = {0: [0.0, 0.0, 1.0], 1: [0.9, 0.9, 0.45], 2: [0.6, 0.6, 0.5]}


@pytest.mark.parametrize("tuner_name", ["sha", "fedpop_sha"])
@pytest.mark.parametrize("how,kept", [("avg", 0), ("last", 1), ("power_law", 2)])
def test_sha_elimination_keeps_the_best_under_the_chosen_score(make_tuner, tuner_name, how, kept):
    """SHA and FedPop wrapped in SHA (3 -> 1 in one stage of 3 rounds; T_g = 10, so FedPop-G never fires) keep the
    member whose stage scores are best under ``--score``: three rules, three different survivors (hand numbers
    above)."""
    tuner = make_tuner(tuner=tuner_name, sha_start=3, sha_eta=3, population_size=1, rounds_per_member=9,
                       generation_rounds=10, gamma_g=0.5, score=how)
    assert tuner.sha_schedule() == [(3, 3)]
    tuner.save = lambda: None

    def known_round(m):
        s = STAGE[m.idx][len(m.hist)]
        m.hist.append(s)
        m.rounds += 1
        tuner.rounds_used += 1
        return [s]

    tuner.member_round = known_round
    tuner.run_rounds()
    assert [m.idx for m in tuner.members if m.alive] == [kept]
    assert tuner.events[-1]["kept"] == [kept]


def test_an_unknown_score_is_refused_in_one_line_naming_the_option(tmp_path, capsys):
    """``--score median`` is refused before anything runs: exit 2, one line naming --score and its choices, and no
    output folder."""
    from conftest import load_script

    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        load_script("recipes/fedpop.py", "fedpop_recipe").main(["--score", "median", "--output_dir", str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "--score" in err[0] and "power_law" in err[0] and "median" in err[0]
    assert not out.exists()
