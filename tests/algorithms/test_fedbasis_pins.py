"""FedBasis pinned against hand values (paper: "Learning Shareable Bases for Personalized Federated Image
Classification"). Every expected number is written out here: the combination theta = 1/2 v' + 1/2 sum_k alpha_k v_k
(Sec. 4.4, major basis) and the gradients of Eq. 8 (grad_{v_k} L = 1/2 alpha_k grad_theta L with the major basis;
for K = 2 at alpha = softmax(psi), d theta / d psi_1 = 1/2 alpha_1 alpha_2 (v_1 - v_2) = -d theta / d psi_2) are
applied to grad_theta L, the cross-entropy gradient of ONE network of the template architecture at the combined
parameters (autograd through the plain network, never through FedBasis' own combination). One SGD step per phase
(local_steps 1, momentum 0) makes each phase's result a single hand-checkable update. Server side (uniform mean,
k-means warm start, diagnostics) on hand tensors with a stub context."""
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import capture_training_batches
from torch.func import functional_call

from hfpfl.algorithms import fedbasis as fb
from hfpfl.algorithms.base import GLOBAL, MODEL, PRIVATE, Update
from hfpfl.models.cond_norm_resnet import CondNormResNetForImageClassification
from hfpfl.training.tensor_data import TensorData

GROUPS = ["fc", "layer1", "layer2", "layer3", "layer4"]


def _group(name):
    """Sec. 4.4 grouping for depths 1,1,1,1: stem + stage 1 -> layer1, block i -> layer{i+1}, the rest (head) -> fc."""
    if name.startswith("stem_"):
        return "layer1"
    if name.startswith("blocks."):
        return f"layer{int(name.split('.')[1]) + 1}"
    return "fc"


def _sim(run_sim, lr_coef=0.5, client_hp=None, **cfg):
    c = fb.FedBasisConfig(**{**dict(num_bases=2, widths="4,4,8,8", warm_fraction=0.5, lr_coef=lr_coef,
                                    temperature=0.1), **cfg})
    sim = run_sim("fedbasis", method_config=c, run=False, num_rounds=2, lr=0.01, momentum=0.0,
                  output_dir="fbp")[0]
    # what Simulation.step(client_hparams=...) installs for a round (FedPop's per-client vector): client 0's own lr
    # and step count differ from the run's, so reading another client's hyperparameters shows in the numbers
    sim._client_hp_overrides = client_hp if client_hp is not None else {0: {"lr": 0.05, "local_steps": 1}}
    return sim


def _toy_bases(sim):
    """v' = the initial network, v_1 = v' + 0.1 n_1, v_2 = v' - 0.1 n_2 (seeded noise): three known, distinct bases."""
    g = torch.Generator().manual_seed(4)
    down = {}
    for k, v in sim.algorithm.init_server_state()[MODEL].items():
        if k.startswith("bases.0."):
            down[k] = v.clone()
            n1, n2 = torch.randn(v.shape, generator=g), torch.randn(v.shape, generator=g)
            down[k.replace("bases.0.", "bases.1.", 1)] = v + 0.1 * n1
            down[k.replace("bases.0.", "bases.2.", 1)] = v - 0.1 * n2
    return down


def _basis(down, b):
    return {k.split(".", 2)[2].replace("__", "."): v for k, v in down.items() if k.startswith(f"bases.{b}.")}


def _grad_theta(template, theta, x, y):
    """Cross-entropy and its gradient w.r.t. the parameters of one plain network at theta."""
    params = {n: t.detach().clone().requires_grad_(True) for n, t in theta.items()}
    loss = F.cross_entropy(functional_call(template, params, (x,)).logits, y)
    grads = torch.autograd.grad(loss, list(params.values()))
    return float(loss.detach()), dict(zip(params, grads))


def _combine(v0, v1, v2, a):
    """theta[p] = 1/2 v'[p] + 1/2 (a_g[0] v_1[p] + a_g[1] v_2[p]), a_g the coefficients of p's group."""
    return {n: 0.5 * v0[n] + 0.5 * (a[_group(n)][0] * v1[n] + a[_group(n)][1] * v2[n]) for n in v0}


def _psi_step(g0, v1, v2, lr):
    """One SGD step on psi from 0 (alpha = (1/2, 1/2), temperature 1): dL/dpsi_1 = sum_{p in g} <grad_theta[p],
    1/2 * 1/2 * 1/2 (v_1 - v_2)[p]> = -dL/dpsi_2."""
    d = {grp: 0.0 for grp in GROUPS}
    for n, g in g0.items():
        d[_group(n)] += 0.125 * float((g.double() * (v1[n] - v2[n]).double()).sum())
    return {grp: [-lr * d[grp], lr * d[grp]] for grp in GROUPS}


def _template(sim):
    return CondNormResNetForImageClassification(sim.model.config).train()


def _close(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-6, msg=lambda m: f"{what}: {m}")


def _assert_one_joint_step(sim, upd, seen, bases, psi_lr):
    """One joint SGD step from psi = 0 (alpha = (1/2, 1/2)) on the one captured batch: psi by :func:`_psi_step` at
    ``psi_lr``, v' -= 0.05 * 1/2 G, v_k -= 0.05 * 1/4 G, G at theta = 1/2 v' + 1/4 (v_1 + v_2); the loss reported."""
    v0, v1, v2 = bases
    loss, G = _grad_theta(_template(sim), _combine(v0, v1, v2, {grp: (0.5, 0.5) for grp in GROUPS}), *seen[0])
    psi = _psi_step(G, v1, v2, lr=psi_lr)
    for grp in GROUPS:
        _close(upd.private[MODEL][f"coef.{grp}"], torch.tensor(psi[grp]), f"psi {grp}")
    for n in v0:
        key = n.replace(".", "__")
        _close(upd.upload[MODEL][f"bases.0.{key}"], v0[n] - 0.05 * 0.5 * G[n], f"v' {n}")
        _close(upd.upload[MODEL][f"bases.1.{key}"], v1[n] - 0.05 * 0.25 * G[n], f"v_1 {n}")
        _close(upd.upload[MODEL][f"bases.2.{key}"], v2[n] - 0.05 * 0.25 * G[n], f"v_2 {n}")
    assert upd.metrics["train_loss"] == pytest.approx(loss, rel=1e-4)


def test_improved_round_coordinate_descent_and_sharpening_by_hand(run_sim):
    """Sec. 4.2 Eq. 9 / Algorithm 1, one client round, one SGD step per phase. Step 1: psi <- 0 (the stored (3, -3)
    is discarded). Step 2 (alpha = softmax(psi), bases frozen, lr_coef = 0.5): psi_g = -/+ 0.5 * 1/8 <grad_theta_g,
    v_1 - v_2> by hand. Step 3: alpha_dagger = exp(psi / 0.1) / sum by math.exp. Step 4 (alpha_dagger frozen, the
    client's lr 0.05): v' -= 0.05 * 1/2 G, v_k -= 0.05 * 1/2 alpha_dagger_k G (Eq. 8 with the major basis; G the
    gradient at the sharpened combination). The upload is the new bases, the private state step 2's psi, the metrics
    the two phases' losses."""
    sim = _sim(run_sim)
    algo, m = sim.algorithm, sim.model
    down = _toy_bases(sim)
    v0, v1, v2 = (_basis(down, b) for b in range(3))
    seen = capture_training_batches(m)
    private = {MODEL: {f"coef.{g}": torch.tensor([3.0, -3.0]) for g in GROUPS}}
    upd = algo.client_update(0, {MODEL: down}, private, 2)
    assert len(seen) == 2                                  # exactly one step of each phase (client 0: local_steps 1)
    (x1, y1), (x2, y2) = seen
    t = _template(sim)
    # step 2
    loss1, g0 = _grad_theta(t, _combine(v0, v1, v2, {grp: (0.5, 0.5) for grp in GROUPS}), x1, y1)
    psi = _psi_step(g0, v1, v2, lr=0.5)
    for grp in GROUPS:
        _close(upd.private[MODEL][f"coef.{grp}"], torch.tensor(psi[grp]), f"psi {grp}")
    assert set(upd.private[MODEL]) == {f"coef.{g}" for g in GROUPS}
    # step 3
    sharp = {grp: (1 / (1 + math.exp((p[1] - p[0]) / 0.1)), 1 / (1 + math.exp((p[0] - p[1]) / 0.1)))
             for grp, p in psi.items()}
    # step 4
    loss2, G = _grad_theta(t, _combine(v0, v1, v2, sharp), x2, y2)
    for n in v0:
        a = sharp[_group(n)]
        key = n.replace(".", "__")
        _close(upd.upload[MODEL][f"bases.0.{key}"], v0[n] - 0.05 * 0.5 * G[n], f"v' {n}")
        _close(upd.upload[MODEL][f"bases.1.{key}"], v1[n] - 0.05 * 0.5 * a[0] * G[n], f"v_1 {n}")
        _close(upd.upload[MODEL][f"bases.2.{key}"], v2[n] - 0.05 * 0.5 * a[1] * G[n], f"v_2 {n}")
    assert set(upd.upload[MODEL]) == set(down)
    assert upd.metrics["train_loss"] == pytest.approx(loss2, rel=1e-4)
    assert upd.metrics["alpha_train_loss"] == pytest.approx(loss1, rel=1e-4)
    assert m.fixed_alpha is None and m.temperature == 1.0
    assert all(p.requires_grad for p in m.parameters())     # trainability restored after each phase


def test_naive_round_is_one_joint_step_at_temperature_one_by_hand(run_sim):
    """Sec. 4.2 Eq. 7 (the collapse baseline): psi <- 0, then ONE joint SGD step, alpha = softmax(psi) unsharpened,
    with two optimizer groups: psi at lr_coef 0.5 (the improved training's coefficient lr: the two trainings differ
    in their schedule alone) and every basis at the client's lr 0.05: psi_g = -/+ 0.5 * 1/8 <G_g, v_1 - v_2>,
    v' -= 0.05 * 1/2 G, v_k -= 0.05 * 1/4 G (alpha = 1/2 each), G at theta = 1/2 v' + 1/4 (v_1 + v_2)."""
    sim = _sim(run_sim, training="naive")
    down = _toy_bases(sim)
    v0, v1, v2 = (_basis(down, b) for b in range(3))
    seen = capture_training_batches(sim.model)
    groups, orig = [], sim.ctx.train
    names = {id(p): n for n, p in sim.model.named_parameters()}

    def spy(*a, **kw):
        groups.extend((g["lr"], {names[id(p)] for p in g["params"]}) for g in kw["params"])
        return orig(*a, **kw)

    sim.ctx.train = spy
    private = {MODEL: {f"coef.{g}": torch.tensor([3.0, -3.0]) for g in GROUPS}}
    upd = sim.algorithm.client_update(0, {MODEL: down}, private, 2)
    assert len(seen) == 1
    assert groups == [(0.5, {f"coef.{g}" for g in GROUPS}), (0.05, set(down))]
    _assert_one_joint_step(sim, upd, seen, (v0, v1, v2), psi_lr=0.5)


def test_warm_round_is_fedavg_on_the_major_basis_alone_by_hand(run_sim):
    """Sec. 4.4 warm start: in a warm-start round the network is v' alone (no 1/2 mixing): one SGD step
    v' -= 0.05 * grad L(v'); only v' travels, psi is reset to 0 and kept as the private state; the metrics are that
    step's loss; afterwards the model mixes the bases again."""
    sim = _sim(run_sim)
    down = _toy_bases(sim)
    v0 = _basis(down, 0)
    seen = capture_training_batches(sim.model)
    private = {MODEL: {f"coef.{g}": torch.tensor([3.0, -3.0]) for g in GROUPS}}
    upd = sim.algorithm.client_update(0, {MODEL: down}, private, 1)
    assert len(seen) == 1
    loss, G = _grad_theta(_template(sim), v0, *seen[0])
    assert set(upd.upload[MODEL]) == {k for k in down if k.startswith("bases.0.")}
    for n in v0:
        _close(upd.upload[MODEL][f"bases.0.{n.replace('.', '__')}"], v0[n] - 0.05 * G[n], f"v' {n}")
    assert all(torch.equal(upd.private[MODEL][f"coef.{g}"], torch.zeros(2)) for g in GROUPS)
    assert set(upd.private[MODEL]) == {f"coef.{g}" for g in GROUPS}
    assert upd.metrics["train_loss"] == pytest.approx(loss, rel=1e-4)
    assert sim.model.major_only is False


@pytest.mark.parametrize("training,phases", [("improved", {"alpha": 2, "bases": 3}), ("naive", {"joint": 3})])
def test_each_phase_runs_its_own_number_of_epochs(run_sim, training, phases):
    """alpha_epochs = 2 and basis_epochs = 3 passes over the client's data (the run's --local_epochs 1 does not
    apply; local_steps unset), batch 64: steps = epochs * ceil(n / 64) per phase, and the update reports the sum of
    the phases' steps and examples as its budget; the warm round runs basis_epochs."""
    sim = _sim(run_sim, client_hp={}, training=training, alpha_epochs=2, basis_epochs=3)
    sim.args = sim.args.__class__(**{**sim.args.__dict__, "batch_size": 64})
    per_epoch = math.ceil(len(sim.train_data(0)) / 64)
    steps, orig = {}, sim.ctx.train

    def spy(*a, **kw):
        out = orig(*a, **kw)
        steps[kw["tag"]] = out["steps"]
        return out

    sim.ctx.train = spy
    down = _toy_bases(sim)
    upd = sim.algorithm.client_update(0, {MODEL: down}, None, 2)
    assert steps == {k: e * per_epoch for k, e in phases.items()}
    # the round's budget counts every phase: (2 + 3) or 3 epochs of steps and of the client's n examples
    epochs = sum(phases.values())
    assert upd.metrics["steps"] == epochs * per_epoch
    assert upd.metrics["examples"] == epochs * len(sim.train_data(0))
    steps.clear()
    sim.algorithm.client_update(0, {MODEL: down}, None, 1)
    assert steps == {"warm": 3 * per_epoch}


def test_init_server_state_anchor_is_the_non_major_bases(run_sim):
    """The collapse diagnostic's anchor (Sec. 4.2 / Fig. 2 quantities) holds exactly v_1..v_K, never v'."""
    algo = _sim(run_sim).algorithm
    st = algo.init_server_state()
    assert set(st[fb.ANCHOR]) == {k for k in st[MODEL] if k.startswith(("bases.1.", "bases.2."))}
    assert all(torch.equal(st[fb.ANCHOR][k], st[MODEL][k]) for k in st[fb.ANCHOR])


# ---------------------------------------------------------------------------------------------- new clients
@pytest.mark.parametrize("mode", ["coef", "head", "full"])
def test_new_client_one_step_by_hand(run_sim, mode):
    """Algorithm 2 (mode coef): psi <- 0, one SGD step on psi alone at lr_coef 0.5 on the data passed in:
    psi_g = -/+ 0.5 * 1/8 <G_g, v_1 - v_2>, every basis bitwise unchanged. Sec. 6 protocol (mode head): also the
    major basis' classifier at lr_full 0.2, W -= 0.2 * 1/2 G_W. Mode full: every basis at lr_full (v' -= 0.2 * 1/2 G,
    v_k -= 0.2 * 1/4 G). The new client's own batch size (4) applies; trainability is restored afterwards."""
    sim = _sim(run_sim, new_client_steps=1, new_client_mode=mode, lr_full=0.2)
    cid = sim.num_clients
    sim._client_hp_overrides = {cid: {"batch_size": 4}}
    down = _toy_bases(sim)
    v0, v1, v2 = (_basis(down, b) for b in range(3))
    state = {**sim.algorithm.init_server_state(), MODEL: down}
    data = sim.train_data(1)                               # not the new client's own split: the data passed is used
    seen = capture_training_batches(sim.model)
    with torch.no_grad():
        for p in sim.model.coef.values():
            p.fill_(7.0)                                   # whatever psi the model held: a new client starts at 0
    model = sim.algorithm.personalize_new_client(cid, state, data, 2)
    assert len(seen) == 1 and len(seen[0][1]) == 4
    rows = {x.numpy().tobytes() for x in data.columns["pixel_values"]}
    assert all(x.numpy().tobytes() in rows for x in seen[0][0])
    _, G = _grad_theta(_template(sim), _combine(v0, v1, v2, {grp: (0.5, 0.5) for grp in GROUPS}), *seen[0])
    psi = _psi_step(G, v1, v2, lr=0.5)
    st = model.state_dict()
    for grp in GROUPS:
        _close(st[f"coef.{grp}"], torch.tensor(psi[grp]), f"psi {grp}")
    for n in v0:
        key = n.replace(".", "__")
        moves = mode == "full" or (mode == "head" and n.startswith("classifier."))
        for b, v, share in ((0, v0, 0.5), (1, v1, 0.25), (2, v2, 0.25)):
            k = f"bases.{b}.{key}"
            if moves and (b == 0 or mode == "full"):
                _close(st[k], v[n] - 0.2 * share * G[n], k)
            else:
                assert torch.equal(st[k], down[k]), k
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("steps", [0, 1])
def test_new_client_steps_zero_means_no_adaptation(run_sim, steps):
    """new_client_steps 0: the server's bases with psi = 0 (uniform alpha) and no training call; 1: one call."""
    sim = _sim(run_sim, new_client_steps=steps)
    calls, orig = [], sim.ctx.train
    sim.ctx.train = lambda *a, **kw: calls.append(kw["steps"]) or orig(*a, **kw)
    down = _toy_bases(sim)
    with torch.no_grad():
        for p in sim.model.coef.values():
            p.fill_(7.0)
    model = sim.algorithm.personalize_new_client(sim.num_clients, {MODEL: down}, sim.train_data(sim.num_clients), 2)
    assert calls == ([1] if steps else [])
    if not steps:
        st = model.state_dict()
        assert all(torch.equal(st[k], down[k]) for k in down)
        assert all(torch.equal(st[f"coef.{g}"], torch.zeros(2)) for g in GROUPS)


def _stub_algo(num_rounds=4, keys=None, privates=None, **cfg):
    seeds = []
    ctx = SimpleNamespace(run=SimpleNamespace(num_rounds=num_rounds), num_clients=len(privates or {}),
                          private_state=lambda i: (privates or {}).get(i), gather=lambda items: list(items),
                          seed_for=lambda r, i, tag="": seeds.append((r, i, tag)) or 1234,
                          keys=lambda role: (keys or {}).get(role, []))
    algo = fb.FedBasis(ctx, fb.FedBasisConfig(**{**dict(num_bases=2, warm_fraction=0.5), **cfg}))
    return algo, seeds


def test_new_client_keys_by_mode():
    """What a new client tunes: coef = the coefficients (Algorithm 2); head = + v''s classifier (Sec. 6: "the
    combinations and the whole classifier"); full = + every basis."""
    keys = {PRIVATE: ["coef.fc", "coef.layer1"],
            GLOBAL: ["bases.0.classifier__weight", "bases.0.stem_conv__weight", "bases.1.classifier__weight"]}
    assert _stub_algo(keys=keys)[0].new_client_keys() == ["coef.fc", "coef.layer1"]
    assert _stub_algo(keys=keys, new_client_mode="head")[0].new_client_keys() == \
        ["coef.fc", "coef.layer1", "bases.0.classifier__weight"]
    assert _stub_algo(keys=keys, new_client_mode="full")[0].new_client_keys() == keys[PRIVATE] + keys[GLOBAL]


@pytest.mark.parametrize("fraction,rounds,warm", [(0.3, 10, 3), (0.3, 2, 1), (0.5, 2, 1), (0.0, 5, 0), (0.5, 1, 0),
                                                  (0.25, 4, 1), (1.0, 4, 4), (0.9, 10, 9), (0.2, 3, 1)])
def test_warm_rounds_by_hand(fraction, rounds, warm):
    """Sec. 4.4: floor(warm_fraction * T) FedAvg rounds, at least one when T >= 2 and the fraction is > 0."""
    assert _stub_algo(num_rounds=rounds, warm_fraction=fraction)[0].warm_rounds() == warm


def _ups(vals, key_names=("bases.0.w", "bases.0.b"), sizes=None):
    out = []
    for i, v in enumerate(vals):
        w = torch.tensor(v[:2], dtype=torch.float32)
        b = torch.tensor(v[2:], dtype=torch.float32)
        out.append(Update(i, {MODEL: dict(zip(key_names, (w, b)))}, (sizes or [1] * len(vals))[i]))
    return out


def _server(anchor_val=9.0):
    st = {f"bases.{b}.w": torch.full((2,), float(b)) for b in range(3)}
    st.update({f"bases.{b}.b": torch.full((1,), float(b)) for b in range(3)})
    return {MODEL: st, fb.ANCHOR: {k: torch.full_like(v, anchor_val) for k, v in st.items()
                                   if not k.startswith("bases.0.")}}


def test_aggregate_warm_rounds_uniform_mean_copied_to_every_basis():
    """Sec. 4.2 / 4.4: during the warm start (round 1 of 2 warm rounds) v' = the uniform 1/M mean of the uploaded
    v' (sizes 1, 5, 10 ignored): (1 + 3 + 8) / 3 = 4; every v_k follows it (a copy), the anchor is untouched,
    no k-means is drawn."""
    algo, seeds = _stub_algo()
    ups = _ups([[1, 2, 0], [3, 4, 3], [8, 0, 6]], sizes=[1, 5, 10])
    srv = _server()
    new = algo.aggregate(srv, ups, 1)
    for b in range(3):
        assert torch.equal(new[MODEL][f"bases.{b}.w"], torch.tensor([4.0, 2.0]))
        assert torch.equal(new[MODEL][f"bases.{b}.b"], torch.tensor([3.0]))
    assert new[MODEL]["bases.1.w"] is not new[MODEL]["bases.2.w"]
    assert new[fb.ANCHOR] is srv[fb.ANCHOR] and seeds == []
    assert algo.aggregate(srv, [], 1) is srv


def test_aggregate_last_warm_round_sets_bases_to_kmeans_centroids(monkeypatch):
    """Sec. 4.4: at the last warm round v' = the mean (5, 5, 6) and v_b = centroid b of the k-means of the flattened
    local models (rows (w, b) in upload order, float64), split back over the keys in upload order, in the model's
    dtype; the anchor becomes the new v_1..v_K. The draw is keyed to the round alone (client slot 0, tag
    "kmeans"), the same on every process."""
    algo, seeds = _stub_algo()
    got = {}

    def stub(X, k, seed):
        got.update(X=X, k=k, seed=seed)
        return torch.tensor([[10.0, 11.0, 12.0], [-1.0, -2.0, -3.0]], dtype=torch.float64)

    monkeypatch.setattr(fb, "_kmeans", stub)
    rows = [[0, 0, 0], [0, 0, 2], [10, 10, 10], [10, 10, 12]]
    new = algo.aggregate(_server(), _ups(rows), 2)
    assert torch.equal(got["X"], torch.tensor(rows, dtype=torch.float64)) and got["k"] == 2
    assert seeds == [(2, 0, "kmeans")] and got["seed"] == 1234
    s = new[MODEL]
    assert torch.equal(s["bases.0.w"], torch.tensor([5.0, 5.0])) and torch.equal(s["bases.0.b"], torch.tensor([6.0]))
    assert torch.equal(s["bases.1.w"], torch.tensor([10.0, 11.0])) and torch.equal(s["bases.1.b"], torch.tensor([12.0]))
    assert torch.equal(s["bases.2.w"], torch.tensor([-1.0, -2.0])) and torch.equal(s["bases.2.b"], torch.tensor([-3.0]))
    assert all(s[k].dtype == torch.float32 for k in s)
    assert set(new[fb.ANCHOR]) == {"bases.1.w", "bases.1.b", "bases.2.w", "bases.2.b"}
    assert all(torch.equal(new[fb.ANCHOR][k], s[k]) for k in new[fb.ANCHOR])


def test_aggregate_after_warm_start_is_the_basis_wise_uniform_mean():
    """Sec. 4.2 (Algorithm 1, last line): V <- (1/M) sum_m V_m basis by basis; anchor untouched; one upload: itself."""
    algo, seeds = _stub_algo()
    keys = [f"bases.{b}.{n}" for b in range(3) for n in ("w", "b")]
    ups = [Update(i, {MODEL: {k: torch.full((2,) if k.endswith("w") else (1,), float(i * 10 + j))
                              for j, k in enumerate(keys)}}, 1 + 10 * i) for i in range(2)]
    srv = _server()
    new = algo.aggregate(srv, ups, 3)
    for j, k in enumerate(keys):
        assert torch.equal(new[MODEL][k], torch.full_like(srv[MODEL][k], 5.0 + j))   # (j + (10 + j)) / 2
    assert new[fb.ANCHOR] is srv[fb.ANCHOR] and seeds == []
    one = algo.aggregate(srv, ups[1:], 3)
    assert all(torch.equal(one[MODEL][k], ups[1].upload[MODEL][k]) for k in keys)


def test_kmeans_by_hand():
    """Plain Lloyd: two clusters {0, 1}, {10, 11} -> centroids 0.5, 10.5 whatever the seed (some seeds start both
    centroids in one cluster); three rows, k = 3 -> each row its own centroid; a duplicate-heavy set whose start
    leaves a cluster empty still ends at {0, 6}; k > rows: the rows repeated in a seeded order (the same for the
    same seed, whatever the global RNG)."""
    two = torch.tensor([[0.0], [1.0], [10.0], [11.0]], dtype=torch.float64)
    three = torch.tensor([[0.0], [10.0], [20.0]], dtype=torch.float64)
    dup = torch.tensor([[0.0], [0.0], [0.0], [6.0]], dtype=torch.float64)
    for seed in range(8):
        assert sorted(fb._kmeans(two, 2, seed).flatten().tolist()) == [0.5, 10.5]
        assert sorted(fb._kmeans(three, 3, seed).flatten().tolist()) == [0.0, 10.0, 20.0]
        assert sorted(fb._kmeans(dup, 2, seed).flatten().tolist()) == [0.0, 6.0]
    X = torch.arange(5, dtype=torch.float64).view(5, 1)
    torch.manual_seed(1)
    a = fb._kmeans(X, 7, seed=3)
    torch.manual_seed(2)
    b = fb._kmeans(X, 7, seed=3)
    assert torch.equal(a, b) and a.shape == (7, 1)
    assert sorted(a[:5].flatten().tolist()) == [0, 1, 2, 3, 4] and torch.equal(a[5:], a[:2])
    orders = {tuple(fb._kmeans(X, 7, seed=s).flatten().tolist()) for s in range(4)}
    assert len(orders) > 1                                  # the seed picks the order


def test_extra_metrics_by_hand():
    """The collapse diagnostics (Sec. 4.2, Fig. 2) with K = 2 on hand vectors. Non-major bases v_1 = (1, 0),
    v_2 = (1, 1) (v' = (-5, 3) is left out): mean pairwise cosine 1/sqrt(2). Anchors (0, 0) and (0, -1): the
    displacements (1, 0) and (1, 2) have cosine 1/sqrt(5); reported from the last warm round on, and not while a
    displacement is 0. alpha entropy, normalised by log K: psi (0, 0) -> 1; psi (log 3, 0) -> alpha (3/4, 1/4) ->
    -(3/4 log 3/4 + 1/4 log 1/4) / log 2; clients without a state are skipped; the mean over (client, group)."""
    h = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)) / math.log(2)
    privates = {0: {MODEL: {"coef.fc": torch.zeros(2)}}, 1: None,
                2: {MODEL: {"coef.fc": torch.tensor([math.log(3.0), 0.0])}}}
    algo, _ = _stub_algo(num_rounds=4, privates=privates)
    s = {"bases.0.w": torch.tensor([-5.0, 3.0]), "bases.1.w": torch.tensor([1.0, 0.0]),
         "bases.2.w": torch.tensor([1.0, 1.0])}
    anchor = {"bases.1.w": torch.tensor([0.0, 0.0]), "bases.2.w": torch.tensor([0.0, -1.0])}
    out = algo.extra_metrics(2, {MODEL: s, fb.ANCHOR: anchor})
    assert set(out) == {"basis_cosine", "basis_update_cosine", "alpha_entropy"}
    assert out["basis_cosine"] == pytest.approx(1 / math.sqrt(2))
    assert out["basis_update_cosine"] == pytest.approx(1 / math.sqrt(5))
    assert out["alpha_entropy"] == pytest.approx((1 + h) / 2)
    assert set(algo.extra_metrics(1, {MODEL: s, fb.ANCHOR: anchor})) == {"basis_cosine", "alpha_entropy"}
    same = {k: s[k].clone() for k in anchor}                 # right after k-means: no displacement yet
    assert "basis_update_cosine" not in algo.extra_metrics(2, {MODEL: s, fb.ANCHOR: same})
    assert _stub_algo(num_bases=1)[0].extra_metrics(2, {MODEL: s}) == {}


def test_config_rejects_bad_values():
    """Every option is validated; widths and depths must have one entry per stage (the message names both)."""
    with pytest.raises(ValueError, match="num_bases"):
        fb.FedBasisConfig(num_bases=0)
    with pytest.raises(ValueError, match="--widths and --depths"):
        fb.FedBasisConfig(widths="4,4", depths="1")


def test_build_model_from_the_run_and_config():
    """One template of the run's channels / labels and the configured widths and depths, unconditional norms,
    K + 1 bases with the major basis."""
    ctx = SimpleNamespace(data=SimpleNamespace(num_channels=1), num_labels=7)
    algo = fb.FedBasis(ctx, fb.FedBasisConfig(num_bases=3, widths="4,4,8,8", depths="1,2,1,1"))
    m = algo.build_model()
    c = m.config
    assert (c.num_channels, c.hidden_sizes, c.depths, c.num_labels) == (1, [4, 4, 8, 8], [1, 2, 1, 1], 7)
    assert c.conditional is False and m.major is True and len(m.bases) == 4 and m.num_bases == 3
    assert m(torch.zeros(2, 1, 16, 16)).logits.shape == (2, 7)


# ---------------------------------------------------------------------------------- the paper's new-client protocol
def _protocol_sim(run_sim, mode, batch_size=4):
    sim = _sim(run_sim, new_client_mode=mode)
    cid = sim.num_clients
    sim._client_hp_overrides = {cid: {"batch_size": batch_size}}
    down = _toy_bases(sim)
    state = {**sim.algorithm.init_server_state(), MODEL: down}
    with torch.no_grad():
        for p in sim.model.coef.values():
            p.fill_(7.0)                                   # whatever psi the model held: a new client starts at 0
    return sim, cid, down, state


def _first(data, n):
    """The first n rows of a client's split, as a split of its own."""
    return TensorData.of(**{k: v[:n] for k, v in data.columns.items()})


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("mode,groups", [
    ("head", [(0.02, "coef"), (0.08, "bases.0.classifier")]),
    ("coef", [(0.02, "coef")]),
    ("major_ft", [(0.02, "bases.0.")]),
    ("major_lp", [(0.02, "bases.0.classifier")]),
])
def test_new_client_groups_by_mode(run_sim, mode, groups):
    """The paper's protocol trains at one grid lr (Sec. 6). head ("the combinations and the whole classifier"): the
    coefficients at lr 0.02 and v''s classifier at 4 * 0.02 = 0.08 (theta_fc = 1/2 v'_fc + ..., so that lr moves the
    combined classifier as tuning it directly at 0.02 does); coef: the coefficients; major_ft: all of v';
    major_lp: v''s classifier; each group exactly the parameters named, nothing else."""
    sim = _sim(run_sim, new_client_mode=mode)
    names = {id(p): n for n, p in sim.model.named_parameters()}
    got = [(g["lr"], {names[id(p)] for p in g["params"]}) for g in sim.algorithm.new_client_groups(0.02)]
    every = set(names.values())
    assert got == [(lr, {n for n in every if n.startswith(prefix)}) for lr, prefix in groups]


def test_new_client_curve_head_one_epoch_by_hand(run_sim):
    """Sec. 6 protocol, mode head, lr 0.02, momentum 0, 4 images at batch 4 (one step per epoch), 1 epoch: the
    start is scored first (psi = 0 whatever the model held, the server's bases), then after the epoch: psi_g =
    -/+ 0.02 * 1/8 <G_g, v_1 - v_2> and v'_classifier -= 0.08 * 1/2 G (the combined classifier moves by
    0.02 * G through v'), every other basis parameter bitwise unchanged; the curve is the score's results in
    order; trainability and train mode are restored."""
    sim, cid, down, state = _protocol_sim(run_sim, "head")
    v0, v1, v2 = (_basis(down, b) for b in range(3))
    data = _first(sim.train_data(cid), 4)
    seen = capture_training_batches(sim.model)
    states = []

    def score(model):
        states.append(_snapshot(model))
        model.eval()                                       # a scorer may switch modes: training must not care
        return len(states)

    curve = sim.algorithm.new_client_curve(cid, state, data, 2, 0.02, 1, score)
    assert curve == [1, 2] and len(seen) == 1 and len(seen[0][1]) == 4
    start, end = states
    assert all(torch.equal(start[k], down[k]) for k in down)
    assert all(torch.equal(start[f"coef.{g}"], torch.zeros(2)) for g in GROUPS)
    _, G = _grad_theta(_template(sim), _combine(v0, v1, v2, {grp: (0.5, 0.5) for grp in GROUPS}), *seen[0])
    psi = _psi_step(G, v1, v2, lr=0.02)
    for grp in GROUPS:
        _close(end[f"coef.{grp}"], torch.tensor(psi[grp]), f"psi {grp}")
    for k in down:
        n = k.split(".", 2)[2].replace("__", ".")
        if k.startswith("bases.0.classifier"):
            _close(end[k], v0[n] - 0.08 * 0.5 * G[n], k)
        else:
            assert torch.equal(end[k], down[k]), k
    assert all(p.requires_grad for p in sim.model.parameters()) and sim.model.training


@pytest.mark.parametrize("mode", ["major_ft", "major_lp"])
def test_new_client_curve_major_basis_alone_by_hand(run_sim, mode):
    """FedAvg+FT / +LP on the bases' ResNet: the network is v' alone (no 1/2 mixing) from the start's score on;
    one epoch (one step, lr 0.02): major_ft: v' -= 0.02 grad L(v'), major_lp: only v''s classifier moves; v_1,
    v_2 and psi (0) unchanged. A participant's network afterwards is the combination again."""
    sim, cid, down, state = _protocol_sim(run_sim, mode)
    v0 = _basis(down, 0)
    data = _first(sim.train_data(cid), 4)
    seen = capture_training_batches(sim.model)
    x = data.columns["pixel_values"][:2]
    outs = []

    def score(model):
        with torch.no_grad():
            outs.append((model(x).logits.clone(), _snapshot(model)))
        return None

    sim.algorithm.new_client_curve(cid, state, data, 2, 0.02, 1, score)
    t = _template(sim).eval()
    with torch.no_grad():
        _close(outs[0][0], functional_call(t, v0, (x,)).logits, "the start is v' alone")
    _, G = _grad_theta(_template(sim), v0, *seen[0])
    end = outs[1][1]
    for k in down:
        n = k.split(".", 2)[2].replace("__", ".")
        moves = k.startswith("bases.0.") and (mode == "major_ft" or n.startswith("classifier."))
        if moves:
            _close(end[k], v0[n] - 0.02 * G[n], k)
        else:
            assert torch.equal(end[k], down[k]), k
    assert all(torch.equal(end[f"coef.{g}"], torch.zeros(2)) for g in GROUPS)
    psi = {f"coef.{g}": torch.tensor([1.0 + i, -2.0]) for i, g in enumerate(GROUPS)}
    sim.algorithm.load_client({MODEL: down}, {MODEL: psi})
    assert sim.model.major_only is False
    st = sim.model.state_dict()
    assert all(torch.equal(st[k], v) for k, v in psi.items())    # a participant's own coefficients are loaded


def test_new_client_curve_scores_after_every_epoch(run_sim):
    """10 images at batch 4 with --last_batch merge: batches of 4 and 6, two steps per epoch; 3 epochs: 6 steps,
    the score read after steps 0 (the start), 2, 4, 6 -- one per epoch end, never mid-epoch; epochs 0: only the
    start, no training."""
    sim, cid, down, state = _protocol_sim(run_sim, "head")
    data = _first(sim.train_data(cid), 10)
    seen = capture_training_batches(sim.model)
    curve = sim.algorithm.new_client_curve(cid, state, data, 2, 0.02, 3, lambda m: len(seen))
    assert curve == [0, 2, 4, 6] and [len(b[1]) for b in seen] == [4, 6] * 3
    seen.clear()
    assert sim.algorithm.new_client_curve(cid, state, data, 2, 0.02, 0, lambda m: len(seen)) == [0] and seen == []


def test_best_and_last_by_hand():
    """Sec. 6 / Table 2: Last = the test score at the last epoch of the lr whose LAST-epoch validation score is
    highest; Best = the test score at the (lr, epoch >= 1) of highest validation score; test never chooses.
    Two lrs, epochs 0..2, (val, test):
      lr0: (.5, .40) (.6, .50) (.7, .55)   lr1: (.5, .40) (.9, .80) (.65, .60)
    Last: lr0 (.7 > .65) -> .55; Best: lr1 epoch 1 (.9) -> .80; start .40; per lr: lr0 last .55 best .55 (epoch 2),
    lr1 last .60 best .80."""
    curves = [[(.5, .40), (.6, .50), (.7, .55)], [(.5, .40), (.9, .80), (.65, .60)]]
    out = fb.best_and_last(curves)
    assert (out["last"], out["best"], out["start"]) == (.55, .80, .40)
    assert (out["last_lr_index"], out["best_lr_index"], out["best_epoch"]) == (0, 1, 1)
    assert out["per_lr"] == [{"last": .55, "best": .55}, {"last": .60, "best": .80}]


def test_best_and_last_ties_and_the_start():
    """Ties go to the earlier grid entry, then the earlier epoch; epoch 0 (before training) is never Best, however
    high its validation score; a higher TEST score never wins a tie (lr1's .9 / .7 lose to lr0's .4 / .3)."""
    tied = [[(.1, 0.0), (.8, .3), (.8, .4)], [(.1, 0.0), (.8, .9), (.8, .7)]]
    out = fb.best_and_last(tied)
    assert (out["last"], out["best"], out["last_lr_index"], out["best_lr_index"], out["best_epoch"]) == \
        (.4, .3, 0, 0, 1)
    assert out["per_lr"] == [{"last": .4, "best": .3}, {"last": .7, "best": .9}]
    start_high = [[(.99, .9), (.5, .2), (.4, .1)]]
    out = fb.best_and_last(start_high)
    assert (out["best"], out["best_epoch"], out["last"], out["start"]) == (.2, 1, .1, .9)
    assert out["per_lr"] == [{"last": .1, "best": .2}]                # each lr's own Best skips epoch 0 too


def test_lr_grid_parses_the_paper_grid():
    """The default grid is the paper's {0.005, 0.01, 0.05} (Table 2 caption), in order; spaces and a trailing comma
    are tolerated."""
    assert fb.FedBasisConfig().lr_grid() == [0.005, 0.01, 0.05]
    assert fb.FedBasisConfig(new_client_lr_grid=" 0.1, 0.02,").lr_grid() == [0.1, 0.02]


# ------------------------------------------------------------------------- Table 3's ablations (CD, MB, tau)
def test_joint_round_without_coordinate_descent_keeps_the_sharpening_by_hand(run_sim):
    """Table 3, row without coordinate descent (CD x, MB v, tau 0.1): psi <- 0, then ONE joint SGD step of psi (at
    lr_coef 0.5) and the bases (the client's lr 0.05) with alpha = softmax(psi / 0.1). At psi = 0, alpha = (1/2, 1/2)
    and d alpha_1 / d psi_1 = alpha_1 alpha_2 / tau = 2.5, so d theta / d psi_1 = 1/2 * 2.5 (v_1 - v_2): the psi
    step is 10 times the naive one, psi_g = -/+ 0.5 * 10 * 1/8 <G_g, v_1 - v_2>; v' -= 0.05 * 1/2 G,
    v_k -= 0.05 * 1/4 G, G at theta = 1/2 v' + 1/4 (v_1 + v_2). Afterwards the model is back at temperature 1."""
    sim = _sim(run_sim, training="joint")
    down = _toy_bases(sim)
    v0, v1, v2 = (_basis(down, b) for b in range(3))
    seen = capture_training_batches(sim.model)
    private = {MODEL: {f"coef.{g}": torch.tensor([3.0, -3.0]) for g in GROUPS}}
    upd = sim.algorithm.client_update(0, {MODEL: down}, private, 2)
    assert len(seen) == 1
    _assert_one_joint_step(sim, upd, seen, (v0, v1, v2), psi_lr=0.5 * 10)
    assert sim.model.temperature == 1.0 and sim.model.fixed_alpha is None


def _toy_bases_no_major(sim):
    """Without the major basis: bases.0 = v + 0.1 n_1, bases.1 = v - 0.1 n_2 (v the initial network, seeded noise)."""
    g = torch.Generator().manual_seed(4)
    down = {}
    for k, v in sim.algorithm.init_server_state()[MODEL].items():
        if k.startswith("bases.0."):
            n1, n2 = torch.randn(v.shape, generator=g), torch.randn(v.shape, generator=g)
            down[k] = v + 0.1 * n1
            down[k.replace("bases.0.", "bases.1.", 1)] = v - 0.1 * n2
    return down


def test_improved_round_without_the_major_basis_by_hand(run_sim):
    """Table 3, row without the major basis: theta = alpha_1 v_1 + alpha_2 v_2 (no 1/2 v'), the model holds K = 2
    bases (bases.0, bases.1). Step 2 at psi = 0: d theta / d psi_1 = alpha_1 alpha_2 (v_1 - v_2) = 1/4 (v_1 - v_2),
    psi_g = -/+ 0.5 * 1/4 <G_g, v_1 - v_2> (twice the major-basis step). Step 3: alpha_dagger = softmax(psi / 0.1).
    Step 4: v_k -= 0.05 * alpha_dagger_k G (Eq. 8 without the major basis), G at alpha_dagger_1 v_1 +
    alpha_dagger_2 v_2."""
    sim = _sim(run_sim, major_basis=False)
    m = sim.model
    assert m.major is False and len(m.bases) == 2
    down = _toy_bases_no_major(sim)
    assert set(down) == {k for k in sim.algorithm.init_server_state()[MODEL]}
    v1, v2 = _basis(down, 0), _basis(down, 1)
    seen = capture_training_batches(m)
    upd = sim.algorithm.client_update(0, {MODEL: down}, None, 2)
    assert len(seen) == 2
    (x1, y1), (x2, y2) = seen
    t = _template(sim)

    def combine(a):
        return {n: a[_group(n)][0] * v1[n] + a[_group(n)][1] * v2[n] for n in v1}

    _, g0 = _grad_theta(t, combine({grp: (0.5, 0.5) for grp in GROUPS}), x1, y1)
    d = {grp: 0.0 for grp in GROUPS}
    for n, g in g0.items():
        d[_group(n)] += 0.25 * float((g.double() * (v1[n] - v2[n]).double()).sum())
    psi = {grp: (-0.5 * d[grp], 0.5 * d[grp]) for grp in GROUPS}
    for grp in GROUPS:
        _close(upd.private[MODEL][f"coef.{grp}"], torch.tensor(psi[grp]), f"psi {grp}")
    sharp = {grp: (1 / (1 + math.exp((p[1] - p[0]) / 0.1)), 1 / (1 + math.exp((p[0] - p[1]) / 0.1)))
             for grp, p in psi.items()}
    _, G = _grad_theta(t, combine(sharp), x2, y2)
    for n in v1:
        a, key = sharp[_group(n)], n.replace(".", "__")
        _close(upd.upload[MODEL][f"bases.0.{key}"], v1[n] - 0.05 * a[0] * G[n], f"v_1 {n}")
        _close(upd.upload[MODEL][f"bases.1.{key}"], v2[n] - 0.05 * a[1] * G[n], f"v_2 {n}")


def test_without_the_major_basis_the_anchor_and_kmeans_cover_every_basis(monkeypatch):
    """Without the major basis the K bases are all non-major: at the last warm round bases.0 .. bases.K-1 become
    the k-means centroids (the FedAvg mean, carried in bases.0 during the warm start, is replaced), the anchor
    is every basis; during the warm start every basis follows the mean."""
    algo, _ = _stub_algo(major_basis=False)
    monkeypatch.setattr(fb, "_kmeans", lambda X, k, seed: torch.tensor([[10.0, 11.0, 12.0], [-1.0, -2.0, -3.0]],
                                                                      dtype=torch.float64))
    st = {f"bases.{b}.{n}": torch.full((2,) if n == "w" else (1,), float(b)) for b in range(2) for n in ("w", "b")}
    srv = {MODEL: st, fb.ANCHOR: {k: torch.full_like(v, 9.0) for k, v in st.items()}}
    rows = [[0, 0, 0], [0, 0, 2], [10, 10, 10], [10, 10, 12]]
    warm = algo.aggregate(srv, _ups(rows), 1)[MODEL]
    for b in range(2):
        assert torch.equal(warm[f"bases.{b}.w"], torch.tensor([5.0, 5.0])), b
        assert torch.equal(warm[f"bases.{b}.b"], torch.tensor([6.0])), b
    new = algo.aggregate(srv, _ups(rows), 2)
    s = new[MODEL]
    assert torch.equal(s["bases.0.w"], torch.tensor([10.0, 11.0])) and torch.equal(s["bases.0.b"], torch.tensor([12.0]))
    assert torch.equal(s["bases.1.w"], torch.tensor([-1.0, -2.0])) and torch.equal(s["bases.1.b"], torch.tensor([-3.0]))
    assert set(new[fb.ANCHOR]) == set(st)
    assert all(torch.equal(new[fb.ANCHOR][k], s[k]) for k in st)


def test_without_the_major_basis_diagnostics_use_every_basis():
    """basis_cosine over bases.0 = (1, 0) and bases.1 = (1, 1) (no major basis to leave out): 1/sqrt(2)."""
    algo, _ = _stub_algo(major_basis=False)
    s = {"bases.0.w": torch.tensor([1.0, 0.0]), "bases.1.w": torch.tensor([1.0, 1.0])}
    assert algo.extra_metrics(1, {MODEL: s})["basis_cosine"] == pytest.approx(1 / math.sqrt(2))


def test_init_server_state_anchor_without_the_major_basis(run_sim):
    """The anchor is every basis when there is no major basis."""
    st = _sim(run_sim, major_basis=False).algorithm.init_server_state()
    assert set(st[fb.ANCHOR]) == set(st[MODEL]) - {k for k in st[MODEL] if k.startswith("coef.")}
    assert any(k.startswith("bases.0.") for k in st[fb.ANCHOR])


def test_new_client_head_without_the_major_basis_tunes_every_classifier_at_k_lr(run_sim):
    """Without the major basis the classifier is sum_k alpha_k v_k,fc: a new client (head) tunes the coefficients at
    the grid lr 0.02 and every basis' classifier at K * 0.02 = 0.04 (at alpha = 1/2 each a step moves the combined
    classifier by sum_k alpha_k * 0.04 * alpha_k G = 0.02 G)."""
    sim = _sim(run_sim, new_client_mode="head", major_basis=False)
    names = {id(p): n for n, p in sim.model.named_parameters()}
    got = [(g["lr"], {names[id(p)] for p in g["params"]}) for g in sim.algorithm.new_client_groups(0.02)]
    every = set(names.values())
    assert got == [(0.02, {n for n in every if n.startswith("coef.")}),
                   (0.04, {n for n in every if n.startswith(("bases.0.classifier", "bases.1.classifier"))})]


def test_new_client_starts_at_temperature_one(run_sim):
    """A new client learns psi at temperature 1 (Algorithm 2) whatever temperature the model was left at."""
    sim = _sim(run_sim, new_client_mode="head")
    sim.model.temperature = 0.1
    sim.algorithm.new_client_start(sim.algorithm.init_server_state())
    assert sim.model.temperature == 1.0


def test_config_refuses_the_major_modes_without_the_major_basis():
    """major_ft / major_lp tune the major basis: refused in one message naming both options when there is none."""
    for mode in ("major_ft", "major_lp"):
        with pytest.raises(ValueError, match="--new_client_mode .*--major_basis"):
            fb.FedBasisConfig(major_basis=False, new_client_mode=mode)
    assert fb.FedBasisConfig(major_basis=False, new_client_mode="head").major_basis is False
    with pytest.raises(ValueError, match="training"):
        fb.FedBasisConfig(training="jointly")
