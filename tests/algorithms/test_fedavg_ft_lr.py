"""FedAvg + FT's ``--finetune_lr_grid``: each client's fine-tuning lr is the grid entry whose fine-tune scores best on
the client's own validation split (accuracy, then lower loss, then the earlier entry), never on test data.

Toy of ``test_baseline_pins.py`` (``pred = c (w . x) + b``, full-batch plain SGD, its docstring works the arithmetic
out): after one round the server holds FEDAVG1 = (w = (0.76, -0.66), c = 1.71, b = 0.57); one fine-tuning epoch is one
full-batch step p(eta) = FEDAVG1 - eta * grad_i(FEDAVG1) on client i's train split. The toy's metric has accuracy 0
throughout, so the validation loss (mean squared error) decides. Grid 0.01, 0.1, 0.3; validation MSE by hand:

    client 0, val = its train points ((1, 0) -> 1, (0, 2) -> 0):   1.5879, 0.3867, 0.8127  -> 0.1
    client 1, val = (1, 1) -> 0, (0, 1) -> 0:                       0.4005, 0.1893, 0.0053  -> 0.3
    new client 2 (train DATA[2]), val = (1, 0) -> 0:                3.1109, 0.9371, 0.0444  -> 0.3
"""
import pytest
import torch
from datasets import Dataset

from hfpfl.algorithms.base import Algorithm
from hfpfl.algorithms.fedavg_ft import FineTuneConfig
from hfpfl.config import RunArguments
from hfpfl.data.federated import ClientData, FederatedData
from hfpfl.federated.engine import Simulation
from test_baseline_pins import DATA, FEDAVG1, LR, PIN, P, close, grads, state  # noqa: F401 (PIN registers the toys)

GRID = "0.01,0.1,0.3"
VAL = [DATA[0], ([[1.0, 1.0], [0.0, 1.0]], [0.0, 0.0]), ([[1.0, 0.0]], [0.0])]


def _ds(xs, ys):
    return Dataset.from_dict({"pixel_values": xs, "labels": ys}).with_format("torch")


def _sim(tmp_path, config, *, val=True, new_clients=0, **kw):
    clients = [ClientData(i, _ds(*DATA[i]), _ds(*DATA[i]), _ds(*VAL[i]) if val else None)
               for i in range(2 + new_clients)]
    fed = FederatedData(clients[:2], clients[2:], _ds(*DATA[0]), None, 1, ["y"], 1, 1)
    run = dict(method="pin_fedavg_ft", num_rounds=20, eval_every=1000, batch_size=8, lr=LR, momentum=0.0,
               progress=False, checkpoint_every=0, overwrite_output_dir=True, output_dir=str(tmp_path / "ft"))
    run.update(kw)
    return Simulation(RunArguments(**run), None, config, fed_data=fed)


def _val_mse(p, client):
    X, Y = (torch.tensor(v, dtype=torch.float64) for v in VAL[client])
    return float(((p["c"] * (X @ p["w"]) + p["b"] - Y) ** 2).mean())


def _step(client, eta):
    g, p = grads(P(FEDAVG1), client), P(FEDAVG1)
    return {k: p[k] - eta * g[k] for k in p}


def test_hand_values_of_the_docstring():
    """The validation MSEs written in the module docstring, from the toy's gradient formulas."""
    for client, expected in ((0, (1.5879, 0.3867, 0.8127)), (1, (0.4005, 0.1893, 0.0053)), (2, (3.1109, 0.9371, 0.0444))):
        got = [_val_mse(_step(client, eta), client) for eta in (0.01, 0.1, 0.3)]
        assert got == pytest.approx(expected, abs=1e-4)


def test_each_client_fine_tunes_at_the_grid_lr_its_validation_split_picks(tmp_path):
    """Client 0 picks 0.1, client 1 picks 0.3 (docstring): the personal model is one SGD step at that lr from
    FEDAVG1 (not at the run's --lr 0.1 for client 1, not at one lr for both)."""
    sim = _sim(tmp_path, FineTuneConfig(finetune_lr_grid=GRID))
    sim.step()
    for client, eta in ((0, 0.1), (1, 0.3)):
        assert sim.algorithm.choose_lr(client, 1, epochs=1, tag="finetune") == eta
        model = sim.algorithm.load_personal(client, sim.server_state, sim.store.get(client), 1)
        close({k: v.detach() for k, v in model.state_dict().items()}, state(_step(client, eta)))


def test_default_fine_tunes_at_the_runs_lr_and_needs_no_validation_split(tmp_path):
    """Grid unset (the default): today's behaviour, one step at --lr 0.1 for every client, no val split needed."""
    assert FineTuneConfig().finetune_lr_grid is None
    sim = _sim(tmp_path, FineTuneConfig(), val=False)
    sim.step()
    for client in (0, 1):
        model = sim.algorithm.load_personal(client, sim.server_state, sim.store.get(client), 1)
        close({k: v.detach() for k, v in model.state_dict().items()}, state(_step(client, LR)))


def test_the_choice_reads_the_validation_split_and_never_the_test_split(tmp_path, monkeypatch):
    """During the choice and the fine-tune, test_data is never called (it raises here); val_data is, for that
    client only."""
    sim = _sim(tmp_path, FineTuneConfig(finetune_lr_grid=GRID))
    sim.step()
    read = []

    def no_test(cid):
        raise AssertionError(f"test split of client {cid} read")
    monkeypatch.setattr(sim, "test_data", no_test)
    real_val = sim.val_data
    monkeypatch.setattr(sim, "val_data", lambda cid: read.append(cid) or real_val(cid))
    sim.algorithm.load_personal(1, sim.server_state, sim.store.get(1), 1)
    assert read == [1]


def test_ranking_is_accuracy_then_loss_then_grid_order(tmp_path, monkeypatch):
    """With validation scores stubbed per lr: the higher accuracy wins over a lower loss; equal accuracy -> the lower
    loss; a full tie -> the earlier grid entry."""
    sim = _sim(tmp_path, FineTuneConfig(finetune_lr_grid=GRID))
    sim.step()
    algo, last = sim.algorithm, []
    real_train = algo.local_train
    monkeypatch.setattr(algo, "local_train", lambda cid, r, hp=None, **kw: last.append(hp.lr) or real_train(cid, r, hp=hp, **kw))
    cases = [({0.01: (0.9, 5.0), 0.1: (0.8, 0.1), 0.3: (0.8, 0.2)}, 0.01),
             ({0.01: (0.5, 2.0), 0.1: (0.8, 1.5), 0.3: (0.8, 0.9)}, 0.3),
             ({0.01: (0.7, 1.0), 0.1: (0.7, 1.0), 0.3: (0.7, 1.0)}, 0.01)]
    for table, expected in cases:
        monkeypatch.setattr(sim.ctx, "evaluate", lambda model, data, t=table: dict(zip(("accuracy", "loss"), t[last[-1]])))
        assert algo.choose_lr(0, 1, epochs=1, tag="finetune") == expected


def test_the_choice_is_deterministic_and_leaves_the_model_as_it_found_it(tmp_path):
    """Two choices from the same loaded model give the same lr, and the model after a choice is the loaded one."""
    sim = _sim(tmp_path, FineTuneConfig(finetune_lr_grid=GRID))
    sim.step()
    algo = sim.algorithm
    Algorithm.load_personal(algo, 1, sim.server_state, sim.store.get(1), 1)   # the global model, not fine-tuned
    before = {k: v.clone() for k, v in algo.model.state_dict().items()}
    assert algo.choose_lr(1, 1, epochs=1, tag="finetune") == algo.choose_lr(1, 1, epochs=1, tag="finetune") == 0.3
    close(algo.model.state_dict(), before, atol=0)


def test_a_new_client_picks_its_lr_on_its_own_validation_split(tmp_path):
    """Held-out client 2 (--new_client_epochs 1) fine-tunes from FEDAVG1 at the lr its val split picks, 0.3
    (not the run's --lr 0.1)."""
    sim = _sim(tmp_path, FineTuneConfig(finetune_lr_grid=GRID), new_clients=1, new_client_epochs=1)
    sim.step()
    model = sim.algorithm.personalize_new_client(2, sim.server_state, sim.train_data(2), 1)
    close({k: v.detach() for k, v in model.state_dict().items()}, state(_step(2, 0.3)))


def test_a_grid_without_a_validation_split_is_refused_before_training(tmp_path):
    with pytest.raises(ValueError, match="--finetune_lr_grid .*--val_fraction"):
        _sim(tmp_path, FineTuneConfig(finetune_lr_grid=GRID), val=False)


@pytest.mark.parametrize("bad", ["0.1,-0.01", "0", "abc", ""])
def test_bad_grids_are_refused(bad):
    with pytest.raises(ValueError, match="--finetune_lr_grid"):
        FineTuneConfig(finetune_lr_grid=bad)


def test_the_command_line_refuses_a_grid_without_val_fraction_in_one_line(tmp_path, capsys):
    """recipes/run.py main(argv): exit code 2, the one stderr line naming --finetune_lr_grid and the fix
    --val_fraction, no --output_dir written (the method refuses it when the run is built, before training)."""
    from hfpfl.cli import run_recipe

    out = tmp_path / "o"
    with pytest.raises(SystemExit) as e:
        run_recipe(argv=["--method", "fedavg_ft", "--finetune_lr_grid", "0.01,0.1", "--output_dir", str(out)],
                   script="recipes/run.py")
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert e.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: --finetune_lr_grid") and "--val_fraction" in lines[0]
    assert not out.exists()


def test_without_a_grid_a_new_client_fine_tunes_at_the_runs_lr(tmp_path):
    """Grid unset: held-out client 2 (--new_client_epochs 1) takes the base protocol's fine-tune, one full-batch step
    at --lr 0.1 from FEDAVG1 on its own train split, and needs no validation split."""
    sim = _sim(tmp_path, FineTuneConfig(), val=False, new_clients=1, new_client_epochs=1)
    sim.step()
    model = sim.algorithm.personalize_new_client(2, sim.server_state, sim.train_data(2), 1)
    close({k: v.detach() for k, v in model.state_dict().items()}, state(_step(2, LR)))


def _spy(algo):
    calls, real = [], algo.local_train

    def spy(cid, r, hp=None, **kw):
        calls.append((cid, r, hp.lr if hp is not None else None, kw))
        return real(cid, r, hp=hp, **kw)
    algo.local_train = spy
    return calls


def test_grid_trials_are_the_final_fine_tune_at_each_lr(tmp_path):
    """--finetune_epochs 2: every grid trial and the kept fine-tune run 2 epochs on the fine-tuning's own stream
    ("finetune"); only the lr differs (0.01, 0.1, 0.3, then the pick). A held-out client (--new_client_epochs 2)
    likewise: every trial and the kept fine-tune train the new-client keys, 2 epochs, on the data it was handed, on the
    "new-client" stream. A trial that differed from the kept fine-tune would score a model the client never keeps."""
    sim = _sim(tmp_path, FineTuneConfig(finetune_lr_grid=GRID, finetune_epochs=2), new_clients=1,
               new_client_epochs=2)
    sim.step()
    algo = sim.algorithm
    calls = _spy(algo)
    algo.load_personal(1, sim.server_state, sim.store.get(1), 1)
    assert [c[2] for c in calls[:3]] == [0.01, 0.1, 0.3] and len(calls) == 4
    assert all(c[:2] == (1, 1) and c[3].get("epochs") == 2 and c[3].get("tag") == "finetune" for c in calls)
    calls.clear()
    data = sim.train_data(2)
    algo.personalize_new_client(2, sim.server_state, data, 1)
    keys = sorted(id(p) for p in algo.trainable_parameters(algo.new_client_keys()))
    assert [c[2] for c in calls[:3]] == [0.01, 0.1, 0.3] and len(calls) == 4
    for cid, r, _, kw in calls:
        assert (cid, r, kw.get("epochs"), kw.get("tag")) == (2, 1, 2, "new-client")
        assert kw.get("data") is data and kw.get("params") is not None
        assert sorted(id(p) for p in kw["params"]) == keys


def test_a_grid_is_refused_when_only_a_new_client_lacks_a_validation_split(tmp_path):
    """The members have their val splits, the held-out client 2 has none: refused before training (it would pick its
    lr on a split it does not have)."""
    clients = [ClientData(i, _ds(*DATA[i]), _ds(*DATA[i]), _ds(*VAL[i]) if i < 2 else None) for i in range(3)]
    fed = FederatedData(clients[:2], clients[2:], _ds(*DATA[0]), None, 1, ["y"], 1, 1)
    run = dict(method="pin_fedavg_ft", num_rounds=1, batch_size=8, lr=LR, momentum=0.0, progress=False,
               checkpoint_every=0, overwrite_output_dir=True, output_dir=str(tmp_path / "ft"), new_client_epochs=1)
    with pytest.raises(ValueError, match="--finetune_lr_grid .*--val_fraction"):
        Simulation(RunArguments(**run), None, FineTuneConfig(finetune_lr_grid=GRID), fed_data=fed)


def test_a_new_client_with_zero_epochs_keeps_the_global_model_under_a_grid(tmp_path):
    """--new_client_epochs 0 with a grid: no choice, no fine-tune -- the held-out client's model is FEDAVG1 itself
    (the engine's loop reads epochs=0 as one epoch, so the method must not call it)."""
    sim = _sim(tmp_path, FineTuneConfig(finetune_lr_grid=GRID), new_clients=1, new_client_epochs=0)
    sim.step()
    model = sim.algorithm.personalize_new_client(2, sim.server_state, sim.train_data(2), 1)
    close({k: v.detach() for k, v in model.state_dict().items()}, state(P(FEDAVG1)))
