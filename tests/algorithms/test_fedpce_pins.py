"""FedPCE and its same-loop baselines pinned against hand values (paper: "FedPCE: Federated Personalized Client
Embeddings"). The local loop is run with plain SGD (momentum 0, weight decay 0) for one or two steps, so every
parameter's update is -lr_group * gradient: the gradient is the cross-entropy gradient of the same network at the
known parameters (autograd through the plain network, on the batch the loop drew), and lr_group is the per-round
cosine value written out by hand (Sec. 4.1: base / MLP / embedding learning rates, cosine decay over rounds).
PCEFedProx's proximal term mu/2 ||w - w_global||^2 (the FedProx baseline of Sec. 4) enters the second step as
mu (w_1 - w_0). Server-side pieces (unweighted mean, new-client start, embeddings for the map) on hand tensors."""
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import capture_training_batches
from torch.func import functional_call

from hfpfl.algorithms import fedpce as pce
from hfpfl.algorithms.base import MODEL, OPTIM
from hfpfl.models.cond_norm_resnet import EMBEDDING_KEY, CondNormResNetForImageClassification

TINY = dict(widths="4,4,8,8", depths="1,1,1,1", embedding_dim=4, mlp_hidden=3)


def _sim(run_sim, method="fedpce", client_hp=None, **cfg):
    c = pce.FedPCEConfig(**{**TINY, "lr_mlp": 0.02, "lr_embedding": 0.3, "min_lr": 0.001, "min_lr_embedding": 0.01,
                            **cfg})
    sim = run_sim(method, method_config=c, run=False, num_rounds=3, optimizer="sgd", momentum=0.0,
                  weight_decay=0.0, lr=0.01, output_dir=method)[0]
    # what Simulation.step(client_hparams=...) installs (FedPop's per-client vector): client 0's own lr and steps
    sim._client_hp_overrides = client_hp if client_hp is not None else {0: {"lr": 0.05, "local_steps": 1}}
    return sim


def _grad(sim, params, x, y):
    """Cross-entropy and its gradient at ``params`` for a fresh network of the run's architecture."""
    net = CondNormResNetForImageClassification(sim.model.config).train()
    p = {n: t.detach().clone().requires_grad_(True) for n, t in params.items()}
    loss = F.cross_entropy(functional_call(net, p, (x,)).logits, y)
    return float(loss.detach()), dict(zip(p, torch.autograd.grad(loss, list(p.values()))))


def _close(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-6, msg=lambda m: f"{what}: {m}")


def _cos(start, floor, r, total):
    """Sec. 4.1 cosine decay, one value per round: t = (r - 1) / (T - 1)."""
    return floor + 0.5 * (start - floor) * (1 + math.cos(math.pi * (r - 1) / (total - 1)))


def test_fedpce_local_step_by_hand_and_what_travels(run_sim):
    """One FedPCE client round (round 2 of 3, cosine at t = 1/2), one SGD step on the client's own lr 0.05 from the
    global weights and the client's stored embedding v = (0.5, -1, 0, 2) (whatever embedding the model held before):
    base weights -= 0.0255 g (= 0.001 + 1/2 (0.05 - 0.001)), MLP weights -= 0.0105 g (lr_mlp 0.02, floor 0.001),
    v -= 0.155 g_v (lr_embedding 0.3, floor 0.01). Every shared tensor travels (the new values), the embedding
    never does: it is the private state, with the loop's optimizer state; the metrics are the step's loss."""
    sim = _sim(run_sim)
    algo = sim.algorithm
    down = {MODEL: algo.init_server_state()[MODEL]}
    v = torch.tensor([0.5, -1.0, 0.0, 2.0])
    with torch.no_grad():
        sim.model.client_embedding.fill_(9.0)               # a previous client's embedding
    seen = capture_training_batches(sim.model)
    upd = algo.client_update(0, down, {MODEL: {EMBEDDING_KEY: v}}, 2)
    assert len(seen) == 1
    loss, g = _grad(sim, {**down[MODEL], EMBEDDING_KEY: v}, *seen[0])
    lr_base, lr_mlp, lr_emb = _cos(0.05, 0.001, 2, 3), _cos(0.02, 0.001, 2, 3), _cos(0.3, 0.01, 2, 3)
    assert (lr_base, lr_mlp, lr_emb) == pytest.approx((0.0255, 0.0105, 0.155))
    assert set(upd.upload) == {MODEL} and set(upd.upload[MODEL]) == set(down[MODEL])
    assert EMBEDDING_KEY not in upd.upload[MODEL]
    for k, w in down[MODEL].items():
        _close(upd.upload[MODEL][k], w - (lr_mlp if ".mlp." in k else lr_base) * g[k], k)
    assert set(upd.private) == {MODEL, OPTIM} and set(upd.private[MODEL]) == {EMBEDDING_KEY}
    _close(upd.private[MODEL][EMBEDDING_KEY], v - lr_emb * g[EMBEDDING_KEY], "embedding")
    assert upd.metrics["train_loss"] == pytest.approx(loss, rel=1e-4)


def test_pce_fedprox_proximal_term_by_hand(run_sim):
    """PCEFedProx, two SGD steps at the client's lr (round 2 of 3: 0.001 + 1/2 (0.1 - 0.001) = 0.0505), mu = 10:
    w_1 = w_0 - lr g_0 (the term is 0 at the global weights), w_2 = w_1 - lr (g_1 + mu (w_1 - w_0)), g_t the
    cross-entropy gradient at w_t on step t's batch; the reported loss is the task loss alone, (L_0 + L_1) / 2."""
    sim = _sim(run_sim, "pce_fedprox", client_hp={0: {"lr": 0.1, "local_steps": 2}}, mu=10.0)
    down = {MODEL: sim.algorithm.init_server_state()[MODEL]}
    seen = capture_training_batches(sim.model)
    upd = sim.algorithm.client_update(0, down, None, 2)
    assert len(seen) == 2
    lr = _cos(0.1, 0.001, 2, 3)
    w0 = down[MODEL]
    l0, g0 = _grad(sim, w0, *seen[0])
    w1 = {k: w0[k] - lr * g0[k] for k in w0}
    l1, g1 = _grad(sim, w1, *seen[1])
    for k in w0:
        _close(upd.upload[MODEL][k], w1[k] - lr * (g1[k] + 10.0 * (w1[k] - w0[k])), k)
    assert upd.metrics["train_loss"] == pytest.approx((l0 + l1) / 2, rel=1e-4)


def test_new_client_adapts_only_its_embedding_one_step_by_hand(run_sim):
    """FedPCE's new-client protocol (Sec. 4.3): v starts at 0, one SGD step at lr_embedding_new = 0.05 (constant,
    no cosine) on the data passed in, with the new client's own batch size (4): v = -0.05 g_v at the global
    weights; every global tensor is bitwise unchanged."""
    sim = _sim(run_sim, new_client_steps=1, lr_embedding_new=0.05)
    cid = sim.num_clients
    sim._client_hp_overrides = {cid: {"batch_size": 4}}
    state = sim.algorithm.init_server_state()
    data = sim.train_data(1)
    seen = capture_training_batches(sim.model)
    model = sim.algorithm.personalize_new_client(cid, state, data, 3)
    assert len(seen) == 1 and len(seen[0][1]) == 4
    rows = {x.numpy().tobytes() for x in data.columns["pixel_values"]}
    assert all(x.numpy().tobytes() in rows for x in seen[0][0])
    _, g = _grad(sim, {**state[MODEL], EMBEDDING_KEY: torch.zeros(4)}, *seen[0])
    st = model.state_dict()
    _close(st[EMBEDDING_KEY], -0.05 * g[EMBEDDING_KEY], "embedding")
    assert all(torch.equal(st[k], w) for k, w in state[MODEL].items())


@pytest.mark.parametrize("steps", [0, 1])
def test_new_client_steps_zero_means_no_adaptation(run_sim, steps):
    sim = _sim(run_sim, new_client_steps=steps)
    calls, orig = [], sim.ctx.train
    sim.ctx.train = lambda *a, **kw: calls.append(kw["steps"]) or orig(*a, **kw)
    sim.algorithm.personalize_new_client(sim.num_clients, sim.algorithm.init_server_state(),
                                         sim.train_data(sim.num_clients), 1)
    assert calls == ([1] if steps else [])


def _stub(method=pce.FedPCE, num_rounds=5, privates=None, gathered_extra=(), **cfg):
    ctx = SimpleNamespace(run=SimpleNamespace(num_rounds=num_rounds), num_clients=len(privates or {}),
                          private_state=lambda i: (privates or {}).get(i),
                          gather=lambda items: list(items) + list(gathered_extra),
                          initial_private={EMBEDDING_KEY: torch.zeros(2)},
                          data=SimpleNamespace(num_channels=1), num_labels=7)
    return method(ctx, pce.FedPCEConfig(**{**TINY, **cfg}))


@pytest.mark.parametrize("total,r,expect", [
    (5, 1, 0.1), (5, 3, 0.001 + 0.5 * 0.099), (5, 2, 0.001 + 0.5 * 0.099 * (1 + math.cos(math.pi / 4))),
    (5, 5, 0.001), (5, 7, 0.001), (5, 0, 0.1), (2, 2, 0.001), (1, 2, 0.1), (1, 1, 0.1)])
def test_cosine_learning_rate_by_hand(total, r, expect):
    """Sec. 4.1: lr(r) = floor + 1/2 (start - floor)(1 + cos(pi (r - 1) / (T - 1))), start 0.1, floor 0.001, clamped
    to [round 1, round T]; a one-round run stays at the start; cosine off: the start every round."""
    algo = _stub(num_rounds=total)
    assert algo._lr(0.1, 0.001, r) == pytest.approx(expect, rel=1e-12)
    assert _stub(num_rounds=total, cosine=False)._lr(0.1, 0.001, r) == 0.1


def test_adam_betas_only_for_adam(run_sim):
    """The paper's Adam betas (here 0.3, 0.8) go to adam / adamw; sgd gets no betas."""
    algo = _stub(betas="0.3,0.8")
    assert algo._extra(SimpleNamespace(optimizer="adam")) == {"betas": (0.3, 0.8)}
    assert algo._extra(SimpleNamespace(optimizer="adamw")) == {"betas": (0.3, 0.8)}
    assert algo._extra(SimpleNamespace(optimizer="sgd")) == {}


def test_param_groups_skip_frozen_tensors_and_decay_every_group(run_sim):
    """Three groups (base, MLP, embedding) each at its own cosine value (last round: the floors), a frozen tensor in
    none of them, every other tensor in exactly one."""
    sim = _sim(run_sim)
    algo = sim.algorithm
    named = dict(sim.model.named_parameters())
    named["stem_conv.weight"].requires_grad_(False)
    try:
        hp = sim.ctx.hparams(1)
        groups = algo.param_groups(3, hp)
    finally:
        named["stem_conv.weight"].requires_grad_(True)
    ids = {id(p): n for n, p in named.items()}
    names = [sorted(ids[id(p)] for p in g["params"]) for g in groups]
    assert names[2] == [EMBEDDING_KEY] and names[1] == sorted(n for n in named if ".mlp." in n)
    assert names[0] == sorted(n for n in named if ".mlp." not in n and n not in (EMBEDDING_KEY, "stem_conv.weight"))
    assert [g["lr"] for g in groups] == pytest.approx([0.001, 0.001, 0.01])


def test_unweighted_mean_weights():
    """The paper's aggregation is the plain (1/N) sum: every client weight 1, whatever its size."""
    assert _stub().aggregation_weights([3, 7]) == {3: 1.0, 7: 1.0}


def test_new_client_start_zero_and_mean_by_hand():
    """zero: the initial private values; mean: the per-coordinate mean over the clients' states ((1, 0), (0, 3) and
    (2, 0) -> (1, 1); a client without a state is skipped), in the model's dtype."""
    privates = {0: {MODEL: {EMBEDDING_KEY: torch.tensor([1.0, 0.0])}}, 1: None,
                2: {MODEL: {EMBEDDING_KEY: torch.tensor([0.0, 3.0])}},
                3: {MODEL: {EMBEDDING_KEY: torch.tensor([2.0, 0.0])}}}
    assert torch.equal(_stub(privates=privates).new_client_start(9)[EMBEDDING_KEY], torch.zeros(2))
    m = _stub(privates=privates, new_client_init="mean").new_client_start(9)[EMBEDDING_KEY]
    assert torch.equal(m, torch.tensor([1.0, 1.0])) and m.dtype == torch.float32
    assert torch.equal(_stub(privates={0: None}, new_client_init="mean").new_client_start(9)[EMBEDDING_KEY],
                       torch.zeros(2))


def test_embeddings_for_the_map_are_the_gathered_ones():
    """Before an evaluation: this process's clients' embeddings (copies; a client without a state is skipped); after
    one (extra_metrics): every process's clients, as gathered (here client 5 comes from another process)."""
    e0, e2 = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    privates = {0: {MODEL: {EMBEDDING_KEY: e0}}, 1: None, 2: {MODEL: {EMBEDDING_KEY: e2}}}
    algo = _stub(privates=privates, gathered_extra=[(5, torch.tensor([7.0, 8.0]))])
    local = algo.embeddings()
    assert sorted(local) == [0, 2] and torch.equal(local[0], e0) and torch.equal(local[2], e2)
    assert local[0] is not e0
    assert algo.extra_metrics(1, {}) == {}
    got = algo.embeddings()
    assert sorted(got) == [0, 2, 5] and torch.equal(got[5], torch.tensor([7.0, 8.0]))


@pytest.mark.parametrize("method,conditional", [(pce.FedPCE, True), (pce.PCEFedAvg, False)])
def test_build_model_from_the_run_and_config(method, conditional):
    m = _stub(method, widths="4,4,8,8", depths="1,2,1,1", embedding_dim=5, mlp_hidden=6).build_model()
    c = m.config
    assert (c.num_channels, c.hidden_sizes, c.depths, c.num_labels) == (1, [4, 4, 8, 8], [1, 2, 1, 1], 7)
    assert c.conditional is conditional and c.embedding_dim == 5 and c.mlp_hidden == 6


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="embedding_dim"):
        pce.FedPCEConfig(embedding_dim=0)
    with pytest.raises(ValueError, match="--widths and --depths"):
        pce.FedPCEConfig(widths="4,4", depths="1")


def test_pce_fedprox_anchor_is_a_copy_on_the_training_device():
    """The proximal anchor w_global is the download as received, copied onto the training device (ctx.device): a
    model on another device (meta here, standing in for an accelerator) gets its term there; on the CPU, with
    mu = 4, w = (3, 0), w_global = (1, 2): 4/2 ((3 - 1)^2 + (0 - 2)^2) = 16, unchanged when the caller later edits
    its download tensors in place."""
    down = {MODEL: {"w": torch.tensor([1.0, 2.0])}}
    algo = _stub(pce.PCEFedProx, mu=4.0)
    algo.ctx.device = torch.device("meta")
    net = torch.nn.Module()
    net.w = torch.nn.Parameter(torch.zeros(2, device="meta"))
    assert algo.bind_hooks(0, down, None)["regularizer"](net).device.type == "meta"
    algo.ctx.device = torch.device("cpu")
    reg = algo.bind_hooks(0, down, None)["regularizer"]
    net.w = torch.nn.Parameter(torch.tensor([3.0, 0.0]))
    down[MODEL]["w"].add_(100.0)
    assert float(reg(net).detach()) == 16.0
