"""FRAug (spec fraug_feddat.md 1.11 acceptance checks 1-9): shapes, parameter-count formulas, schedules, EMA isolation,
gradient isolation of every loss, loss signs, MMD sanity, communication, determinism; plus resume and the ablations'
key roles. Each check is one that a wrong implementation (missing detach, wrong sign, RTNet uploaded, ...) fails."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from conftest import CPU_ONLY, CPU_PROCESSES, LAUNCH_TWO

from hfpfl.algorithms.base import MODEL, PRIVATE
from hfpfl.algorithms.fraug import FRAugConfig, FRAugStages, ema_update, lambda_c, lambda_syn
from hfpfl.models import build_classifier
from hfpfl.models.fraug import (DigitsCNN, EmbeddingGenerator, FRAugModel, RTNet, entropy, generator_num_parameters,
                                mmd, rtnet_num_parameters)

ROOT = Path(__file__).resolve().parents[2]


def n_params(m):
    return sum(p.numel() for p in m.parameters())


# ------------------------------------------------------------------------------------------------ 1. shapes
def test_shapes_and_output_ranges():
    torch.manual_seed(0)
    g, m = EmbeddingGenerator(8, 10, 24), RTNet(24, 8)
    z, y = torch.randn(16, 8), torch.arange(16) % 10
    v = g(z, y)
    assert v.shape == (16, 24) and bool((v >= 0).all())           # ends in BN + ReLU
    assert isinstance(g.net[-1], nn.ReLU) and isinstance(g.net[-2], nn.BatchNorm1d)
    r = m(v)
    assert r.shape == (16, 24) and bool((r < 0).any()) and bool((r > 0).any())  # signed residual
    assert isinstance(m.net[-1], nn.BatchNorm1d)                  # no final activation
    mc = RTNet(24, 8, num_labels=10, label_conditioned=True)     # the code's variant: concat(v, onehot(y))
    assert mc(v, y).shape == (16, 24) and mc.net[0].in_features == 34


# ------------------------------------------------------------------------------------------------ 2. parameter counts
def test_parameter_count_formulas():
    assert generator_num_parameters(256, 10, 512) == 401_408
    assert generator_num_parameters(256, 7, 512) == 399_872
    assert generator_num_parameters(128, 65, 512) == 364_032
    assert rtnet_num_parameters(512, 256) == 264_448 and rtnet_num_parameters(512, 128) == 132_992
    for d_z, c in ((256, 10), (32, 10)):
        g = EmbeddingGenerator(d_z, c, 512)
        assert n_params(g) == generator_num_parameters(d_z, c, 512)
        assert not list(g.buffers())          # BN affine counted; no running statistics (nothing dead travels)
    assert n_params(RTNet(512, 256)) == 264_448 and not list(RTNet(512, 256).buffers())
    assert n_params(DigitsCNN(10)) == 18_151_370


# ------------------------------------------------------------------------------------------------ 3. schedules
def test_schedules():
    R = 200
    assert lambda_syn(R, R) == 1.0 and math.isclose(lambda_syn(0, R), math.exp(-0.01 * R))
    assert math.isclose(lambda_syn(1, R), 0.1367, abs_tol=5e-4) and math.isclose(lambda_syn(100, R), 0.3679, abs_tol=5e-4)
    assert all(lambda_c(r, R) == 0.3 for r in range(10, 201))      # r_0 = 0.05 R = 10
    ramp = [lambda_c(r, R) for r in range(0, 10)]
    assert all(a < b for a, b in zip(ramp, ramp[1:])) and ramp[-1] < 0.3
    assert math.isclose(lambda_c(1, R), 0.3 * math.exp(-4.5), rel_tol=1e-9)   # ~0.0033


# ------------------------------------------------------------------------------------------------ 4. EMA
def test_ema_updates_only_present_classes():
    torch.manual_seed(0)
    proto = torch.randn(10, 6)
    before = proto.clone()
    u = torch.randn(5, 6)
    ema_update(proto, u, torch.full((5,), 3), 0.3)
    assert torch.equal(proto[:3], before[:3]) and torch.equal(proto[4:], before[4:])
    assert torch.allclose(proto[3], 0.7 * before[3] + 0.3 * u.mean(0), atol=1e-6)


# ------------------------------------------------------------------------------------------------ helpers: one client
def _setup(**cfg_kw):
    torch.manual_seed(0)
    net = build_classifier("tiny-resnet", num_labels=10, image_size=16, num_channels=3)
    model = FRAugModel(net, d_z=16).train()
    cfg = FRAugConfig(d_z=16, syn_batch_size=20, **cfg_kw)
    x, y = torch.randn(20, 3, 16, 16), torch.arange(20) % 10
    with torch.no_grad():
        model.prototypes.copy_(torch.rand(10, model.d_u))
    st = FRAugStages(model, cfg, lam_syn=0.8, lam_c=0.3, noise=torch.Generator().manual_seed(1))
    return model, st, {"pixel_values": x, "labels": y}


def _grads(params):
    return [p.grad for p in params]


def _zero(model):
    for p in model.parameters():
        p.grad = None


# ------------------------------------------------------------------------------------------------ stage 1 by hand
def _mlp_by_hand(layers, v):
    """Linear / BatchNorm1d (batch statistics, biased variance, eps 1e-5) / ReLU, written out."""
    for layer in layers:
        if isinstance(layer, nn.Linear):
            v = v @ layer.weight.T + layer.bias
        elif isinstance(layer, nn.BatchNorm1d):
            v = (v - v.mean(0)) / torch.sqrt(v.var(0, unbiased=False) + 1e-5) * layer.weight + layer.bias
        else:
            v = v.clamp_min(0)
    return v


def _ce_by_hand(logits, y):
    return float(-(logits - logits.logsumexp(-1, keepdim=True))[torch.arange(len(y)), y].mean())


@pytest.mark.parametrize("use_ema", [True, False])
def test_stage1_loss_by_hand(use_ema):
    """Eq. 1-4 on a tiny model: L_cls = CE(h(u), y) + CE(h(u_hat), y) + CE(h(u_hat_c), c) with
    u_hat = u + lambda_syn m(g(z, y)), u_hat_c = proto_c + lambda_syn m(g(z', c)), the prototypes first moved by
    the EMA of this batch (lambda_c), z and z' the stage's noise draws in order. g, m and h are recomputed here from
    their weights; lambda_syn = 0.8, lambda_c = 0.3. ``--use_ema false`` drops the prototype path and the EMA."""
    import copy

    model, st, batch = _setup(use_ema=use_ema)
    with torch.no_grad():                          # an RTNet residual of order 1 (known output BN affine)
        model.rtnet.net[-1].weight.fill_(2.0)
        model.rtnet.net[-1].bias.copy_(torch.linspace(-1, 1, model.d_u))
    ref = copy.deepcopy(model)
    x, y = batch["pixel_values"], batch["labels"]
    lin = ref.net.classifier[-1]
    with torch.no_grad():
        u = ref.embed(x)                           # f in train mode, as the stage runs it

        def head(v):
            return v @ lin.weight.T + lin.bias

        proto = ref.prototypes.clone()
        if use_ema:
            for c in range(10):
                proto[c] = 0.7 * proto[c] + 0.3 * u[y == c].mean(0)
        noise = torch.Generator().manual_seed(1)
        z, z2 = torch.randn(20, 16, generator=noise), torch.randn(20, 16, generator=noise)
        c = torch.arange(20) % 10

        def g(zz, labels):
            return _mlp_by_hand(ref.generator.net, torch.cat([zz, F.one_hot(labels, 10).float()], 1))

        u_hat = u + 0.8 * _mlp_by_hand(ref.rtnet.net, g(z, y))
        uc_hat = proto[c] + 0.8 * _mlp_by_hand(ref.rtnet.net, g(z2, c))
        real = _ce_by_hand(head(u), y)
        syn = _ce_by_hand(head(u_hat), y) + (_ce_by_hand(head(uc_hat), c) if use_ema else 0.0)
        without_residual_weight = _ce_by_hand(head(u + _mlp_by_hand(ref.rtnet.net, g(z, y))), y)
    loss = st.loss_cls(model, batch)
    assert float(loss) == pytest.approx(real + syn, rel=1e-5)
    assert st.log["loss_real"][-1] == pytest.approx(real, rel=1e-5)
    assert st.log["loss_syn"][-1] == pytest.approx(syn, rel=1e-5)
    assert torch.allclose(model.prototypes, proto, atol=1e-6)
    assert abs(without_residual_weight - _ce_by_hand(head(u_hat), y)) > 1e-3    # lambda_syn is visible


def test_each_round_builds_its_stages_with_that_rounds_schedules(run_sim):
    """App. A.2 through the algorithm: R = 40, r_0 = 0.05 R = 2. Round 1: lambda_syn = e^{0.01 (1 - 40)},
    lambda_c = 0.3 e^{-5 (1 - 1/2)}; round 30: lambda_syn = e^{-0.1}, lambda_c = 0.3."""
    sim, _ = run_sim("fraug", run=False, num_rounds=40, method_config=FRAugConfig(d_z=16, plot_embeddings=False))
    st = sim.algorithm.stages_for(0, 1)
    assert st.lam_syn == pytest.approx(math.exp(-0.39)) and st.lam_c == pytest.approx(0.3 * math.exp(-2.5))
    st = sim.algorithm.stages_for(0, 30)
    assert st.lam_syn == pytest.approx(math.exp(-0.1)) and st.lam_c == pytest.approx(0.3)


# ------------------------------------------------------------------------------------------------ 5. gradient isolation
def test_l_syn_reaches_only_the_head():
    model, st, batch = _setup()
    body, head = model.body_parameters(), model.head_parameters()
    loss_cls = st.loss_cls(model, batch)
    loss_cls.backward()
    g_cls_body = [p.grad.clone() for p in body]
    g_cls_head = [p.grad.clone() for p in head]
    assert all(p.grad is None for p in [*model.generator.parameters(), *model.rtnet.parameters()])
    _zero(model)
    F.cross_entropy(model.head(model.embed(batch["pixel_values"])), batch["labels"]).backward()  # L_real alone
    assert all(torch.allclose(a, p.grad, atol=1e-6) for a, p in zip(g_cls_body, body))  # L_syn adds nothing to f
    assert any(not torch.allclose(a, p.grad) for a, p in zip(g_cls_head, head))        # ... but does reach h
    _zero(model)
    s = st.step
    with torch.no_grad():
        u = model.embed(batch["pixel_values"])
        u_hat, uc_hat = st.synthetic(u, batch["labels"], s["z"], s["z2"], s["c"])
    (F.cross_entropy(model.head(u_hat), batch["labels"]) + F.cross_entropy(model.head(uc_hat), s["c"])).backward()
    assert all(p.grad is None or not p.grad.any() for p in body)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head)


def test_l_gen_and_l_rt_touch_only_their_own_parameters():
    model, st, batch = _setup()
    st.loss_cls(model, batch)                      # sets the step's noise
    _zero(model)
    running = {k: v.clone() for k, v in model.state_dict().items() if "running_" in k}
    st.loss_gen(model, batch).backward()
    assert all(p.grad is None for p in [*model.net.parameters(), *model.rtnet.parameters()])
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.generator.parameters()
               if p.dim() > 1)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in running.items())  # u_ref: eval-mode BN, no update
    _zero(model)
    st.loss_rt(model, batch).backward()
    assert all(p.grad is None for p in [*model.net.parameters(), *model.generator.parameters()])
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.rtnet.parameters() if p.dim() > 1)


def test_a_whole_local_step_changes_each_part_through_its_own_optimizer():
    """Through the engine's loop: three optimizers, one batch; each stage's parameters move, nothing else."""
    from hfpfl.training import TensorData, make_optimizer, train_local
    model, st, batch = _setup()
    params, fns = st.stages()
    assert len(params) == len(fns) == 3
    opts = [make_optimizer(p, "sgd", 0.01, 0.5) for p in params]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    train_local(model, TensorData(batch["pixel_values"], batch["labels"]), opts, batch_size=20, max_steps=1,
                loss_fn=fns)
    after = model.state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert any(k.startswith("net.resnet") for k in moved) and "net.classifier.1.weight" in moved
    assert any(k.startswith("generator.") for k in moved) and any(k.startswith("rtnet.") for k in moved)
    assert "prototypes" in moved
    assert all(len(st.log[k]) == 1 for k in ("loss_cls", "loss_gen", "loss_rt"))


# ------------------------------------------------------------------------------------------------ 6. signs
def _gen_eval(model, st, batch, seed):
    """loss_gen's value and MMD(v_hat, u_ref) for the noise the stage draws from ``seed``."""
    st.noise = torch.Generator().manual_seed(seed)
    st.step = {}
    loss = st.loss_gen(model, batch)
    z = torch.randn(len(batch["labels"]), st.cfg.d_z, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        d = mmd(model.generator(z, batch["labels"]), st.step["u_ref"])
    return loss, float(d)


def _sgd_step(params, loss, lr):
    for p in params:
        p.grad = None
    loss.backward()
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p -= lr * p.grad


def test_generator_sign_mmd_term_pushes_away_and_full_loss_decreases():
    model, st, batch = _setup(mmd_alpha=1e4)                 # the MMD term dominates CE
    gp = list(model.generator.parameters())
    loss, d0 = _gen_eval(model, st, batch, 7)
    _sgd_step(gp, loss, 1e-6)
    _, d1 = _gen_eval(model, st, batch, 7)
    assert d1 > d0                                            # -alpha MMD: maximizes the distance
    model, st, batch = _setup()
    gp = list(model.generator.parameters())
    loss0, _ = _gen_eval(model, st, batch, 7)
    _sgd_step(gp, loss0, 1e-2)
    loss1, _ = _gen_eval(model, st, batch, 7)
    assert float(loss1.detach()) < float(loss0.detach())


def _rt_terms(model, st, batch):
    """(loss_rt, (H(u_hat), H(u_hat_c)), (MMD(u_hat, u), MMD(u_hat_c, proto))) on the stored step noise."""
    step = dict(st.step)
    u_ref = st.real_reference(batch["pixel_values"])
    with torch.no_grad():
        v1, v2 = st._inputs(u_ref, batch["labels"], step["z"], step["z2"], step["c"])
        proto = model.prototypes[step["c"]]
        u_hat = u_ref + st.lam_syn * model.rtnet(v1)
        uc_hat = proto + st.lam_syn * model.rtnet(v2)
        ent = (float(entropy(st.head_fixed(u_hat))), float(entropy(st.head_fixed(uc_hat))))
        dist = (float(mmd(u_hat, u_ref)), float(mmd(uc_hat, proto)))
    loss = st.loss_rt(model, batch)
    st.step = step
    return loss, ent, dist


@pytest.mark.parametrize("beta, check", [(0.0, "entropy_up"), (1e4, "mmd_down"), (1.5, "loss_down")])
def test_rtnet_signs(beta, check):
    model, st, batch = _setup(mmd_beta=beta)
    st.loss_cls(model, batch)
    step = dict(st.step)
    rp = list(model.rtnet.parameters())
    loss0, e0, d0 = _rt_terms(model, st, batch)
    st.step = dict(step)
    _sgd_step(rp, loss0, 1e-6 if beta > 100 else 1e-2)
    st.step = dict(step)
    loss1, e1, d1 = _rt_terms(model, st, batch)
    if check == "entropy_up":
        assert e1[0] > e0[0] and e1[1] > e0[1]    # -H on both paths: hard examples for h
    elif check == "mmd_down":
        assert d1[0] < d0[0] and d1[1] < d0[1]    # +beta MMD on both paths: stay close to the local distribution
    else:
        assert float(loss1.detach()) < float(loss0.detach())


def test_classifier_loss_decreases_after_one_step():
    model, st, batch = _setup()
    st.lam_c = 0.0                                     # keep the prototypes fixed between the two evaluations
    tp = [p for p in model.net.parameters() if p.requires_grad]
    st.noise = torch.Generator().manual_seed(3)
    loss0 = st.loss_cls(model, batch)
    _sgd_step(tp, loss0, 1e-2)
    st.noise = torch.Generator().manual_seed(3)
    assert float(st.loss_cls(model, batch)) < float(loss0)


# ------------------------------------------------------------------------------------------------ 7. MMD
def test_mmd_sanity():
    torch.manual_seed(0)
    x = torch.randn(32, 8)
    assert abs(float(mmd(x, x))) < 1e-6
    ds = [float(mmd(x, torch.randn(32, 8) + s)) for s in (0.0, 0.5, 1.0, 2.0, 4.0)]
    assert all(d >= -1e-7 for d in ds) and all(a < b for a, b in zip(ds, ds[1:]))
    assert float(mmd(x, torch.randn(12, 8) + 2)) > float(mmd(x, torch.randn(12, 8)))  # unequal sizes are fine


# ------------------------------------------------------------------------------------------------ 8. communication
def test_communication_payload_and_bytes(run_sim):
    sim, _ = run_sim("fraug", num_rounds=1, local_steps=2, lr=0.01, momentum=0.5, method_config=FRAugConfig(
        d_z=16, plot_embeddings=False))
    model = sim.model
    bn = [k for k, mod in model.net.named_modules() if isinstance(mod, nn.modules.batchnorm._BatchNorm)]
    theta = sum(p.numel() for p in model.net.parameters())
    bn_local = sum(p.numel() for k in bn for p in model.net.get_submodule(k).parameters())
    g = sum(p.numel() for p in model.generator.parameters())
    expected_keys = {f"net.{k}" for k, _ in model.net.named_parameters() if not k.startswith(tuple(b + "." for b in bn))}
    expected_keys |= {k for k in model.state_dict() if k.startswith("generator.")}
    for u in sim.last_updates:
        up = u.upload[MODEL]
        assert set(up) == expected_keys and set(u.upload) == {MODEL}
        assert not any(k.startswith("rtnet.") or k == "prototypes" for k in up)
        assert u.metrics["parts_up"] == {MODEL: 4 * (theta - bn_local + g)}
    assert sim.ledger.round_totals(1)[1] == 4 * (theta - bn_local + g) * len(sim.last_updates)
    # after aggregation: personal models share every global tensor, differ in local BN, RTNet and prototypes
    states = []
    for cid in (0, 1):
        sim.ctx.load(sim.store.get(cid)[MODEL])
        sim.algorithm.load_personal(cid, sim.server_state, sim.store.get(cid), 1)
        states.append({k: v.clone() for k, v in sim.model_state.items()})
    assert all(torch.equal(states[0][k], states[1][k]) for k in expected_keys)
    for prefix in ("net.resnet.embedder.embedder.normalization.running_mean", "rtnet.net.0.weight", "prototypes"):
        assert not torch.equal(states[0][prefix], states[1][prefix])
    assert set(sim.keys_by_role[PRIVATE]) >= {k for k in states[0] if k.startswith("rtnet.")} | {"prototypes"}


def test_ablations_train_and_send_only_what_they_use(run_sim):
    sim, _ = run_sim("fraug", run=False, method_config=FRAugConfig(d_z=16, use_rtnet=False, use_ema=False))
    frozen = sim.keys_by_role["frozen"]
    assert frozen and all(k.startswith(("rtnet.", "prototypes")) for k in frozen) and "prototypes" in frozen
    assert any(k.startswith("generator.") for k in sim.keys_by_role["global"])
    sim, _ = run_sim("fraug", num_rounds=1, local_steps=1, method_config=FRAugConfig(
        d_z=16, use_generator=False, use_ema=False, plot_embeddings=False))
    assert not any(k.startswith("generator.") for u in sim.last_updates for k in u.upload[MODEL])
    with pytest.raises(ValueError, match="generator or the RTNet"):
        FRAugConfig(use_generator=False, use_rtnet=False)


# ------------------------------------------------------------------------------------------------ 9. determinism, resume
@pytest.mark.slow
def test_same_seed_bit_identical_and_resume_continues_exactly(run_sim):
    kw = dict(num_rounds=2, local_steps=2, lr=0.01, momentum=0.5, checkpoint_every=1)
    cfg = FRAugConfig(d_z=16, plot_embeddings=True, schedule_rounds=2)  # R fixed: resume extends num_rounds
    a, ra = run_sim("fraug", method_config=cfg, output_dir="a", **kw)
    b, rb = run_sim("fraug", method_config=cfg, output_dir="b", **kw)
    for ua, ub in zip(a.last_updates, b.last_updates):
        assert all(torch.equal(ua.upload[MODEL][k], ub.upload[MODEL][k]) for k in ua.upload[MODEL])
    for cid in range(a.num_clients):
        pa, pb = a.store.get(cid), b.store.get(cid)
        assert set(pa) == {MODEL, "optim"}     # RTNet / prototypes / BN and the three optimizers' momentum
        assert all(torch.equal(pa[p][k], pb[p][k]) for p in pa for k in pa[p])
    assert ra["per_client_accuracy"] == rb["per_client_accuracy"]
    assert (Path(a.args.output_dir) / "fraug_embeddings.png").stat().st_size > 0
    # resume: 1 round, then continue from its checkpoint to 2 == 2 rounds straight
    run_sim("fraug", method_config=cfg, output_dir="c", **{**kw, "num_rounds": 1})
    _, rc = run_sim("fraug", method_config=cfg, output_dir="c", resume_from_checkpoint="latest",
                    overwrite_output_dir=False, **kw)
    assert rc["per_client_accuracy"] == ra["per_client_accuracy"]
    assert rc["communication"]["bytes_up"] == ra["communication"]["bytes_up"]


@pytest.mark.slow
def test_two_processes_give_the_same_results(tmp_path):
    small = ["--method", "fraug", "--num_clients", "4", "--max_per_domain", "100", "--image_size", "16",
             "--batch_size", "16", "--local_steps", "2", "--num_rounds", "2", "--progress", "false"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    one = subprocess.run([sys.executable, str(ROOT / "recipes" / "fraug.py"), *small, "--output_dir",
                          str(tmp_path / "one")], env={**env, **CPU_ONLY}, capture_output=True, text=True)
    assert one.returncode == 0, one.stdout + one.stderr
    two = subprocess.run([*LAUNCH_TWO, str(ROOT / "recipes" / "fraug.py"), *small, "--output_dir", str(tmp_path / "two")],
                         env={**env, **CPU_PROCESSES}, capture_output=True, text=True)
    assert two.returncode == 0, two.stdout + two.stderr
    r1, r2 = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("one", "two"))
    assert r2["world_size"] == 2
    assert r1["per_client_accuracy"] == r2["per_client_accuracy"] and r1["final"] == r2["final"]
    assert (tmp_path / "two" / "fraug_embeddings.png").exists()


# ------------------------------------------------------------------------------------------------ same optimizer policy
@pytest.mark.slow
def test_fedbn_keeps_momentum_only_when_asked(run_sim):
    """FedBN's --keep_optimizer_state (FRAug's comparisons under one optimizer-state policy): round 1 is identical
    either way (momentum starts empty), round 2 differs only through the kept momentum, and with momentum 0 keeping
    the (empty) state changes nothing."""
    from hfpfl.algorithms.fedbn import FedBNConfig
    kw = dict(num_rounds=2, local_steps=2, lr=0.05, momentum=0.9)
    runs = {}
    for keep in (False, True):
        for rounds in (1, 2):
            runs[keep, rounds] = run_sim("fedbn", method_config=FedBNConfig(keep_optimizer_state=keep),
                                         output_dir=f"bn-{keep}-{rounds}", **{**kw, "num_rounds": rounds})[0]

    def uploads(sim):
        return {u.client_id: u.upload[MODEL] for u in sim.last_updates}

    def same(a, b):
        return all(torch.equal(a[c][k], b[c][k]) for c in a for k in a[c])

    assert same(uploads(runs[False, 1]), uploads(runs[True, 1]))
    assert not same(uploads(runs[False, 2]), uploads(runs[True, 2]))
    kept = runs[True, 2].store.get(0)
    assert "optim" in kept and any("momentum_buffer" in k for k in kept["optim"])
    assert "optim" not in runs[False, 2].store.get(0)
    a, _ = run_sim("fedbn", method_config=FedBNConfig(keep_optimizer_state=False), output_dir="bn-m0-f",
                   **{**kw, "momentum": 0.0})
    b, _ = run_sim("fedbn", method_config=FedBNConfig(keep_optimizer_state=True), output_dir="bn-m0-k",
                   **{**kw, "momentum": 0.0})
    assert same(uploads(a), uploads(b))
