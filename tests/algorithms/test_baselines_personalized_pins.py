"""The personalized baselines' own steps against hand values: Ditto's personal model (its private keys, its
``load_personal``), FedAvg + fine-tuning's fine-tune at ``load_personal``, FedRep's head-then-body schedule, FedPer's
and Local-only's key roles, the centralized oracle's server training.

Same toy as ``test_baseline_pins.py`` (its module docstring works the arithmetic out): ``pred = c * (w . x) + b``,
loss ``1/2 mean (pred - y)^2``, full-batch plain SGD at lr 0.1, client 0 / client 1 holding 2 / 3 points. One step
from ``W0 = (w = (1, -1), c = 2, b = 0.5)`` gives ``STEP0`` / ``STEP1``; their 2 : 3 mean is ``FEDAVG1``. Values past
one step come from the reference gradient ``grads`` (the formulas written out there) in the paper's update rules.
"""
import pytest
import torch

from hfpfl.algorithms import register
from hfpfl.algorithms.central import CentralConfig
from hfpfl.algorithms.ditto import DittoConfig
from hfpfl.algorithms.fedavg_ft import FineTuneConfig
from hfpfl.algorithms.fedper import FedRepConfig, is_head
from hfpfl.federated.state import FROZEN, GLOBAL, PRIVATE
from test_baseline_pins import (DATA, FEDAVG1, LR, PIN, STEP0, STEP1, W0, P, close, grads, lin, make_sim, sgd,
                                state)


def loss(p, client):
    """The task loss 1/2 mean (c (w . x) + b - y)^2 at ``p`` on a client's whole data."""
    X, Y = (torch.tensor(v, dtype=torch.float64) for v in DATA[client])
    return 0.5 * ((p["c"] * (X @ p["w"]) + p["b"] - Y) ** 2).mean()


def prox(anchor, lam, keys=("w", "c", "b")):
    """The gradient of lam/2 ||p - anchor||^2 over ``keys`` (Ditto's pull toward the received global model)."""
    return lambda p: {k: lam * (p[k] - anchor[k]) if k in keys else torch.zeros_like(p[k]) for k in p}


def _private_bias(base, name):
    """``base`` with the classifier's bias ``b`` a private key (as a client's BatchNorm statistics would be): it
    never travels and is the client's own across rounds."""
    cls = type(name, (base,), {"name": name,
                               "key_role": lambda self, key, default: PRIVATE if key == "classifier.bias" else default})
    return register(cls)


PIN["ditto_pb"] = _private_bias(PIN["ditto"], "pin_ditto_pb")


def model_state(model):
    return {k: v.detach() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------------------------------------ Ditto
def test_ditto_config_rejects_a_negative_lambda_and_zero_personal_epochs():
    """lambda >= 0 and personal_epochs >= 1 are checked when the options are built (the message names the flag)."""
    with pytest.raises(ValueError, match="--lam"):
        DittoConfig(lam=-0.1)
    with pytest.raises(ValueError, match="--personal_epochs"):
        DittoConfig(personal_epochs=0)


def test_ditto_load_personal_is_the_kept_personal_model_and_the_global_one_for_a_new_client(tmp_path):
    """After one round (lambda 0.5, 2 personal steps) ``load_personal`` returns client i's personal model v_i (two
    steps from W0 with the pull toward W0; the first step has no pull, so it is STEP_i), not the global FEDAVG1; a
    client with no kept state (None or {}) gets the global model FEDAVG1."""
    lam = 0.5
    sim = make_sim(tmp_path, "ditto", DittoConfig(lam=lam, personal_epochs=2))
    sim.step()
    w0 = P(W0)
    for i in (0, 1):
        v = sgd(w0, i, 2, extra=prox(w0, lam))
        got = model_state(sim.algorithm.load_personal(i, sim.server_state, sim.store.get(i), 1))
        close(got, state(v))
    for empty in (None, {}):
        got = model_state(sim.algorithm.load_personal(0, sim.server_state, empty, 1))
        close(got, state(P(FEDAVG1)))


def test_ditto_reports_the_personal_models_mean_task_loss(tmp_path):
    """``personal_train_loss`` is the personal model's task loss averaged over its steps (the pull not included):
    client 0, lambda 0.5, 2 steps: (L(W0) + L(STEP0)) / 2 with L(W0) = 1/2 mean(1.5^2, 3.5^2) = 3.625; the global
    model's own ``train_loss`` is L(W0) (one step)."""
    sim = make_sim(tmp_path, "ditto", DittoConfig(lam=0.5, personal_epochs=2))
    sim.step()
    assert loss(P(W0), 0).item() == pytest.approx(3.625)
    m = sim.last_updates[0].metrics
    assert m["personal_train_loss"] == pytest.approx(((loss(P(W0), 0) + loss(P(STEP0), 0)) / 2).item(), rel=1e-6)
    assert m["train_loss"] == pytest.approx(3.625, rel=1e-6)


def test_ditto_private_keys_follow_the_client_in_both_models_over_two_rounds(tmp_path):
    """With ``b`` private (lambda 0.5, 1 personal step): round 1, client i's global training from (W0, b = 0.5) gives
    STEP_i; it uploads (w, c) and keeps b = STEP_i's b (0.6 / 0.55). Round 2: the global training starts from the
    averaged (w, c) = FEDAVG1's and the client's own kept b; the personal model from the kept (w, c) of v_i and the
    same kept b, pulled toward round 2's download (w, c) only (b is not part of the download). ``load_personal``
    gives v_i's (w, c) with the kept b. A client that loaded the initial b = 0.5 (or another client's b) instead
    would land elsewhere."""
    lam = 0.5
    sim = make_sim(tmp_path, "ditto_pb", DittoConfig(lam=lam, personal_epochs=1))
    sim.step()
    w0 = P(W0)
    v1 = [sgd(w0, i, 1, extra=prox(w0, lam, "wc")) for i in (0, 1)]   # = STEP_i: the pull is 0 at the download
    for i, step in enumerate((STEP0, STEP1)):
        kept = sim.store.get(i)
        close(kept["model"], state(P(step), "b"))
        close(kept["personal"], state(v1[i], "wc"))
        close(sim.last_updates[i].upload["model"], state(P(step), "wc"))
    down = P(FEDAVG1)
    close(sim.server_state["model"], state(down, "wc"))
    sim.step()
    ys, vs = [], []
    for i, step in enumerate((STEP0, STEP1)):
        b = P(step)["b"]
        ys.append(sgd({**down, "b": b}, i))                                   # the global model's step
        vs.append(sgd({**v1[i], "b": b}, i, 1, extra=prox(down, lam, "wc")))  # the personal model's step
        kept = sim.store.get(i)
        close(kept["model"], state(ys[i], "b"))
        close(kept["personal"], state(vs[i], "wc"))
        close(sim.last_updates[i].upload["model"], state(ys[i], "wc"))
    close(sim.server_state["model"], state(lin((0.4, ys[0]), (0.6, ys[1])), "wc"))
    for i in (1, 0):
        got = model_state(sim.algorithm.load_personal(i, sim.server_state, sim.store.get(i), 2))
        close(got, {**state(vs[i], "wc"), **state(ys[i], "b")})


# ------------------------------------------------------------------------------------------------ FedAvg + FT
PIN["fedavg_ft_pb"] = _private_bias(PIN["fedavg_ft"], "pin_fedavg_ft_pb")


def test_fedavg_ft_config_rejects_negative_epochs():
    with pytest.raises(ValueError, match="--finetune_epochs"):
        FineTuneConfig(finetune_epochs=-1)


@pytest.mark.parametrize("epochs", [0, 1])
def test_fedavg_ft_fine_tunes_exactly_finetune_epochs_steps_on_the_clients_own_data(tmp_path, epochs):
    """0 fine-tuning epochs: the personal model is the global FEDAVG1 itself (no step at all); 1 epoch: one full-batch
    SGD step at the run's lr 0.1 from FEDAVG1 on client i's own data (client 0 and client 1 differ)."""
    sim = make_sim(tmp_path, "fedavg_ft", FineTuneConfig(finetune_epochs=epochs))
    sim.step()
    for i in (0, 1):
        got = model_state(sim.algorithm.load_personal(i, sim.server_state, sim.store.get(i), 1))
        close(got, state(sgd(P(FEDAVG1), i, epochs)))
    close(sim.server_state["model"], state(P(FEDAVG1)))


def test_fedavg_ft_fine_tunes_from_the_clients_own_private_keys(tmp_path):
    """With ``b`` private: after round 1 client i keeps b = STEP_i's (0.6 / 0.55) and the server holds FEDAVG1's
    (w, c); its personal model is 2 SGD steps from (FEDAVG1's w, c; its own b) on its data, every key trained (the
    initial b = 0.5 would give another model)."""
    sim = make_sim(tmp_path, "fedavg_ft_pb", FineTuneConfig(finetune_epochs=2))
    sim.step()
    for i, step in enumerate((STEP0, STEP1)):
        close(sim.store.get(i)["model"], state(P(step), "b"))
        got = model_state(sim.algorithm.load_personal(i, sim.server_state, sim.store.get(i), 1))
        close(got, state(sgd({**P(FEDAVG1), "b": P(step)["b"]}, i, 2)))


# ------------------------------------------------------------------------------------------------ FedPer / FedRep
def test_fedrep_config_rejects_zero_epochs():
    for bad in ("head_epochs", "body_epochs"):
        with pytest.raises(ValueError, match=f"--{bad}"):
            FedRepConfig(**{bad: 0})


def test_is_head_names_the_classifier_keys():
    """FedPer/FedRep's personal head: keys under ``classifier.``, ``head.``, ``fc.`` at the top, or a ``classifier``
    module anywhere (``vit.classifier.weight``); nothing else (a body's ``fc1`` or ``classifier_dropout``)."""
    heads = ["classifier.weight", "head.bias", "fc.weight", "vit.classifier.weight", "base.model.classifier.bias"]
    bodies = ["body.weight", "vit.encoder.fc1.weight", "vit.classifier_dropout.p", "encoder.head_norm.weight",
              "classifier_head.weight"]
    assert [is_head(k) for k in heads] == [True] * len(heads)
    assert [is_head(k) for k in bodies] == [False] * len(bodies)


def test_fedrep_head_epochs_then_body_epochs_and_their_losses(tmp_path):
    """1 head epoch, 2 body epochs. Client 0: the head step from W0 with w fixed gives (c, b) = (1.575, 0.6) (STEP0's)
    and loss L(W0) = 3.625 (``head_train_loss``); then two w steps with that head fixed; ``train_loss`` is the body
    phase's mean task loss (L(p1) + L(p2)) / 2. The head stays private; w travels with the client's sample count."""
    sim = make_sim(tmp_path, "fedrep", FedRepConfig(head_epochs=1, body_epochs=2))
    sim.step()
    for i in (0, 1):
        p0 = P(W0)
        g = grads(p0, i)
        p1 = {**p0, "c": p0["c"] - LR * g["c"], "b": p0["b"] - LR * g["b"]}
        p2 = {**p1, "w": p1["w"] - LR * grads(p1, i)["w"]}
        p3 = {**p2, "w": p2["w"] - LR * grads(p2, i)["w"]}
        u = sim.last_updates[i]
        close(u.upload["model"], state(p3, "w"))
        close(sim.store.get(i)["model"], state(p1, "cb"))
        assert u.num_samples == len(DATA[i][1])
        assert u.metrics["head_train_loss"] == pytest.approx(loss(p0, i).item(), rel=1e-6)
        assert u.metrics["train_loss"] == pytest.approx(((loss(p1, i) + loss(p2, i)) / 2).item(), rel=1e-6)
    close(state(sgd(P(W0), 0), "cb"), state(P(STEP0), "cb"))
    assert loss(P(W0), 0).item() == pytest.approx(3.625)


# ------------------------------------------------------------------------------------------------ Local, Central
def test_local_and_fedper_key_roles():
    """Local-only makes every global key private and leaves frozen and private ones as they are; FedPer makes a
    global head key private, keeps the body global and a frozen head frozen."""
    from hfpfl.algorithms.fedper import FedPer
    from hfpfl.algorithms.local import LocalOnly

    roles = [(k, d) for k in ("body.weight", "classifier.weight") for d in (GLOBAL, PRIVATE, FROZEN)]
    assert [LocalOnly.key_role(None, k, d) for k, d in roles] == [PRIVATE, PRIVATE, FROZEN] * 2
    assert [FedPer.key_role(None, k, d) for k, d in roles] == [GLOBAL, PRIVATE, FROZEN, PRIVATE, PRIVATE, FROZEN]


def test_central_trains_config_epochs_on_the_union(tmp_path):
    """--epochs 2 on the union of the 5 points (full batch): two steps, each with the union's gradient = the 2 : 3 mix
    of the clients' (the first lands on FEDAVG1), whatever the run's --local_epochs (1)."""
    sim = make_sim(tmp_path, "central", CentralConfig(epochs=2), num_rounds=1)
    sim.run()
    p = P(W0)
    for _ in range(2):
        g0, g1 = grads(p, 0), grads(p, 1)
        p = {k: p[k] - LR * (0.4 * g0[k] + 0.6 * g1[k]) for k in p}
    close(sim.server_state["model"], state(p))
    with pytest.raises(ValueError, match="--epochs"):
        CentralConfig(epochs=0)


# ------------------------------------------------------------------------------------------------ random streams
def _spy_generators(sim, monkeypatch):
    calls = []
    real = sim.generator
    monkeypatch.setattr(sim, "generator", lambda r, c, tag="": calls.append((r, c, tag)) or real(r, c, tag))
    return calls


def test_each_training_phase_shuffles_from_its_own_named_stream(tmp_path, monkeypatch):
    """Every training phase draws its batch order from the stream seeded by (seed, round, client, phase name): FedAvg
    + FT's fine-tune at evaluation ("finetune", not the client's training stream "" of that round, whose batch order
    it would replay), FedRep's "head" then "body" phases per client, Central's "central" stream of the server
    (client -1). A renamed phase changes every run's results; these names are the reproducibility contract."""
    sim = make_sim(tmp_path, "fedavg_ft", FineTuneConfig(finetune_epochs=1))
    sim.step()
    calls = _spy_generators(sim, monkeypatch)
    sim.algorithm.load_personal(1, sim.server_state, sim.store.get(1), 1)
    assert calls == [(1, 1, "finetune")]

    sim = make_sim(tmp_path, "fedrep", FedRepConfig(head_epochs=1, body_epochs=1))
    calls = _spy_generators(sim, monkeypatch)
    sim.step()
    assert [c for c in calls if c[1] in (0, 1)] == [(1, 0, "head"), (1, 0, "body"), (1, 1, "head"), (1, 1, "body")]

    sim = make_sim(tmp_path, "central", CentralConfig(epochs=1), num_rounds=1)
    calls = _spy_generators(sim, monkeypatch)
    sim.run()
    assert (1, -1, "central") in calls and not [c for c in calls if c[1] == 1 and c[2] == "central"]
