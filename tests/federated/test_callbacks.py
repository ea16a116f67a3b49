"""Callbacks around a simulation's rounds, on a 4-number model with known weights and hand-made data.

The model: ``pred = c * (w . x) + b`` with ``w = body.weight`` (2 numbers), ``c = classifier.weight``, ``b =
classifier.bias``; loss ``1/2 mean (pred - y)^2``; gradient (``r = pred - y``, ``h = w . x``): ``dL/db = mean r``,
``dL/dc = mean r h``, ``dL/dw = mean r c x``. Start ``w = (1, -1), c = 2, b = 0.5``; client 0 holds ``x = (1, 0),
(0, 2)``, ``y = 1, 0``; client 1 holds ``x = (2, 1), (1, 1), (0, 1)``, ``y = 0, 1, 2``. One full-batch SGD step at
lr 0.1, by hand:

    client 0: h = (1, -2), pred = (2.5, -3.5), r = (1.5, -3.5), loss 1/2 (2.25 + 12.25) / 2 = 3.625
              grad b = -1, c = 4.25, w = (1.5, -7)   -> w = (0.85, -0.3), c = 1.575, b = 0.6
    client 1: h = (1, 0, -1), pred = (2.5, 0.5, -1.5), r = (2.5, -0.5, -3.5), loss 1/2 (6.25 + 0.25 + 12.25) / 3
              = 3.125;  grad b = -0.5, c = 2, w = (3, -1)   -> w = (0.7, -0.9), c = 1.8, b = 0.55
    the round's train loss, sample-weighted (2 : 3): (2 * 3.625 + 3 * 3.125) / 5 = 3.325
"""
import json
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from hfpfl.algorithms import register
from hfpfl.algorithms.fedavg import FedAvg
from hfpfl.config import RunArguments
from hfpfl.data.federated import ClientData, FederatedData
from hfpfl.federated import vectorized
from hfpfl.federated.callbacks import Callback, Checkpoints, MetricsFile, default_callbacks
from hfpfl.federated.engine import Simulation
from hfpfl.federated.evaluation import personal_models
from hfpfl.federated.state import MODEL
from toy_problem import SquaredError, Toy

KEYS = ("body.weight", "classifier.weight", "classifier.bias")
STEP = {0: [0.85, -0.3, 1.575, 0.6], 1: [0.7, -0.9, 1.8, 0.55]}    # (w, c, b) after one step, by hand


@register
class CallbackToy(FedAvg):
    name = "test_callback_toy"

    def build_model(self):
        return Toy()

    def metric(self):
        return SquaredError()


def _ds(xs, ys):
    return Dataset.from_dict({"pixel_values": xs, "labels": ys}).with_format("torch")


def _sim(tmp_path, callbacks=None, with_val=False, **kw):
    data = [([[1.0, 0.0], [0.0, 2.0]], [1.0, 0.0]), ([[2.0, 1.0], [1.0, 1.0], [0.0, 1.0]], [0.0, 1.0, 2.0])]
    clients = [ClientData(i, _ds(*d), _ds(*d), _ds(*d) if with_val else None) for i, d in enumerate(data)]
    fed = FederatedData(clients, [], _ds(*data[0]), None, 1, ["y"], 1, 1)
    run = dict(method="test_callback_toy", num_rounds=1, batch_size=8, lr=0.1, momentum=0.0, progress=False,
               checkpoint_every=0, overwrite_output_dir=True, output_dir=str(tmp_path / "run"))
    run.update(kw)
    return Simulation(RunArguments(**run), None, CallbackToy.Config(), fed_data=fed, callbacks=callbacks)


class Recorder(Callback):
    """Every moment it sees, in order, with what it was given."""

    needs_each_client = True

    def __init__(self):
        self.events = []

    def on_train_begin(self, sim):
        self.events.append(("begin", sim.round))

    def after_client_update(self, sim, client_id, update):
        up = [x for k in KEYS for x in update.upload[MODEL][k].flatten().tolist()]
        self.events.append(("client", client_id, up, update.private, sim.round))

    def after_round(self, sim, round_idx, metrics):
        self.events.append(("round", round_idx, metrics))

    def on_train_end(self, sim, results):
        self.events.append(("end", results))


@pytest.mark.parametrize("vectorize", ["off", "on"])
def test_after_client_update_sees_each_uploads_one_sgd_step_and_after_round_the_rounds_metrics(tmp_path, vectorize,
                                                                                                monkeypatch):
    """A callback declaring ``needs_each_client`` is called once per client, in client order, before the round ends,
    with the client's upload as the server receives it: the hand-computed one-step weights (private state already
    stored, so ``update.private`` is None; the round not yet counted). Its declaration keeps the round on the
    sequential path even with ``--vectorize on`` (no vectorized chunk trains). ``after_round`` gets the round index
    and the round's history row (train loss 3.325 by hand), ``on_train_begin`` and ``on_train_end`` come once, the
    latter with the run's results."""
    chunks = []
    real = vectorized.train_chunk
    monkeypatch.setattr(vectorized, "train_chunk", lambda *a, **k: chunks.append(a[1]) or real(*a, **k))
    rec = Recorder()
    sim = _sim(tmp_path, callbacks=[rec], vectorize=vectorize)
    assert sim.callbacks[-1] is rec and sim.each_client
    results = sim.run()
    assert chunks == []
    kinds = [e[0] for e in rec.events]
    assert kinds == ["begin", "client", "client", "round", "end"]
    assert rec.events[0] == ("begin", 0)
    for (_, cid, up, private, round_seen), want in zip(rec.events[1:3], (0, 1)):
        assert cid == want and private is None and round_seen == 0
        assert up == pytest.approx(STEP[want], abs=1e-6)
    _, round_idx, metrics = rec.events[3]
    assert round_idx == 1 and metrics is sim.history[-1]
    assert metrics["round"] == 1 and metrics["clients"] == [0, 1]
    assert metrics["train_loss"] == pytest.approx(3.325, abs=1e-6)
    assert rec.events[4] == ("end", results)


class ValidationScorer(Callback):
    needs_each_client = True

    def __init__(self, scores: dict):
        self.scores = scores

    def after_client_update(self, sim, client_id, update):
        if MODEL in update.upload:   # score the model as uploaded
            sim.ctx.load(update.upload[MODEL])
        self.scores[client_id] = float(sim.ctx.evaluate(sim.model, sim.ctx.val_data(client_id))["loss"])


def test_a_tuners_validation_scorer_is_a_callback(tmp_path):
    """FedPop's score of a client's update (the uploaded model's loss on the client's validation split, here its own
    data) as a callback, by hand from the one-step weights: client 0, pred (1.93875, -0.345), squared error
    (0.93875^2 + 0.345^2) / 2 = 0.50013828125; client 1, pred (1.45, 0.19, -1.07), (1.45^2 + 0.81^2 + 3.07^2) / 3 =
    12.1835 / 3. The run's numbers are those of a run without it."""
    scores = {}
    sim = _sim(tmp_path, callbacks=[ValidationScorer(scores)], num_rounds=2, with_val=True)
    sim.run()
    plain = _sim(tmp_path, num_rounds=2, with_val=True, output_dir=str(tmp_path / "plain"))
    plain.run()
    assert sorted(scores) == [0, 1]                     # round 2's scores replaced round 1's
    assert plain.history == sim.history
    first = {}
    again = _sim(tmp_path, callbacks=[ValidationScorer(first)], with_val=True, output_dir=str(tmp_path / "first"))
    again.run()
    assert first == pytest.approx({0: 0.50013828125, 1: 12.1835 / 3}, abs=1e-6)


def test_after_client_update_is_not_called_without_the_declaration(tmp_path, monkeypatch):
    """A callback that does not declare ``needs_each_client`` is not called per client, not even on the sequential
    path (on a vectorized chunk there is no per-client upload to give it: one rule for both), and leaves the
    simulation free to vectorize."""
    chunks = []
    real = vectorized.train_chunk
    monkeypatch.setattr(vectorized, "train_chunk", lambda *a, **k: chunks.append(a[1]) or real(*a, **k))
    for vectorize in ("off", "on"):
        rec = Recorder()
        rec.needs_each_client = False
        sim = _sim(tmp_path, callbacks=[rec], vectorize=vectorize, output_dir=str(tmp_path / vectorize))
        assert not sim.each_client
        sim.run()
        assert [e[0] for e in rec.events] == ["begin", "round", "end"]
    assert chunks == [[0, 1]]                         # the vectorized run trained both clients in one chunk


def test_default_callbacks_write_metrics_and_checkpoints_and_can_be_removed(tmp_path):
    """The defaults, in their order, come first; with them a 3-round run at ``--checkpoint_every 2`` writes
    checkpoints after rounds 2 and 3 and one metrics.jsonl line per round, equal to the history; without
    :class:`Checkpoints` and :class:`MetricsFile` it writes neither."""
    assert [type(c).__name__ for c in default_callbacks()] == ["RunLog", "Trackers", "ProgressBar", "Checkpoints",
                                                               "MetricsFile"]
    sim = _sim(tmp_path, num_rounds=3, checkpoint_every=2, keep_checkpoints=5)
    sim.run()
    out = Path(sim.args.output_dir)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["round-00002", "round-00003"]
    assert [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()] == \
        json.loads(json.dumps(sim.history))
    assert (out / "results.json").is_file() and (out / "config.yaml").is_file()
    bare = _sim(tmp_path, num_rounds=3, checkpoint_every=2, output_dir=str(tmp_path / "bare"))
    bare.callbacks = [c for c in bare.callbacks if not isinstance(c, (Checkpoints, MetricsFile))]
    bare.run()
    assert not (tmp_path / "bare" / "checkpoints").exists() and not (tmp_path / "bare" / "metrics.jsonl").exists()
    assert bare.history == sim.history                # what the callbacks do never changes what the run computes


def test_metrics_file_is_rewritten_whole_after_a_state_is_loaded(tmp_path):
    """A driver that loads an earlier state into a started simulation (FedPop's resume, its exploit step) gets a
    metrics.jsonl of the loaded history plus the new rounds, not the old lines with the new ones appended."""
    sim = _sim(tmp_path, num_rounds=5)
    sim.step()
    state = sim.state_dict()
    sim.step()
    sim.step()
    sim.load_state_dict(state)
    sim.step()
    lines = (Path(sim.args.output_dir) / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["round"] for x in lines] == [1, 2]


def test_personal_models_seed_load_the_private_state_then_the_methods_model(tmp_path):
    """Each client in turn: torch seeded with its round's 'eval' seed, its stored private model keys loaded (the
    initial ones for a client with no stored state), then ``load_personal(client, state, its stored state, round)``;
    the loaded-tensor memo lives only while the generator runs, and only where asked for (the run's evaluation)."""
    calls = []
    sim = _sim(tmp_path)
    sim.store.put(1, {MODEL: {"p": torch.tensor([7.0])}})
    sim.initial_private = {"p": torch.tensor([3.0])}
    sim.seed_torch = lambda seed: calls.append(("seed", seed))
    sim.ctx.load = lambda values: calls.append(("load", {k: v.tolist() for k, v in values.items()}))
    sim.algorithm.load_personal = lambda cid, state, private, r: calls.append(("personal", cid, state, private, r)) \
        or f"model{cid}"
    got = []
    for cid, model in personal_models(sim, [1, 0], "S", 4):
        assert sim._load_memo is None
        got.append((cid, model))
    assert [m for _, m in personal_models(sim, [0], "S", 4, skip_unchanged_loads=True) if sim._load_memo == {}] \
        == ["model0"]
    assert sim._load_memo is None
    calls[:] = calls[:6]
    assert got == [(1, "model1"), (0, "model0")]
    private1 = sim.store.get(1)
    assert calls == [("seed", sim.seed_for(4, 1, "eval")), ("load", {"p": [7.0]}), ("personal", 1, "S", private1, 4),
                     ("seed", sim.seed_for(4, 0, "eval")), ("load", {"p": [3.0]}), ("personal", 0, "S", None, 4)]
