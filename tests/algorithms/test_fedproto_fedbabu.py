"""FedProto (Tan et al., AAAI 2022) and FedBABU (Oh et al., ICLR 2022): each defining step against hand values on a
two-layer linear model with known weights (body f = W x, head z = V f + b), plus a short run of each on Digits."""
import math

import pytest
import torch
from torch import nn
from transformers.modeling_outputs import ImageClassifierOutput

from hfpfl.algorithms import REGISTRY
from hfpfl.algorithms.base import Update
from hfpfl.algorithms.fedbabu import FedBABU, FedBABUConfig
from hfpfl.algorithms.fedper import is_head
from hfpfl.algorithms.fedproto import FedProto, FedProtoConfig, NearestPrototype, proto_table
from hfpfl.federated.comm import tensor_bytes
from hfpfl.training import TensorData

W0 = [[1.0, 2.0], [0.0, 1.0]]               # body: f = W x
V0 = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]   # head: z = V f + b, 3 classes
B0 = [0.0, 0.5, -0.5]


class TinyNet(nn.Module):
    """body (Linear 2->2, no bias) then classifier (Linear 2->3), weights W0, V0, B0."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(2, 2, bias=False)
        self.classifier = nn.Linear(2, 3)
        with torch.no_grad():
            self.body.weight.copy_(torch.tensor(W0))
            self.classifier.weight.copy_(torch.tensor(V0))
            self.classifier.bias.copy_(torch.tensor(B0))

    def forward(self, pixel_values, labels=None):
        logits = self.classifier(self.body(pixel_values))
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return ImageClassifierOutput(loss=loss, logits=logits)


class TinyFedProto(FedProto):
    name = "tiny_fedproto"

    def build_model(self):
        return TinyNet()


class TinyFedBABU(FedBABU):
    name = "tiny_fedbabu"

    def build_model(self):
        return TinyNet()


@pytest.fixture(autouse=True)
def tiny_methods():
    """The two test-only methods, registered for this module's tests alone (the method listings stay clean)."""
    REGISTRY.update({c.name: c for c in (TinyFedProto, TinyFedBABU)})
    yield
    for c in (TinyFedProto, TinyFedBABU):
        REGISTRY.pop(c.name, None)


def data(xs, ys):
    return TensorData(torch.tensor(xs, dtype=torch.float32), torch.tensor(ys))


def with_data(sim, per_client: dict):
    """The clients' training data replaced by hand-made tensors."""
    sim.train_data = lambda cid: per_client[cid]
    return sim


# ------------------------------------------------------------------------------------------------ FedProto
def test_fedproto_local_prototypes_are_class_means_of_the_embedding(run_sim):
    """Eq. 3 by hand: f = W0 x; x = (1,0),(0,1),(1,1),(2,0) -> f = (1,0),(2,1),(3,1),(2,0); labels 0,0,1,0:
    C^(0) = ((1,0)+(2,1)+(2,0))/3 = (5/3, 1/3), C^(1) = (3,1); counts 3 and 1. Batches of 3 (two batches)."""
    sim, _ = run_sim("tiny_fedproto", run=False, eval_batch_size=3)
    protos, counts = sim.algorithm.local_prototypes(data([[1, 0], [0, 1], [1, 1], [2, 0]], [0, 0, 1, 0]))
    assert set(protos) == {"0", "1"}
    assert torch.allclose(protos["0"], torch.tensor([5 / 3, 1 / 3]))
    assert torch.allclose(protos["1"], torch.tensor([3.0, 1.0]))
    assert {c: int(n) for c, n in counts.items()} == {"0": 3, "1": 1}


def _proto_updates():
    """A: C0 = (1,0) x3, C1 = (0,2) x1; B: C0 = (4,2) x1; C: C1 = (2,2) x3, C2 = (5,5) x2."""
    t = torch.tensor
    return [Update(0, {"protos": {"0": t([1.0, 0.0]), "1": t([0.0, 2.0])}, "counts": {"0": t(3), "1": t(1)}}, 4),
            Update(1, {"protos": {"0": t([4.0, 2.0])}, "counts": {"0": t(1)}}, 1),
            Update(2, {"protos": {"1": t([2.0, 2.0]), "2": t([5.0, 5.0])}, "counts": {"1": t(3), "2": t(2)}}, 5)]


def test_fedproto_server_takes_the_class_count_weighted_mean(run_sim):
    """Eq. 6 with weights |D_i,j| / N_j: C0 = (3 (1,0) + 1 (4,2)) / 4 = (1.75, 0.5); C1 = (1 (0,2) + 3 (2,2)) / 4 =
    (1.5, 2); C2 = (5,5); class 3, uploaded by nobody this round, keeps its earlier prototype."""
    sim, _ = run_sim("tiny_fedproto", run=False)
    state = sim.algorithm.init_server_state()
    state["prototypes"]["table"][3], state["prototypes"]["known"][3] = torch.tensor([9.0, 9.0]), True
    out = sim.algorithm.aggregate(state, _proto_updates(), 1)["prototypes"]
    assert out["known"].nonzero().flatten().tolist() == [0, 1, 2, 3]
    table = out["table"]
    assert torch.allclose(table[0], torch.tensor([1.75, 0.5]))
    assert torch.allclose(table[1], torch.tensor([1.5, 2.0]))
    assert torch.equal(table[2], torch.tensor([5.0, 5.0])) and torch.equal(table[3], torch.tensor([9.0, 9.0]))
    down = sim.algorithm.download({"prototypes": out}, 0)["protos"]  # the known ones travel, under their class
    assert set(down) == {"0", "1", "2", "3"} and torch.equal(down["1"], table[1])


def test_fedproto_uniform_weights_are_the_plain_mean_over_holders(run_sim):
    """--proto_weights uniform (authors' code): C0 = ((1,0) + (4,2)) / 2 = (2.5, 1); C1 = ((0,2) + (2,2)) / 2 = (1, 2)."""
    sim, _ = run_sim("tiny_fedproto", method_config=FedProtoConfig(proto_weights="uniform"), run=False)
    ups = _proto_updates()
    for u in ups:
        del u.upload["counts"]  # uniform weights need no counts: none travel
    out = sim.algorithm.aggregate(sim.algorithm.init_server_state(), ups, 1)["prototypes"]["table"]
    assert torch.allclose(out[0], torch.tensor([2.5, 1.0]))
    assert torch.allclose(out[1], torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("distance,scale", [("sq_l2", 1.0), ("mse", 0.5)])
def test_fedproto_local_loss_by_hand(run_sim, distance, scale):
    """x = (1,0), (0,1); y = 0, 2 -> f = (1,0), (2,1); z = V0 f + B0 = (1, 0.5, 0.5), (2, 1.5, 2.5).
    CE = mean(-z_y + logsumexp z). Global prototypes C0 = (0,0), C2 = (2,3): ||f - C_y||^2 = 1 and 4, batch mean 2.5
    (divided by d = 2 for 'mse'); lambda = 0.5. Without C2 the second sample adds 0 (mean 0.5); without any
    prototype (round 1) the loss is CE alone."""
    sim, _ = run_sim("tiny_fedproto", method_config=FedProtoConfig(proto_lambda=0.5, proto_distance=distance),
                     run=False)
    algo = sim.algorithm
    batch = {"pixel_values": torch.tensor([[1.0, 0.0], [0.0, 1.0]]), "labels": torch.tensor([0, 2])}
    lse = lambda z: math.log(sum(math.exp(v) for v in z))  # noqa: E731
    ce = ((-1 + lse([1, 0.5, 0.5])) + (-2.5 + lse([2, 1.5, 2.5]))) / 2
    t = torch.tensor
    both = algo.loss_fn({"0": t([0.0, 0.0]), "2": t([2.0, 3.0])})(sim.model, batch).item()
    assert both == pytest.approx(ce + 0.5 * 2.5 * scale, rel=1e-6)
    only0 = algo.loss_fn({"0": t([0.0, 0.0])})(sim.model, batch).item()
    assert only0 == pytest.approx(ce + 0.5 * 0.5 * scale, rel=1e-6)
    assert algo.loss_fn({})(sim.model, batch).item() == pytest.approx(ce, rel=1e-6)


def test_fedproto_nearest_prototype_prediction_by_hand(run_sim):
    """f = (1,0), (2,1), (3,1); C0 = (0,0), C1 = (3,1), C2 = (2, 0.5), no C3. Squared distances: (1, 5, 1.25),
    (5, 1, 0.25), (10, 0, 1.25) -> classes 0, 2, 1; logits are minus these, class 3 is -inf. The model's own head
    predicts 0, 2, 2 (accuracy 2/3 on labels 0, 2, 1): the personal model scores 1.0 only through the prototypes."""
    sim, _ = run_sim("tiny_fedproto", run=False)
    algo = sim.algorithm
    t = torch.tensor
    protos = {"0": t([0.0, 0.0]), "1": t([3.0, 1.0]), "2": t([2.0, 0.5])}
    x = t([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    model = NearestPrototype(sim.model, proto_table(protos, 4))
    logits = model(pixel_values=x).logits
    assert torch.allclose(logits[:, :3], -t([[1.0, 5.0, 1.25], [5.0, 1.0, 0.25], [10.0, 0.0, 1.25]]))
    assert torch.isinf(logits[:, 3]).all() and (logits[:, 3] < 0).all()
    test = data(x.tolist(), [0, 2, 1])
    assert sim.ctx.evaluate(sim.model, test)["accuracy"] == pytest.approx(2 / 3)
    state = algo.init_server_state()
    assert algo.load_personal(0, state, None, 1) is sim.model  # no prototype yet: the model's own head
    for c, p in protos.items():
        state["prototypes"]["table"][int(c)], state["prototypes"]["known"][int(c)] = p, True
    personal = algo.load_personal(0, state, None, 1)
    assert sim.ctx.evaluate(personal, test)["accuracy"] == 1.0


def test_fedproto_only_prototypes_and_counts_travel(run_sim):
    """One client update on hand data: the upload is exactly {protos, counts} for the classes the client holds, the
    prototypes are Eq. 3 under the weights it trained to (recomputed here from its private W), and the bytes are
    2 classes x 2 floats x 4 B + 2 counts x 8 B = 32. The first download holds no prototypes (0 bytes)."""
    sim, _ = run_sim("tiny_fedproto", run=False, momentum=0.0, lr=0.1, batch_size=16)
    d = data([[1, 0], [0, 1], [1, 1]], [0, 0, 1])
    algo = with_data(sim, {0: d}).algorithm
    down = algo.download(algo.init_server_state(), 0)
    assert down == {"protos": {}} and tensor_bytes(down) == 0
    up = algo.client_update(0, down, algo.init_private_state(0), 1)
    assert set(up.upload) == {"protos", "counts"} and set(up.upload["protos"]) == {"0", "1"}
    assert {c: int(n) for c, n in up.upload["counts"].items()} == {"0": 2, "1": 1}
    W = up.private["model"]["body.weight"]
    assert not torch.equal(W, torch.tensor(W0))  # it trained
    f = d.pixel_values @ W.T
    assert torch.allclose(up.upload["protos"]["0"], (f[0] + f[1]) / 2, atol=1e-6)
    assert torch.allclose(up.upload["protos"]["1"], f[2], atol=1e-6)
    assert tensor_bytes(up.upload) == 2 * 2 * 4 + 2 * 8
    assert set(up.private["model"]) == {"body.weight", "classifier.weight", "classifier.bias"}


def _proto_steps(x, y, protos: dict, lam, lr, n, d_scale):
    """``n`` full-batch SGD steps from W0, V0, B0 on FedProto's local objective, written from the paper's equation
    with autograd in float64 (an independent implementation): CE(V f + b, y) + lam * mean_batch(has[y] *
    ||f - C[y]||^2 / d_scale), f = W x."""
    W, V, b = (torch.tensor(t, dtype=torch.float64, requires_grad=True) for t in (W0, V0, B0))
    x, y = torch.tensor(x, dtype=torch.float64), torch.tensor(y)
    for _ in range(n):
        f = x @ W.T
        ce = nn.functional.cross_entropy(f @ V.T + b, y)
        dist = torch.stack([((f[i] - torch.tensor(protos[str(int(c))], dtype=torch.float64)) ** 2).sum() / d_scale
                            if str(int(c)) in protos else f[i].sum() * 0 for i, c in enumerate(y)])
        loss = ce + lam * dist.mean()
        gW, gV, gb = torch.autograd.grad(loss, (W, V, b))
        with torch.no_grad():
            W, V, b = (t - lr * g for t, g in ((W, gW), (V, gV), (b, gb)))
        W, V, b = (t.requires_grad_() for t in (W, V, b))
    return W.detach(), V.detach(), b.detach()


def test_fedproto_client_update_trains_on_ce_plus_the_global_prototype_distance(run_sim):
    """A round-2 client update (global prototypes C0 = (0,0), C2 = (2,3) downloaded): one full-batch SGD step, lr 0.1,
    lambda 0.5, 'mse' (||.||^2 / 2), on x = (1,0), (0,1), y = 0, 2: the private weights equal the hand step of CE +
    the prototype term (a step on CE alone differs)."""
    cfg = FedProtoConfig(proto_lambda=0.5)
    sim, _ = run_sim("tiny_fedproto", method_config=cfg, run=False, momentum=0.0, lr=0.1, batch_size=16)
    algo = with_data(sim, {0: data([[1, 0], [0, 1]], [0, 2])}).algorithm
    protos = {"0": [0.0, 0.0], "2": [2.0, 3.0]}
    down = {"protos": {c: torch.tensor(p) for c, p in protos.items()}}
    up = algo.client_update(0, down, algo.init_private_state(0), 2)
    W, V, b = _proto_steps([[1.0, 0.0], [0.0, 1.0]], [0, 2], protos, 0.5, 0.1, 1, 2)
    got = up.private["model"]
    assert torch.allclose(got["body.weight"].double(), W, atol=1e-6)
    assert torch.allclose(got["classifier.weight"].double(), V, atol=1e-6)
    assert torch.allclose(got["classifier.bias"].double(), b, atol=1e-6)
    W_ce, _, _ = _proto_steps([[1.0, 0.0], [0.0, 1.0]], [0, 2], {}, 0.5, 0.1, 1, 2)
    assert not torch.allclose(W, W_ce, atol=1e-4)  # the prototype term moved the body


def test_fedproto_uniform_weights_upload_prototypes_only(run_sim):
    """--proto_weights uniform: the server needs no class counts, so none travel: 2 classes x 2 floats x 4 B."""
    sim, _ = run_sim("tiny_fedproto", method_config=FedProtoConfig(proto_weights="uniform"), run=False)
    algo = with_data(sim, {0: data([[1, 0], [0, 1], [1, 1]], [0, 0, 1])}).algorithm
    up = algo.client_update(0, {"protos": {}}, algo.init_private_state(0), 1)
    assert set(up.upload) == {"protos"} and tensor_bytes(up.upload) == 2 * 2 * 4


@pytest.mark.parametrize("epochs", [0, 1, 2])
def test_fedproto_new_client_trains_new_client_epochs_on_its_data_with_the_prototypes_fixed(run_sim, epochs):
    """A new client starts from the initial model and runs --new_client_epochs full-batch SGD steps (lr 0.1, the run's
    local epochs are 1) of CE + lambda * distance to the *global* prototypes on the data it is given (not a training
    client's data); 0 epochs: the initial model. Its predictor is the nearest global prototype."""
    cfg = FedProtoConfig(proto_lambda=0.5, proto_distance="sq_l2")
    sim, _ = run_sim("tiny_fedproto", method_config=cfg, run=False, momentum=0.0, lr=0.1, batch_size=16,
                     new_client_epochs=epochs, local_epochs=1)
    algo = with_data(sim, {0: data([[5, 5]], [1])}).algorithm   # a training client's data: must not be used
    protos = {"0": [0.0, 0.0], "2": [2.0, 3.0]}
    state = algo.init_server_state()
    for c, p in protos.items():
        state["prototypes"]["table"][int(c)], state["prototypes"]["known"][int(c)] = torch.tensor(p), True
    personal = algo.personalize_new_client(0, state, data([[1, 0], [0, 1]], [0, 2]), 3)
    assert isinstance(personal, NearestPrototype)
    W, V, b = _proto_steps([[1.0, 0.0], [0.0, 1.0]], [0, 2], protos, 0.5, 0.1, epochs, 1)
    assert torch.allclose(sim.model.body.weight.double(), W, atol=1e-6)
    assert torch.allclose(sim.model.classifier.weight.double(), V, atol=1e-6)
    assert torch.allclose(sim.model.classifier.bias.double(), b, atol=1e-6)


def test_fedproto_runs_end_to_end_sending_no_weights(run_sim):
    """Two rounds on Digits with the tiny ResNet: no model part ever travels; every round's upload per client is its
    classes' prototypes (4 B per float) and counts (8 B each); round 1 downloads nothing, round 2 every class."""
    sim, res = run_sim("fedproto")
    by_part = sim.ledger.totals()["by_part"]
    assert set(by_part) == {"protos", "counts"}
    d = sim.server_state["prototypes"]["table"].shape[1]
    for u in sim.last_updates:
        assert set(u.upload) == {"protos", "counts"}
        k = len(u.upload["protos"])
        assert tensor_bytes(u.upload) == k * d * 4 + k * 8
    k_all = int(sim.server_state["prototypes"]["known"].sum())
    assert by_part["protos"]["bytes_down"] == sim.num_clients * k_all * d * 4  # round 2 only
    assert "global_accuracy" not in res["final"] and 0 <= res["final"]["personal_accuracy"] <= 1
    assert not torch.equal(sim.store.get(0)["model"][next(iter(sim.initial_private))],
                           sim.store.get(1)["model"][next(iter(sim.initial_private))])


# ------------------------------------------------------------------------------------------------ FedBABU
def test_fedbabu_body_is_the_sample_weighted_mean(run_sim):
    """Clients with 1 and 3 samples upload body W = 0 and W = 4: the server body is (1*0 + 3*4) / 4 = 3."""
    sim, _ = run_sim("tiny_fedbabu", run=False)
    algo = with_data(sim, {0: data([[1, 0]], [0]), 1: data([[1, 0]] * 3, [0] * 3)}).algorithm
    assert algo.global_keys == ["body.weight"]
    ups = [Update(0, {"model": {"body.weight": torch.zeros(2, 2)}}, 1),
           Update(1, {"model": {"body.weight": torch.full((2, 2), 4.0)}}, 3)]
    out = algo.aggregate(algo.init_server_state(), ups, 1)["model"]
    assert set(out) == {"body.weight"}
    assert torch.equal(out["body.weight"], torch.full((2, 2), 3.0))


def test_fedbabu_client_trains_the_body_only(run_sim):
    """One local step: the head keeps V0, B0 exactly and is not uploaded; the body moved."""
    sim, _ = run_sim("tiny_fedbabu", run=False, momentum=0.0, lr=0.1)
    algo = with_data(sim, {0: data([[1, 0], [0, 1]], [0, 2])}).algorithm
    up = algo.client_update(0, algo.download(algo.init_server_state(), 0), algo.init_private_state(0), 1)
    assert set(up.upload["model"]) == {"body.weight"}
    assert not torch.equal(up.upload["model"]["body.weight"], torch.tensor(W0))
    assert torch.equal(up.private["model"]["classifier.weight"], torch.tensor(V0))
    assert torch.equal(up.private["model"]["classifier.bias"], torch.tensor(B0))


def _one_sgd_step(x, y, lr):
    """One SGD step on mean CE of z = V0 W0 x + B0, gradients written out: dz = (softmax z - onehot) / n,
    dV = dz^T f, db = sum dz, dW = (dz V0)^T x."""
    W, V, b = torch.tensor(W0, dtype=torch.float64), torch.tensor(V0, dtype=torch.float64), torch.tensor(B0, dtype=torch.float64)
    x = torch.tensor(x, dtype=torch.float64)
    f = x @ W.T
    z = f @ V.T + b
    p = torch.exp(z - z.max(1, keepdim=True).values)
    p = p / p.sum(1, keepdim=True)
    dz = (p - torch.eye(3, dtype=torch.float64)[y]) / len(y)
    return W - lr * (dz @ V).T @ x, V - lr * dz.T @ f, b - lr * dz.sum(0)


@pytest.mark.parametrize("part", ["full", "head"])
def test_fedbabu_finetuning_is_one_sgd_step_by_hand(run_sim, part):
    """Personalization with tau = 1 epoch on one batch of 2 samples, lr 0.1 (the --finetune_lr), plain SGD: the
    personal model is exactly one hand-computed SGD step from the received model (W0, V0, B0); 'head' leaves W."""
    cfg = FedBABUConfig(finetune_epochs=1, finetune_part=part, finetune_lr=0.1)
    sim, _ = run_sim("tiny_fedbabu", method_config=cfg, run=False, momentum=0.0, lr=0.7, batch_size=16)
    algo = with_data(sim, {0: data([[1, 0], [0, 1]], [0, 2])}).algorithm
    model = algo.load_personal(0, algo.init_server_state(), None, 1)
    W, V, b = _one_sgd_step([[1.0, 0.0], [0.0, 1.0]], [0, 2], lr=0.1)
    if part == "head":
        W = torch.tensor(W0, dtype=torch.float64)
    assert torch.allclose(model.body.weight.double(), W, atol=1e-6)
    assert torch.allclose(model.classifier.weight.double(), V, atol=1e-6)
    assert torch.allclose(model.classifier.bias.double(), b, atol=1e-6)
    assert not torch.allclose(V, torch.tensor(V0, dtype=torch.float64))  # the step is not trivially zero


def _sgd_steps(x, y, lr, n):
    """``n`` full-batch SGD steps of :func:`_one_sgd_step`'s gradients, from W0, V0, B0."""
    W, V, b = (torch.tensor(t, dtype=torch.float64) for t in (W0, V0, B0))
    x = torch.tensor(x, dtype=torch.float64)
    for _ in range(n):
        f = x @ W.T
        p = torch.softmax(f @ V.T + b, dim=1)
        dz = (p - torch.eye(3, dtype=torch.float64)[y]) / len(y)
        W, V, b = W - lr * (dz @ V).T @ x, V - lr * dz.T @ f, b - lr * dz.sum(0)
    return W, V, b


@pytest.mark.parametrize("tau", [0, 2])
def test_fedbabu_finetunes_exactly_tau_epochs_at_the_runs_lr(run_sim, tau):
    """tau = --finetune_epochs, not the run's local epochs (1 here), and without --finetune_lr the client's own lr
    (0.3): tau = 2 is two hand-computed full-batch SGD steps; tau = 0 is no fine-tuning at all (the received model,
    not one epoch: the engine's loop reads epochs=0 as "one epoch", so the method must not call it)."""
    cfg = FedBABUConfig(finetune_epochs=tau, finetune_part="full")
    sim, _ = run_sim("tiny_fedbabu", method_config=cfg, run=False, momentum=0.0, lr=0.3, batch_size=16,
                     local_epochs=1)
    algo = with_data(sim, {0: data([[1, 0], [0, 1]], [0, 2])}).algorithm
    model = algo.load_personal(0, algo.init_server_state(), None, 1)
    W, V, b = _sgd_steps([[1.0, 0.0], [0.0, 1.0]], [0, 2], lr=0.3, n=tau)
    assert torch.allclose(model.body.weight.double(), W, atol=1e-6)
    assert torch.allclose(model.classifier.weight.double(), V, atol=1e-6)
    assert torch.allclose(model.classifier.bias.double(), b, atol=1e-6)


def test_fedbabu_runs_end_to_end_head_fixed_and_never_sent(run_sim):
    """Two rounds on Digits with the tiny ResNet (its evaluation fine-tunes every client's head): no head key is ever
    uploaded, downloaded or in the server state; every client's head, after training and after the fine-tuned
    evaluations, is still the one initial head; the body did train."""
    sim, _ = run_sim("fedbabu", method_config=FedBABUConfig(finetune_epochs=1), run=False)
    start = sim.algorithm.init_server_state()["model"]
    res = sim.run()
    head = [k for k in sim.model_state if is_head(k)]
    assert head and sim.algorithm.private_keys == head
    init_head = sim.initial_private
    for u in sim.last_updates:
        assert u.upload["model"] and not any(is_head(k) for k in u.upload["model"])
    assert not any(is_head(k) for k in sim.server_state["model"])
    assert not any(is_head(k) for k in sim.algorithm.download(sim.server_state, 0)["model"])
    for cid in range(sim.num_clients):
        for k in head:
            assert torch.equal(sim.store.get(cid)["model"][k], init_head[k]), (cid, k)
    assert any(not torch.equal(sim.server_state["model"][k], start[k]) for k in start)
    assert set(sim.ledger.totals()["by_part"]) == {"model"}
    assert {"global_accuracy", "personal_accuracy"} <= set(res["final"])


def test_fedproto_resume_after_round_one_equals_straight_run(run_sim):
    """The global prototypes are server state (part "protos"): a run cut after round 1 (prototypes set) and resumed
    from its checkpoint gives the same results as 2 rounds straight."""
    kw = dict(num_rounds=2, checkpoint_every=1, eval_every=2)
    straight_sim, straight = run_sim("fedproto", output_dir="straight", **kw)
    cut, _ = run_sim("fedproto", output_dir="cut", run=False, **kw)
    cut.step()
    assert bool(cut.server_state["prototypes"]["known"].all())
    _, resumed = run_sim("fedproto", output_dir="cut", resume_from_checkpoint="latest", overwrite_output_dir=False,
                         **kw)
    for key in ("final", "per_client_accuracy", "new_client_accuracy", "communication"):
        assert resumed[key] == straight[key], key


# ------------------------------------------------------------------------------------------------ FedBABU lr grid
def _babu_sim(tmp_path, cfg, val=True):
    """Two clients holding x = (1, 0), (0, 1) with labels 0, 2 (one full batch), FedBABU on TinyNet, run lr 0.7; the
    clients' validation splits: client 0 the same two points, client 1 those plus (1, 1) labelled 1."""
    from datasets import Dataset

    from hfpfl.config import RunArguments
    from hfpfl.data.federated import ClientData, FederatedData
    from hfpfl.federated.engine import Simulation

    def ds(xs, ys):
        return Dataset.from_dict({"pixel_values": xs, "labels": ys}).with_format("torch")

    train = ([[1.0, 0.0], [0.0, 1.0]], [0, 2])
    vals = [train, ([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], [0, 2, 1])]
    clients = [ClientData(i, ds(*train), ds(*train), ds(*vals[i]) if val else None) for i in range(2)]
    fed = FederatedData(clients, [], ds(*train), None, 3, ["a", "b", "c"], 1, 1)
    run = dict(method="tiny_fedbabu", num_rounds=1, batch_size=8, lr=0.7, momentum=0.0, progress=False,
               checkpoint_every=0, overwrite_output_dir=True, output_dir=str(tmp_path / "babu"))
    return Simulation(RunArguments(**run), None, cfg, fed_data=fed)


def _val_loss_by_hand(params, xs, ys):
    W, V, b = params
    z = (torch.tensor(xs, dtype=torch.float64) @ W.T) @ V.T + b
    return float(-torch.log_softmax(z, 1)[torch.arange(len(ys)), torch.tensor(ys)].mean())


def test_fedbabu_lr_grid_picks_each_clients_lr_on_its_validation_split(tmp_path):
    """Grid 0.1, 1, 3; one fine-tuning epoch = one full-batch SGD step from (W0, V0, B0) (:func:`_one_sgd_step`). Every
    candidate classifies all validation points as before (client 0: 2/2, client 1: 2/3), so the validation CE
    decides. By hand: client 0's val CE 0.6862, 0.3891, 0.2105 -> lr 3; client 1's 1.3848, 1.9927, 4.1050 -> lr 0.1.
    The personal model is one step at that lr -- not at the run's lr 0.7, not at one lr for both clients."""
    xs, ys = [[1.0, 0.0], [0.0, 1.0]], [0, 2]
    hand = {0: (0.6862, 0.3891, 0.2105), 1: (1.3848, 1.9927, 4.1050)}
    vals = {0: (xs, ys), 1: ([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], [0, 2, 1])}
    for cid, expected in hand.items():
        got = [_val_loss_by_hand(_one_sgd_step(xs, ys, lr), *vals[cid]) for lr in (0.1, 1.0, 3.0)]
        assert got == pytest.approx(expected, abs=1e-4)
    sim = _babu_sim(tmp_path, FedBABUConfig(finetune_epochs=1, finetune_lr_grid="0.1,1,3"))
    algo = sim.algorithm
    server = algo.init_server_state()   # (W0: taken once, before any fine-tune moves the model)
    for cid, lr in ((0, 3.0), (1, 0.1)):
        model = algo.load_personal(cid, server, algo.init_private_state(cid), 1)
        W, V, b = _one_sgd_step(xs, ys, lr=lr)
        assert torch.allclose(model.body.weight.double(), W, atol=1e-6)
        assert torch.allclose(model.classifier.weight.double(), V, atol=1e-6)
        assert torch.allclose(model.classifier.bias.double(), b, atol=1e-6)


def test_fedbabu_lr_grid_needs_a_validation_split_and_excludes_a_fixed_lr(tmp_path):
    with pytest.raises(ValueError, match="--finetune_lr_grid .*--val_fraction"):
        _babu_sim(tmp_path, FedBABUConfig(finetune_lr_grid="0.1,1"), val=False)
    with pytest.raises(ValueError, match="--finetune_lr and --finetune_lr_grid"):
        FedBABUConfig(finetune_lr=0.1, finetune_lr_grid="0.1,1")
    with pytest.raises(ValueError, match="--finetune_lr_grid"):
        FedBABUConfig(finetune_lr_grid="0.1,-1")


def test_fedbabu_lr_grid_trials_are_the_final_fine_tune_at_each_lr(tmp_path):
    """--finetune_part head, tau = 2: every trial of the grid and the final fine-tune train the same parameters (the
    head alone), for tau epochs, on the fine-tuning's own stream ("finetune"); only the lr differs (0.1, 1, 3, then
    the pick). A trial that trained the whole model, or one local epoch, would score another model than it keeps."""
    sim = _babu_sim(tmp_path, FedBABUConfig(finetune_epochs=2, finetune_part="head", finetune_lr_grid="0.1,1,3"))
    algo, calls = sim.algorithm, []
    real = algo.local_train

    def spy(cid, r, hp=None, params=None, epochs=None, tag="", **kw):
        calls.append((cid, r, hp.lr, sorted(id(p) for p in params), epochs, tag))
        return real(cid, r, hp=hp, params=params, epochs=epochs, tag=tag, **kw)
    algo.local_train = spy
    algo.load_personal(0, algo.init_server_state(), algo.init_private_state(0), 1)
    head = sorted(id(p) for p in (algo.model.classifier.weight, algo.model.classifier.bias))
    assert [c[2] for c in calls[:3]] == [0.1, 1.0, 3.0] and len(calls) == 4
    assert all(c[:2] == (0, 1) and c[3] == head and c[4] == 2 and c[5] == "finetune" for c in calls)
