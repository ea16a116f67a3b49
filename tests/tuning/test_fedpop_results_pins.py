"""FedPop's final pick and what a tuning run writes, pinned by hand on stand-in members (no simulation runs): the
sample-weighted validation loss over every client's val split (A7.9: never the test split), the best member's
Loc(beta^0) fine-tuned accuracy (A2.10), the results (rows, the pick, the budget, the distinct vectors tried), the
files, and the two figures' contents (every call to matplotlib recorded)."""
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from hfpfl.algorithms import get_algorithm
from hfpfl.config import RunArguments
from hfpfl.data import DataArguments
from hfpfl.federated.context import NonFiniteError
from hfpfl.federated.evaluation import Evaluator
from hfpfl.federated.state import MODEL
from hfpfl.tuning import Member, TunerArguments, tuner_class
from hfpfl.tuning import results as fp
from hfpfl.tuning import search_space as ss

SPACE = {"server": {"server_lr": {"type": "log10", "low": -1.0, "high": 1.0}},
         "client": {"lr": {"type": "log10", "low": -3.0, "high": -1.0},
                    "local_epochs": {"type": "choice", "values": [1, 2, 3]}},
         "method": {"mu": {"type": "uniform", "low": 0.0, "high": 1.0}}}


def bare(tmp_path, tuner="fedpop", main=True, **targs):
    cls = tuner_class(tuner)
    t = cls.__new__(cls)
    t.t = TunerArguments(tuner=tuner, **targs)
    t.space = ss.SearchSpace(SPACE)
    t.run_args = RunArguments(method="fedprox", output_dir=str(tmp_path / "out"), momentum=0.3, weight_decay=0.01)
    t.data_args, t.method_config = DataArguments(), get_algorithm("fedprox").Config()
    t.out = tmp_path / "out"
    t.accelerator = SimpleNamespace(is_main_process=main)
    t.fed_data = SimpleNamespace(clients=[0, 1, 2])
    t.tracker, t._trackers_started = None, False
    t.members, t.events, t.tried = [], [], set()
    t.R_c, t.T_g, t.K, t.budget, t.rounds_used, t.loc_calls = 6, 2, 3, 24, 20, 60
    return t


class EvalSim:
    """A simulation whose clients' private state, personal models and evaluations are known; it records its calls."""

    def __init__(self, results, store=None):
        self.results, self.calls = results, []
        self.store = SimpleNamespace(get=lambda cid: (store or {}).get(cid))
        self.initial_private, self.server_state, self.round, self.model = "init", "server", 4, "trained-model"
        self._load_memo = None
        self.evaluator = Evaluator(self)  # the engine's one evaluation of personal models, on this stub
        self.args = RunArguments(method="fedprox", momentum=0.3, weight_decay=0.01, local_epochs=5)
        sim = self

        class Ctx:
            def load(self, x):
                sim.calls.append(("load", x))

            def val_data(self, cid):
                return f"val{cid}"

            def test_data(self, cid):
                return f"test{cid}"

            def evaluate(self, model, data):
                sim.calls.append(("evaluate", model, data))
                return sim.results[data]

            def train(self, cid, r, hp, epochs, tag):
                sim.calls.append(("train", cid, r, hp, epochs, tag))

        class Algo:
            def load_personal(self, cid, server_state, private, r):
                sim.calls.append(("personal", cid, server_state, private, r))
                return f"model{cid}"

        self.ctx, self.algorithm = Ctx(), Algo()

    def seed_for(self, r, cid, tag):
        return (r, cid, tag)

    def seed_torch(self, seed):
        self.calls.append(("seed", seed))


# ------------------------------------------------------------------------------------------------ the final scores
def test_member_val_loss_is_the_sample_weighted_mean_over_every_clients_val_split(tmp_path):
    """Losses 1, 2, 4 on 10, 30, 0 samples: (10 + 60 + 0) / 40 = 1.75. Each client's personal model is the engine's
    (seeded for the round and client, its private model part loaded first, the initial one where the client has
    none, then load_personal), evaluated on its val split."""
    t = bare(tmp_path)
    sim = EvalSim({"val0": {"loss": 1.0, "num_samples": 10}, "val1": {"loss": 2.0, "num_samples": 30},
                   "val2": {"loss": 4.0, "num_samples": 0}}, store={0: {MODEL: "p0"}, 2: {"other": 1}})
    assert t.member_val_loss(Member(0, sim, {}, {})) == pytest.approx(1.75)
    assert sim.calls == [("seed", (4, 0, "eval")), ("load", "p0"), ("personal", 0, "server", {MODEL: "p0"}, 4),
                         ("evaluate", "model0", "val0"),
                         ("seed", (4, 1, "eval")), ("load", "init"), ("personal", 1, "server", None, 4),
                         ("evaluate", "model1", "val1"),
                         ("seed", (4, 2, "eval")), ("load", "init"), ("personal", 2, "server", {"other": 1}, 4),
                         ("evaluate", "model2", "val2")]
    sim = EvalSim({f"val{c}": {"loss": 3.0, "num_samples": 0} for c in range(3)})
    assert t.member_val_loss(Member(0, sim, {}, {})) == 0.0      # no validation samples: 0, not a division by 0
    sim = EvalSim({"val0": {"loss": 3.0, "num_samples": 1}, "val1": {"loss": 5.0, "num_samples": 0},
                   "val2": {"loss": 7.0, "num_samples": 0}})
    assert t.member_val_loss(Member(0, sim, {}, {})) == 3.0      # one sample: its loss


def test_finetuned_accuracy_trains_loc_beta0_on_each_client_then_tests(tmp_path):
    """beta^0 = (lr 10^-2, epochs index 2 -> 3) over the run's other client settings (momentum 0.3); each client
    trains final_finetune_epochs = 2 epochs at round + 1 and is evaluated on its test split: mean of 0.5, 0.7, 0.9;
    0 epochs: evaluated without training."""
    t = bare(tmp_path, final_finetune_epochs=2)
    res = {f"test{c}": {"accuracy": a} for c, a in enumerate([0.5, 0.7, 0.9])}
    sim = EvalSim(res, store={1: {MODEL: "p1"}})
    acc = t.finetuned_accuracy(Member(0, sim, {}, {"lr": -2.0, "local_epochs": 2}))
    assert acc == pytest.approx(0.7) and type(acc) is float
    trains = [c for c in sim.calls if c[0] == "train"]
    assert [(c[1], c[2], c[4], c[5]) for c in trains] == [(cid, 5, 2, "fedpop-finetune") for cid in range(3)]
    hp = trains[0][3]
    assert hp.lr == pytest.approx(0.01) and hp.local_epochs == 3 and hp.momentum == 0.3 and hp.weight_decay == 0.01
    assert [c for c in sim.calls if c[0] in ("load", "personal")][:4] == [
        ("load", "init"), ("personal", 0, "server", None, 4), ("load", "p1"), ("personal", 1, "server", {MODEL: "p1"}, 4)]
    assert [c for c in sim.calls if c[0] == "evaluate"] == [("evaluate", "trained-model", f"test{c}") for c in range(3)]
    t = bare(tmp_path, final_finetune_epochs=1)   # the default: one epoch
    sim = EvalSim(res)
    t.finetuned_accuracy(Member(0, sim, {}, {"lr": -2.0, "local_epochs": 0}))
    assert [c[4] for c in sim.calls if c[0] == "train"] == [1, 1, 1]
    t = bare(tmp_path, final_finetune_epochs=0)
    sim = EvalSim(res)
    assert t.finetuned_accuracy(Member(0, sim, {}, {"lr": -2.0, "local_epochs": 0})) == pytest.approx(0.7)
    assert not [c for c in sim.calls if c[0] == "train"]


# ------------------------------------------------------------------------------------------------ finish
class DoneSim:
    def __init__(self, g, p):
        self.g, self.p = g, p

    def finish(self):
        return {"final": {"global_accuracy": self.g, "personal_accuracy": self.p}}


def _members():
    a = {"server_lr": 0.0}
    ms = [Member(0, DoneSim(0.6, 0.7), a, {"lr": -2.0, "local_epochs": 0}, mhp={"mu": 0.5}, rounds=6,
                 curve=[(1, 2.0)]),
          Member(1, DoneSim(0.1, 0.1), {"server_lr": 1.0}, {"lr": -3.0, "local_epochs": 2}, mhp={"mu": 0.1},
                 alive=False, rounds=2, curve=[(1, 9.0)]),
          Member(2, DoneSim(0.1, 0.1), a, {"lr": -1.0, "local_epochs": 1}, mhp={"mu": 0.2}, diverged=3, rounds=6,
                 curve=[(3, 1e6)]),
          Member(3, DoneSim(0.8, None), a, {"lr": -1.0, "local_epochs": 1}, mhp={"mu": 1.0}, rounds=6, curve=[])]
    return ms


def test_finish_picks_the_lowest_val_loss_of_the_healthy_members_and_writes_the_results(tmp_path, monkeypatch):
    """Members: m0 and m3 healthy (val loss 0.5 both: the tie goes to the lower index, m0), m1 eliminated, m2
    diverged in round 3 (both rows carry no val loss and are never picked). The pick gets its fine-tuned accuracy;
    a FedEx member also its most probable client configuration. The budget and the distinct alpha / beta / pairs
    tried are reported; config.yaml, search_space.yaml and results.json are written and the figures drawn."""
    t = bare(tmp_path, tuner="fedex")
    t.out.mkdir()   # save() made it during the run
    t.members = _members()
    t.members[0].fedex = {"theta": [0.1, 0.7, 0.2], "configs": [{"lr": -3.0, "local_epochs": 0},
                                                                {"lr": -1.0, "local_epochs": 2},
                                                                {"lr": -2.0, "local_epochs": 1}]}
    t.events = [{"kind": "exploit", "round": 2, "score_dst": np.float32(0.5)}]   # numpy scalars are written as text
    t.tried = {("a1", "b1"), ("a1", "b2"), ("a2", "b1")}
    t.member_val_loss = lambda m: {0: 0.5, 3: 0.5}[m.idx]
    t.finetuned_accuracy = lambda m: {0: 0.77}[m.idx]
    plots = []
    monkeypatch.setattr(fp, "plot_population", lambda *a, **k: plots.append((a, k)))
    res = t.finish(12.5)
    row0 = {"member": 0, "alive": True, "rounds": 6, "val_loss": 0.5, "global_accuracy": 0.6, "personal_accuracy": 0.7,
            "alpha": {"server_lr": 1.0}, "beta0": {"lr": pytest.approx(0.01), "local_epochs": 1},
            "method": {"mu": 0.5}, "curve": [(1, 2.0)]}
    rows = [row0,
            {"member": 1, "alive": False, "diverged": 0, "rounds": 2, "curve": [(1, 9.0)],
             "alpha": {"server_lr": 10.0}, "beta0": {"lr": pytest.approx(0.001), "local_epochs": 3},
             "method": {"mu": 0.1}},
            {"member": 2, "alive": False, "diverged": 3, "rounds": 6, "curve": [(3, 1e6)],
             "alpha": {"server_lr": 1.0}, "beta0": {"lr": pytest.approx(0.1), "local_epochs": 2},
             "method": {"mu": 0.2}},
            {"member": 3, "alive": True, "rounds": 6, "val_loss": 0.5, "global_accuracy": 0.8,
             "personal_accuracy": None, "alpha": {"server_lr": 1.0}, "beta0": {"lr": pytest.approx(0.1),
                                                                                "local_epochs": 2},
             "method": {"mu": 1.0}, "curve": []}]
    assert res["members"] == rows
    assert res["best_member"] == {**row0, "finetuned_accuracy": 0.77,
                                  "fedex_best_client_config": {"lr": pytest.approx(0.1), "local_epochs": 3}}
    assert res["budget"] == {"R_t": 24, "rounds_used": 20, "loc_calls": 60, "R_c": 6, "T_g": 2, "K": 3, "members": 4,
                             "retraining_rounds": 0}
    assert res["tried"] == {"alpha": 2, "beta": 2, "pairs": 3}
    assert (res["tuner"], res["method"], res["seed"], res["wall_time_s"]) == ("fedex", "fedprox", t.run_args.seed, 12.5)
    assert res["events"] == t.events
    assert set(res) == {"tuner", "method", "seed", "budget", "tried", "best_member", "members", "events",
                        "wall_time_s"}
    text = (t.out / "results.json").read_text()
    assert json.loads(text)["events"] == [{"kind": "exploit", "round": 2, "score_dst": "0.5"}]
    assert json.loads(text)["members"][0]["curve"] == [[1, 2.0]] and json.loads(text)["best_member"]["member"] == 0
    assert text.startswith('{\n  "tuner": "fedex",\n  "method": "fedprox",\n')   # indented by 2 for reading
    assert yaml.safe_load((t.out / "search_space.yaml").read_text()) == t.space.to_dict()
    cfg = (t.out / "config.yaml").read_text()
    assert "tuner: fedex" in cfg and "method: fedprox" in cfg and "mu: " in cfg and "dataset: " in cfg
    assert plots == [((t.out, t.members, t.events), {"title": "fedex on fedprox"})]
    # m3 better: picked; a member without FedEx state has no client configuration
    t.member_val_loss = lambda m: {0: 0.5, 3: 0.4}[m.idx]
    t.finetuned_accuracy = lambda m: {3: 0.1}[m.idx]
    best = t.finish(1.0)["best_member"]
    assert best["member"] == 3 and "fedex_best_client_config" not in best


def test_finish_on_another_process_writes_nothing_and_ends_the_tracker_it_started(tmp_path, monkeypatch):
    t = bare(tmp_path, main=False)
    t.members = _members()[:1]
    t.member_val_loss, t.finetuned_accuracy = (lambda m: 1.0), (lambda m: 0.5)
    plots = []
    monkeypatch.setattr(fp, "plot_population", lambda *a, **k: plots.append(a))
    ended = []
    t.tracker = SimpleNamespace(end_training=lambda: ended.append(1))
    res = t.finish(0.0)
    assert res["best_member"]["member"] == 0 and not t.out.exists() and plots == [] and ended == []
    t._trackers_started = True
    t.finish(0.0)
    assert ended == [1]


def test_finish_when_every_member_diverged_says_so(tmp_path):
    t = bare(tmp_path)
    t.members = [m for m in _members() if m.idx in (1, 2)]
    with pytest.raises(NonFiniteError) as e:
        t.finish(0.0)
    assert str(e.value) == "every member of the population diverged; narrow the search space (lower lr)"
    assert not t.out.exists()


# ------------------------------------------------------------------------------------------------ the figures
class Rec:
    """Records every method call on it as (tag, name, args, kwargs) in a shared log."""

    def __init__(self, tag, log):
        self._tag, self._log = tag, log

    def __getattr__(self, name):
        return lambda *a, **k: self._log.append((self._tag, name, a, k))


@pytest.fixture
def plt_log(monkeypatch):
    import matplotlib.pyplot as plt

    log, figs = [], []

    def subplots(*a, **k):
        n = len(figs)
        fig = Rec(f"fig{n}", log)
        figs.append(fig)
        log.append(("plt", "subplots", a, k))
        if a:   # a grid: rows x cols axes
            axes = SimpleNamespace(flat=[Rec(f"ax{n}.{i}", log) for i in range(a[0] * a[1])])
            return fig, axes
        return fig, Rec(f"ax{n}", log)

    monkeypatch.setattr(plt, "subplots", subplots)
    monkeypatch.setattr(plt, "close", lambda fig: log.append(("plt", "close", (fig._tag,), {})))
    return log


def _traj(r, lr, mu=None):
    t = {"round": r, "alpha": {"server_lr": 1.0 + r}, "beta0": {"lr": lr, "local_epochs": 2}}
    if mu is not None:
        t["method"] = {"mu": mu}
    return t


def test_plot_population_draws_each_members_curve_and_hyperparameters(tmp_path, plt_log):
    """curves.png: one line per member with a curve (label m<idx>), a vertical line per exploit, log y, the legend
    for up to 12 members; hparams.png: one panel per alpha / beta^0 / method name of the first member with a
    trajectory, 3 per row, one line per member with a trajectory, log y for the learning rates, the spare panels
    off."""
    ms = [Member(0, None, {}, {}, curve=[(1, 2.0), (2, 1.0)]), Member(5, None, {}, {}, curve=[]),
          Member(7, None, {}, {}, curve=[(1, 3.0)])]
    ms[1].trajectory = [_traj(1, 0.01, mu=0.5), _traj(2, 0.02, mu=0.25)]
    ms[2].trajectory = [_traj(1, 0.03, mu=0.75)]
    for m in ms[1:]:
        for tr in m.trajectory:
            tr["beta0"]["weight_decay"] = 1e-3 * tr["round"]
    events = [{"kind": "exploit", "round": 2}, {"kind": "eliminate", "stage": 0}, {"round": 5}]
    fp.plot_population(tmp_path, ms, events, title="T")
    want = [("plt", "subplots", (), {"figsize": (7, 4)}),
            ("ax0", "plot", ((1, 2), (2.0, 1.0)), {"label": "m0", "lw": 1}),
            ("ax0", "plot", ((1,), (3.0,)), {"label": "m7", "lw": 1}),
            ("ax0", "axvline", (2,), {"color": "gray", "lw": 0.3}),
            ("ax0", "set_xlabel", ("round",), {}), ("ax0", "set_ylabel", ("mean val loss of local models",), {}),
            ("ax0", "set_yscale", ("log",), {}), ("ax0", "set_title", ("T",), {}),
            ("ax0", "legend", (), {"fontsize": 6}),
            ("fig0", "tight_layout", (), {}), ("fig0", "savefig", (tmp_path / "curves.png",), {"dpi": 110}),
            ("plt", "close", ("fig0",), {}),
            ("plt", "subplots", (2, 3), {"figsize": (12, 2.6 * 2), "squeeze": False})]
    panels = [("alpha", "server_lr", [[2.0, 3.0], [2.0]], True), ("beta0", "lr", [[0.01, 0.02], [0.03]], True),
              ("beta0", "local_epochs", [[2, 2], [2]], False), ("beta0", "weight_decay", [[1e-3, 2e-3], [1e-3]], True),
              ("method", "mu", [[0.5, 0.25], [0.75]], False)]
    for i, (part, k, ys, log_y) in enumerate(panels):
        ax = f"ax1.{i}"
        want += [(ax, "plot", ([1, 2], ys[0]), {"lw": 1}), (ax, "plot", ([1], ys[1]), {"lw": 1}),
                 (ax, "set_title", (f"{part}.{k}",), {"fontsize": 8})]
        if log_y:
            want.append((ax, "set_yscale", ("log",), {}))
    want += [("ax1.5", "axis", ("off",), {}),
             ("fig1", "suptitle", ("T",), {}), ("fig1", "tight_layout", (), {}),
             ("fig1", "savefig", (tmp_path / "hparams.png",), {"dpi": 110}), ("plt", "close", ("fig1",), {})]
    assert plt_log == want


def test_plot_population_of_many_members_without_trajectories_draws_only_the_curves(tmp_path, plt_log):
    """13 members: no legend; no member has a trajectory: no hparams figure. A trajectory without a method part
    gives only the alpha and beta^0 panels (one row)."""
    ms = [Member(i, None, {}, {}, curve=[(1, float(i))]) for i in range(13)]
    fp.plot_population(tmp_path, ms, [], title="")
    assert not [e for e in plt_log if e[1] == "legend"] and [e[1] for e in plt_log[-3:]] == ["tight_layout",
                                                                                             "savefig", "close"]
    assert plt_log[-2][2] == (tmp_path / "curves.png",) and ("ax0", "set_title", ("",), {}) in plt_log
    plt_log.clear()
    ms = [Member(0, None, {}, {}, curve=[(1, 1.0)]) for _ in range(12)]
    ms[3].trajectory = [_traj(1, 0.01)]
    fp.plot_population(tmp_path, ms, [])
    calls = [e[1:] for e in plt_log]
    assert ("legend", (), {"fontsize": 6}) in calls
    assert ("subplots", (1, 3), {"figsize": (12, 2.6), "squeeze": False}) in calls
    assert [e[1] for e in calls if e[0] == "set_title"] == [("",), ("alpha.server_lr",), ("beta0.lr",),
                                                             ("beta0.local_epochs",)]
    assert [e[0] for e in plt_log if e[1] == "plot"][-3:] == ["ax2.0", "ax2.1", "ax2.2"]   # m3's only


def test_plot_population_without_matplotlib_draws_nothing(tmp_path, monkeypatch, plt_log):
    import matplotlib

    def broken(name):
        raise RuntimeError("no backend")

    monkeypatch.setattr(matplotlib, "use", broken)
    fp.plot_population(tmp_path, [Member(0, None, {}, {}, curve=[(1, 1.0)])], [])
    assert plt_log == []


def test_plot_population_writes_the_two_files(tmp_path):
    ms = [Member(0, None, {}, {}, curve=[(1, 2.0), (2, 1.0)])]
    ms[0].trajectory = [_traj(1, 0.01), _traj(2, 0.02)]
    fp.plot_population(tmp_path, ms, [{"kind": "exploit", "round": 2}])
    assert (tmp_path / "curves.png").stat().st_size > 0 and (tmp_path / "hparams.png").stat().st_size > 0
    assert math.isfinite(np.float64(1.0))
