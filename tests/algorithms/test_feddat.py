"""FedDAT (spec fraug_feddat.md 2.11 unit checks 1-9) on tiny random ViLT/BLIP models and a small easy-vqa
federation; the VQA data path (easy-vqa offline, Hub ids fail fast, a local parquet fixture); resume and 2 processes."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn import functional as F
from conftest import CPU_ONLY, CPU_PROCESSES, LAUNCH_TWO

from hfpfl.algorithms import MODEL, get_algorithm
from hfpfl.config import RunArguments
from hfpfl.models.vqa import build_vqa_peft_model
from hfpfl.models.vqa_model import BottleneckAdapter, DualAdapter, adapter_param_count, kd_loss, kd_ramp

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def vqa_fed():
    """The domain-like split, 5 clients, 16 training questions each (client 0 cut to 9: unequal N_k)."""
    from hfpfl.data.vqa import vqa_benchmark

    from hfpfl.models.vqa import vqa_tokenizer

    fed = vqa_benchmark("domain", tokenizer=vqa_tokenizer(), seed=0, train_per_client=16, test_per_client=20)
    fed.clients[0].train = fed.clients[0].train.select(range(9))
    return fed


@pytest.fixture
def sim_for(vqa_fed, tmp_path):
    from hfpfl.federated.engine import Simulation

    def make(method, model="tiny-vilt", rounds=2, run_kw=None, **cfg):
        run = RunArguments(method=method, model=model, random_backbone_ok=True, num_rounds=rounds, batch_size=8, lr=1e-2,
                           optimizer="adamw", weight_decay=0.01, output_dir=str(tmp_path / f"{method}-{model}"),
                           progress=False, overwrite_output_dir=True, checkpoint_every=0, eval_batch_size=64,
                           **(run_kw or {}))
        return Simulation(run, None, get_algorithm(method).Config(**cfg), fed_data=vqa_fed, keep_uploads=True)
    return make


def batch_of(fed, cid=0, n=6):
    b = fed.clients[cid].train[:n]
    return {k: v for k, v in b.items()}


def logits(model, batch, mode):
    model.mode = mode
    with torch.no_grad():
        return model(**{k: v for k, v in batch.items() if k != "answer"}).logits


# ------------------------------------------------------------------------------------------------ check 1
def test_adapter_parameter_formula_and_shapes():
    assert adapter_param_count(12, 768, 48) == 894_528          # ViLT-B, Table 2's 0.89M
    assert adapter_param_count(24, 768, 48) == 1_789_056        # VAuLT, 1.79M
    a = BottleneckAdapter(768, 48)
    assert sum(p.numel() for p in a.parameters()) == 2 * 768 * 48 + 768 + 48
    h = torch.randn(2, 7, 768)
    assert a(h).shape == (2, 7, 768)
    for name in ("tiny-vilt", "tiny-blip"):
        m = build_vqa_peft_model(name, [str(i) for i in range(13)] if name == "tiny-vilt" else
                                 ["circle", "green", "red", "gray", "yes", "teal", "black", "rectangle", "yellow",
                                  "triangle", "brown", "blue", "no"])
        cfg = m.backbone.config
        d = cfg.hidden_size if name == "tiny-vilt" else cfg.text_config.hidden_size
        layers = cfg.num_hidden_layers if name == "tiny-vilt" else (cfg.vision_config.num_hidden_layers +
                                                                  2 * cfg.text_config.num_hidden_layers)
        shared = sum(p.numel() for k, p in m.named_parameters() if ".shared." in k)
        assert shared == adapter_param_count(layers, d, d // 16)


# ------------------------------------------------------------------------------------------------ check 2
def test_dat_is_the_average_of_the_two_adapters_and_identity_when_equal(vqa_fed):
    torch.manual_seed(0)
    slot = DualAdapter(8, 2)
    slot.shared.up.weight.data.normal_()
    slot.copy_shared_to_frozen()
    h = torch.randn(3, 4, 8)
    by_hand = 0.5 * (torch.relu(h @ slot.shared.down.weight.T + slot.shared.down.bias) @ slot.shared.up.weight.T
                     + slot.shared.up.bias) + 0.5 * slot.local(h)
    assert torch.allclose(slot.delta(h, "dat"), by_hand, atol=1e-6)
    m = build_vqa_peft_model("tiny-vilt", list(vqa_fed.label_names))
    b = batch_of(vqa_fed)
    with torch.no_grad():
        for s in m.adapters:
            s.shared.up.weight.normal_(std=0.5)        # make the adapters matter
            s.local.load_state_dict(s.shared.state_dict())
    m.copy_shared_to_frozen()
    assert torch.allclose(logits(m, b, "dat"), logits(m, b, "shared"), atol=1e-5)
    assert not torch.allclose(logits(m, b, "none"), logits(m, b, "shared"), atol=1e-3)  # the adapters do act
    with torch.no_grad():
        for s in m.adapters:
            s.local.up.weight.normal_(std=0.5)
    assert not torch.allclose(logits(m, b, "dat"), logits(m, b, "shared"), atol=1e-3)


# ------------------------------------------------------------------------------------------------ check 3
def _client_losses(sim, cid=1, round_idx=1, seed=5, scale=0.5):
    """FedDAT's two loss functions of one client update, on adapters of known weights (A_s and A_c set from a seeded
    generator, so that the DAT teacher differs from A_s). The engine's loop is replaced by a recorder: the test
    calls the losses on a batch of its choosing."""
    sim.setup()
    algo, m = sim.algorithm, sim.model
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for slot in m.adapters:
            for lin in (slot.shared.down, slot.shared.up, slot.local.down, slot.local.up):
                lin.weight.copy_(scale * torch.randn(lin.weight.shape, generator=g))
                lin.bias.copy_(0.1 * torch.randn(lin.bias.shape, generator=g))
            for lin in (slot.shared.down, slot.local.down):
                lin.bias.add_(1.0)                   # the r bottleneck units stay active (ReLU) on every token
        for k, p in m.named_parameters():          # a head with weights of order 1: logits far from uniform
            if k.startswith("backbone.classifier.") and k.endswith("weight"):
                p.copy_(torch.randn(p.shape, generator=g))
    down = {MODEL: {k: sim.model_state[k].clone() for k in algo.global_keys}}
    private = {MODEL: {k: sim.model_state[k].clone() for k in algo.private_keys}}
    seen = {}

    def record(client_id, r, param_sets, loss_fns):
        seen.update(params=param_sets, fns=loss_fns)
        return {"steps": 1, "train_loss": 0.0}

    algo.run_local = record
    algo.client_update(cid, down, private, round_idx)
    return m, seen


def _hand_kd(student, teacher, T=3.0):
    """T^2 KL(softmax(teacher / T) || softmax(student / T)), batch mean, written out (0 log 0 = 0: answers outside
    the client's pool have probability 0)."""
    p_t = torch.softmax(teacher / T, -1)
    return T * T * (torch.xlogy(p_t, p_t) - p_t * torch.log_softmax(student / T, -1)).sum(-1).mean()


def _logits_seeded(m, x, modes, seed):
    """Logits of the given adapter paths in order, after ``torch.manual_seed(seed)`` (ViLT draws its patch order
    at random: the same seed and the same forward order reproduce the draws of a loss function)."""
    torch.manual_seed(seed)
    out = []
    with torch.no_grad():
        for mode in modes:
            m.mode = mode
            out.append(m(**x).logits)
    m.mode = "shared"
    return out


@pytest.mark.parametrize("model", ["tiny-vilt", "tiny-blip"])
def test_client_losses_are_ce_plus_both_kd_directions_by_hand(sim_for, vqa_fed, model):
    """FedDAT's client update (the authors' code's update order), ``--kd_schedule constant`` (alpha = beta = 1, the
    code's (CE + KD) / 2): L^s = 1/2 (CE(z_s, y) + T^2 KL(p_DAT || p_s)) trains A_s + head; then
    L^DAT = 1/2 (CE(z_DAT, y) + T^2 KL(p_s || p_DAT)) with z_s from step 1 trains A_c + head; T = 3. Every term is
    recomputed here from the model's logits; each KD term is large enough that dropping a direction, or a teacher
    replaced by the student, moves the loss."""
    sim = sim_for("feddat", model=model, kd_schedule="constant")
    m, seen = _client_losses(sim)
    loss_s, loss_dat = seen["fns"]
    b = {k: v.to(sim.device) for k, v in batch_of(vqa_fed, 1).items()}
    x, y = {k: v for k, v in b.items() if k != "answer"}, b["answer"]

    z_dat, z_s = _logits_seeded(m, x, ["dat", "shared"], seed=11)     # loss_s: teacher, then student
    kd_s = _hand_kd(z_s, z_dat)
    expected_s = 0.5 * (F.cross_entropy(z_s, y) + kd_s)
    torch.manual_seed(11)
    got_s = loss_s(m, b)
    (z_dat2,) = _logits_seeded(m, x, ["dat"], seed=12)                  # loss_dat: the DAT path only
    kd_dat = _hand_kd(z_dat2, z_s)
    expected_dat = 0.5 * (F.cross_entropy(z_dat2, y) + kd_dat)
    torch.manual_seed(12)
    got_dat = loss_dat(m, b)
    for got, expected, kd in ((got_s, expected_s, kd_s), (got_dat, expected_dat, kd_dat)):
        assert float(got) == pytest.approx(float(expected), rel=1e-6)
        assert 0.5 * float(kd) > 100 * 1e-6 * float(expected)         # either KD term is visible in the value
    assert not torch.allclose(z_dat, z_s, atol=1e-2)                    # the teacher is not the student


def test_kd_weight_ramp_enters_the_loss_by_hand(sim_for, vqa_fed):
    """``--kd_schedule ramp`` (App. B.2): alpha = beta = exp(-5 (1 - t / T0)), t = the client's cumulative local
    steps, T0 = R x steps per round, no 1/2. Client 1 holds 16 questions at batch 8 = 2 steps per round; round 2 of
    2, first step: t = 2, T0 = 4, alpha = exp(-2.5)."""
    sim = sim_for("feddat", rounds=2)
    m, seen = _client_losses(sim, round_idx=2)
    loss_s, loss_dat = seen["fns"]
    b = {k: v.to(sim.device) for k, v in batch_of(vqa_fed, 1).items()}
    x, y = {k: v for k, v in b.items() if k != "answer"}, b["answer"]
    a = math.exp(-2.5)
    z_dat, z_s = _logits_seeded(m, x, ["dat", "shared"], seed=3)
    torch.manual_seed(3)
    assert float(loss_s(m, b)) == pytest.approx(float(F.cross_entropy(z_s, y) + a * _hand_kd(z_s, z_dat)), rel=1e-5)
    (z_dat2,) = _logits_seeded(m, x, ["dat"], seed=4)
    torch.manual_seed(4)
    assert float(loss_dat(m, b)) == pytest.approx(float(F.cross_entropy(z_dat2, y) + a * _hand_kd(z_dat2, z_s)),
                                                  rel=1e-5)


@pytest.mark.parametrize("mutual, teacher", [(False, "dat"), (True, "frozen"), (True, "local")])
def test_ablations_change_exactly_their_term(sim_for, vqa_fed, mutual, teacher):
    """Table 4's ablations by hand: ``--mutual false`` (w/o MKD) drops the A_s -> DAT term (L^DAT = 1/2 CE);
    ``--teacher frozen|local`` (w/o A_c, w/o Â_s) make Â_s or A_c alone the teacher path of both losses (w/o A_c:
    only L^s, since the teacher Â_s is frozen and there is nothing for L^DAT to train)."""
    sim = sim_for("feddat", kd_schedule="constant", mutual=mutual, teacher=teacher)
    m, seen = _client_losses(sim)
    named = dict(m.named_parameters())
    firsts = {id(named[k]) for k in named if ".shared." in k or k.startswith("backbone.classifier.")}
    assert {id(p) for p in seen["params"][0]} == firsts
    if teacher == "frozen":
        assert len(seen["fns"]) == len(seen["params"]) == 1
    loss_s, loss_dat = (seen["fns"] + [None])[:2]
    b = {k: v.to(sim.device) for k, v in batch_of(vqa_fed, 1).items()}
    x, y = {k: v for k, v in b.items() if k != "answer"}, b["answer"]
    z_t, z_s = _logits_seeded(m, x, [teacher, "shared"], seed=7)
    torch.manual_seed(7)
    assert float(loss_s(m, b)) == pytest.approx(float(0.5 * (F.cross_entropy(z_s, y) + _hand_kd(z_s, z_t))),
                                                rel=1e-5)
    if loss_dat is None:
        return
    (z_t2,) = _logits_seeded(m, x, [teacher], seed=8)
    expected = 0.5 * (F.cross_entropy(z_t2, y) + (_hand_kd(z_t2, z_s) if mutual else 0.0))
    torch.manual_seed(8)
    assert float(loss_dat(m, b)) == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.parametrize("head_loss", ["shared", "both"])
def test_the_two_optimizers_hold_a_s_plus_head_and_a_c(sim_for, head_loss):
    """Spec check 3, what each optimizer may move: FedDAT's client update builds its two optimizers on exactly
    (A_s + head) and A_c, so the head steps once per batch as in Adapter (``--head_loss both``, the authors' code:
    A_c + head, two head steps per batch); Â_s (buffers) and the backbone are not trainable. The gradients each loss
    gives every trainable tensor are pinned by value in test_feddat_pins.py (test_client_loss_gradients_are_those_of_
    the_hand_loss)."""
    sim = sim_for("feddat", kd_schedule="constant", head_loss=head_loss)
    m, seen = _client_losses(sim)
    named = dict(m.named_parameters())
    shared = [k for k in named if ".shared." in k]
    local = [k for k in named if ".local." in k]
    head = [k for k in named if k.startswith("backbone.classifier.")]
    backbone = [k for k in named if k.startswith("backbone.") and k not in head]
    ids = [{id(p) for p in ps} for ps in seen["params"]]
    second = local + head if head_loss == "both" else local
    assert ids == [{id(named[k]) for k in shared + head}, {id(named[k]) for k in second}]
    frozen_bufs = [v for k, v in m.named_buffers() if "frozen_" in k.split(".")[-1]]
    assert frozen_bufs and all(not v.requires_grad for v in frozen_bufs)
    assert all(not named[k].requires_grad for k in backbone)


# ------------------------------------------------------------------------------------------------ check 4 + 7
def test_payload_is_the_shared_adapter_only_and_equals_the_adapter_baseline(sim_for):
    dat, ada = sim_for("feddat", rounds=1), sim_for("vqa_adapter", rounds=1)
    init_local = {k: v.cpu() for k, v in dat.model_state.items() if ".local." in k}
    dat.run()
    ada.run()
    shared_keys = set(dat.model.shared_keys())
    for u in dat.last_updates:
        assert set(u.upload) == {MODEL} and set(u.upload[MODEL]) == shared_keys
    assert set(ada.last_updates[0].upload[MODEL]) == set(ada.model.shared_keys()) == shared_keys
    res_d = json.loads((dat.output_dir / "results.json").read_text())["communication"]
    res_a = json.loads((ada.output_dir / "results.json").read_text())["communication"]
    assert res_d["bytes_up"] == res_a["bytes_up"] > 0 and res_d["bytes_down"] == res_a["bytes_down"]
    n_shared = sum(dat.model_state[k].numel() for k in shared_keys)
    assert res_d["bytes_up"] == 5 * 4 * n_shared                     # 5 clients x float32, one round
    # A_c and the head persist per client (private, trained, different between clients)
    priv = [dat.store.get(c)[MODEL] for c in range(5)]
    assert set(priv[0]) == set(dat.model.local_keys()) | set(dat.model.head_keys())
    k = dat.model.local_keys()[0]
    assert not torch.equal(priv[0][k], init_local[k]) and not torch.equal(priv[0][k], priv[1][k])
    # aggregation: the server A_s is the 1/K mean of the uploads (client 0 holds half the data of the others)
    mean = {k: torch.stack([u.upload[MODEL][k] for u in dat.last_updates]).mean(0) for k in shared_keys}
    for k in shared_keys:
        assert torch.allclose(dat.server_state[MODEL][k], mean[k], atol=1e-6)
    n = [len(dat.train_data(c)) for c in range(5)]
    gap = max((dat.server_state[MODEL][k] - sum(u.upload[MODEL][k] * n_i for u, n_i in zip(dat.last_updates, n))
               / sum(n)).abs().max().item() for k in shared_keys)
    assert gap > 1e-5                                                  # not the N_k-weighted mean


@pytest.mark.parametrize("warmup, factors", [(0.5, [1 / 3, 2 / 3, 1, 1, 2 / 3, 1 / 3]),
                                             (0.1, [1, 1, 4 / 5, 3 / 5, 2 / 5, 1 / 5])])
def test_round_schedule_is_warmup_then_linear_decay_restarted_every_round(vqa_fed, tmp_path, monkeypatch,
                                                                          warmup, factors):
    """Spec #5/#11: warm-up over --warmup of the round's local steps, then linear decay to 0, restarted every round;
    both FedDAT optimizers follow it (16 questions, batch 8, 3 epochs = 6 steps per round)."""
    from hfpfl.algorithms.feddat import VQAPeft
    from hfpfl.federated.engine import Simulation

    seen = []                                                 # one lr list per optimizer built
    base = VQAPeft.optimizer

    def spy(params, hp):
        opt, lrs = base(params, hp), []
        seen.append(lrs)
        opt.register_step_pre_hook(lambda o, args, kwargs: lrs.append(o.param_groups[0]["lr"]))
        return opt

    monkeypatch.setattr(VQAPeft, "optimizer", staticmethod(spy))
    run = RunArguments(method="feddat", model="tiny-vilt", random_backbone_ok=True, num_rounds=2, batch_size=8,
                       lr=1e-2, local_epochs=3, output_dir=str(tmp_path / "r"), progress=False,
                       overwrite_output_dir=True, checkpoint_every=0)
    Simulation(run, None, get_algorithm("feddat").Config(warmup=warmup), fed_data=vqa_fed).run()
    full = [lrs for lrs in seen if len(lrs) == 6]             # clients 1-4 (client 0 holds 9 questions: 3 steps)
    assert len(full) == 2 * 4 * 2                             # rounds x clients x (A_s, A_c) optimizers: restarted
    for lrs in full:
        assert lrs == pytest.approx([1e-2 * f for f in factors], rel=1e-6)


def test_frozen_copy_is_recopied_every_round_and_private_state_persists(sim_for):
    sim = sim_for("feddat")
    sim.setup()
    algo, ctx = sim.algorithm, sim.ctx
    private = algo.init_private_state(1)
    for r in (1, 2):
        down = {MODEL: {k: v + 0.01 * r for k, v in sim.server_state[MODEL].items()}}   # a new global A_s
        ctx.load(private[MODEL])
        upd = algo.client_update(1, down, private, r)
        for i, slot in enumerate(sim.model.adapters):
            assert torch.equal(slot.frozen_down_weight.cpu(), down[MODEL][f"adapters.{i}.shared.down.weight"])
            assert torch.equal(slot.frozen_up_bias.cpu(), down[MODEL][f"adapters.{i}.shared.up.bias"])
        k = sim.model.local_keys()[0]
        assert not torch.equal(upd.private[MODEL][k], private[MODEL][k])      # A_c trained, kept for next round
        private = upd.private


# ------------------------------------------------------------------------------------------------ check 5 + 6
def test_kd_loss_and_its_gradient_by_hand():
    """The authors' code's KD: T^2 KL(softmax(t/T) || softmax(s/T)), batch mean, teacher detached, on known
    logits; its gradient w.r.t. the student logits is T (softmax(s/T) - softmax(t/T)) / B (the T^2 factor makes it
    O(1) in T: without it the gradient shrinks as 1/T)."""
    s = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, -1.0]], requires_grad=True)
    t = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 1.0]], requires_grad=True)
    T, B = 3.0, 2

    def softmax(row):
        e = [math.exp(v / T) for v in row]
        return [x / sum(e) for x in e]

    p_s, p_t = [softmax(r) for r in s.tolist()], [softmax(r) for r in t.tolist()]
    by_hand = T * T * sum(sum(a * (math.log(a) - math.log(b)) for a, b in zip(pt, ps))
                          for pt, ps in zip(p_t, p_s)) / B
    loss = kd_loss(s, t, T)
    assert float(loss) == pytest.approx(by_hand, rel=1e-6)
    loss.backward()
    assert t.grad is None                                              # the teacher is detached
    grad = [[T * (b - a) / B for a, b in zip(pt, ps)] for pt, ps in zip(p_t, p_s)]
    assert torch.allclose(s.grad, torch.tensor(grad), atol=1e-6)
    assert float(kd_loss(s, s.detach(), T)) == pytest.approx(0.0, abs=1e-6)


def test_kd_ramp():
    assert kd_ramp(0, 100) == pytest.approx(math.exp(-5)) and kd_ramp(0, 100) == pytest.approx(0.0067, abs=1e-4)
    assert kd_ramp(100, 100) == 1.0
    xs = [kd_ramp(t, 100) for t in range(101)]
    assert all(a < b for a, b in zip(xs, xs[1:]))


# ------------------------------------------------------------------------------------------------ check 8
def test_inference_uses_only_the_shared_adapter(sim_for, vqa_fed):
    sim = sim_for("feddat")
    sim.setup()
    algo = sim.algorithm
    b = batch_of(vqa_fed, 2)
    model = algo.load_personal(2, sim.server_state, algo.init_private_state(2), 1)
    x = {k: v.to(sim.device) for k, v in b.items() if k != "answer"}

    def test_logits():
        torch.manual_seed(0)          # ViLT draws its patch order at random (as the engine does, evaluation is seeded)
        with torch.no_grad():
            return model(**x).logits.clone()
    before = test_logits()
    with torch.no_grad():
        for s in model.adapters:
            s.local.up.weight.normal_(std=1.0)
            s.local.down.weight.normal_(std=1.0)
    assert torch.equal(test_logits(), before)                         # A_c does not touch test logits
    with torch.no_grad():
        model.adapters[0].shared.up.weight.normal_(std=1.0)
    assert not torch.allclose(test_logits(), before, atol=1e-4)       # A_s does


# ------------------------------------------------------------------------------------------------ check 9
def test_baseline_payloads_match_their_formulas(sim_for, vqa_fed):
    d, L, inter = 32, 2, 64                                           # the tiny ViLT config
    def upload_numel(method, **cfg):
        sim = sim_for(method, **cfg)
        return sum(sim.model_state[k].numel() for k in sim.keys_by_role["global"]), sim
    lora_r = RunArguments().lora_r
    n, _ = upload_numel("vqa_peft", peft="lora")
    assert n == 2 * L * 2 * d * lora_r                                # query + value, A and B
    n, _ = upload_numel("vqa_peft", peft="prompt")
    assert n == 5 * d + (d * (d // 4) + d // 4) + ((d // 4) * d + d)  # embedding + reparameterisation MLP
    n, sim = upload_numel("vqa_peft", peft="bias")
    per_layer = 3 * d + d + inter + d + 2 * d                          # qkv, proj, fc1, fc2, two LNs
    layer_biases = sum(p.numel() for k, p in sim.model.named_parameters() if ".encoder.layer." in k
                       and k.endswith(".bias"))
    assert layer_biases == L * per_layer
    assert n == sum(p.numel() for k, p in sim.model.backbone.named_parameters()
                    if k.endswith(".bias") and not k.startswith("classifier."))
    n, sim = upload_numel("vqa_peft", peft="full")
    assert n == sum(p.numel() for k, p in sim.model.backbone.named_parameters() if not k.startswith("classifier."))
    n, _ = upload_numel("vqa_adapter_local")
    assert n == 0
    n, _ = upload_numel("vqa_peft", peft="head")
    assert n == 0


# ------------------------------------------------------------------------------------------------ data
def test_easy_vqa_source_splits_and_styles(vqa_fed):
    from hfpfl.data.vqa import (QUESTION_TYPES, apply_style, client_specs, load_vqa_source,
                                pool_and_client_images)

    ds = load_vqa_source("easy-vqa")
    assert set(ds.column_names) == {"image", "question", "answer", "question_type", "image_id"}
    assert len(ds) == 48_248 and set(ds.unique("question_type")) == set(QUESTION_TYPES)
    pool, clients = pool_and_client_images()
    assert not set(pool.tolist()) & set(clients.tolist())
    assert [s.families for s in client_specs("function")] == [(f,) for f in QUESTION_TYPES]
    assert len({s.style for s in client_specs("scene")}) == 5
    img = np.full((2, 8, 8, 3), 240, np.uint8)
    img[:, 2:5, 2:5] = (200, 0, 0)
    assert np.array_equal(apply_style(img, "palette", 0)[0, 3, 3], [0, 200, 0])
    tex = apply_style(img, "texture", 0)
    assert np.array_equal(tex[:, 2:5, 2:5], img[:, 2:5, 2:5]) and not np.array_equal(tex[:, 0, 0], img[:, 0, 0])
    # yes/no clients only see yes/no answers; clients do not share images with each other
    names = vqa_fed.label_names
    ans = [set(np.asarray(c.train.with_format(None)["answer"]).tolist()) for c in vqa_fed.clients]
    assert {names[i] for i in ans[2]} <= {"yes", "no"}


def test_hub_vqa_ids_fail_fast_offline_and_local_parquet_loads(tmp_path, monkeypatch):
    from PIL import Image

    from hfpfl.data import SourceUnavailableError
    from hfpfl.data.vqa import load_vqa_source

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SourceUnavailableError, match="hf download HuggingFaceM4/VQAv2"):
        load_vqa_source("HuggingFaceM4/VQAv2")
    import datasets
    ims = [Image.fromarray(np.full((8, 8, 3), i * 40, np.uint8)) for i in range(3)]
    datasets.Dataset.from_dict({"image": ims, "question": ["what color?"] * 3,
                                "multiple_choice_answer": ["red", "blue", "red"]},
                               features=datasets.Features({"image": datasets.Image(), "question": datasets.Value(
                                   "string"), "multiple_choice_answer": datasets.Value("string")})
                               ).to_parquet(str(tmp_path / "vqa.parquet"))
    ds = load_vqa_source(f"parquet:{tmp_path}/vqa.parquet")
    assert ds["answer"] == ["red", "blue", "red"] and ds["question_type"] == ["all"] * 3
    assert ds[0]["image"].size == (8, 8)


def test_blip_feddat_round_personal_accuracy_recounted(sim_for):
    """One FedDAT round on BLIP (no head: A_c is the only private state): the reported personal accuracy is the mean
    over clients of exact-answer matches of each client's inference path (A_s, received global) on its test set,
    recounted here from the final state."""
    sim = sim_for("feddat", model="tiny-blip", rounds=1)
    assert sim.keys_by_role["private"] == sim.model.local_keys()
    res = sim.run()
    algo, accs = sim.algorithm, []
    for cid in range(5):
        sim.seed_torch(sim.seed_for(1, cid, "eval"))
        private = sim.store.get(cid)
        sim.ctx.load(private[MODEL])
        model = algo.load_personal(cid, sim.server_state, private, 1).eval()
        data = sim.test_data(cid)
        b = {k: v.to(sim.device) for k, v in data.select(torch.arange(len(data))).items()}
        with torch.no_grad():
            pred = model(**{k: v for k, v in b.items() if k != "answer"}).logits.argmax(-1)
        assert model.mode == "shared"
        accs.append(int((pred == b["answer"]).sum()) / len(data))
    assert res["final"]["personal_accuracy"] == pytest.approx(sum(accs) / len(accs), abs=1e-9)
    assert "inference_dat" in res["final"]


# ------------------------------------------------------------------------------------------------ resume, processes
def test_resume_from_state_gives_the_same_run(sim_for):
    a = sim_for("feddat")
    for _ in range(2):
        a.step()
    b = sim_for("feddat")
    b.step()
    state = b.state_dict()
    c = sim_for("feddat")
    c.load_state_dict(state)
    c.step()
    for k, v in a.server_state[MODEL].items():
        assert torch.equal(v, c.server_state[MODEL][k])
    for cid in range(5):
        for k, v in a.store.get(cid)[MODEL].items():
            assert torch.equal(v, c.store.get(cid)[MODEL][k])
    assert a.history[-1]["personal_accuracy"] == c.history[-1]["personal_accuracy"]


@pytest.mark.slow
def test_two_processes_give_the_same_results(tmp_path):
    args = [str(ROOT / "recipes" / "feddat.py"), "--model", "tiny-vilt", "--random_backbone_ok", "true",
            "--num_rounds", "2", "--train_per_client", "24", "--test_per_client", "20", "--progress", "false",
            "--vqa_split", "domain"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    one = subprocess.run([sys.executable, *args, "--output_dir", str(tmp_path / "one")], env={**env, **CPU_ONLY},
                         capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run([*LAUNCH_TWO, *args, "--output_dir", str(tmp_path / "two")], env={**env, **CPU_PROCESSES},
                         capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr[-2000:]
    r1, r2 = (json.loads((tmp_path / w / "results.json").read_text()) for w in ("one", "two"))
    assert r2["world_size"] == 2
    assert r1["final"] == r2["final"] and r1["per_client_accuracy"] == r2["per_client_accuracy"]
    assert r1["communication"]["bytes_up"] == r2["communication"]["bytes_up"]


@pytest.mark.slow
def test_recipe_resumes_after_a_kill_with_the_same_results(tmp_path, kill_after_first_checkpoint):
    """recipes/feddat.py killed after its first checkpoint and resumed equals an uninterrupted run: the last round's
    train loss (which reads every client's private A_c and head) and the per-client accuracies are identical."""
    args = [str(ROOT / "recipes" / "feddat.py"), "--model", "tiny-vilt", "--random_backbone_ok", "true",
            "--num_rounds", "3", "--checkpoint_every", "1", "--train_per_client", "24", "--test_per_client", "20",
            "--progress", "false", "--vqa_split", "domain"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}

    def launch(out, *extra):
        return subprocess.Popen([sys.executable, *args, "--output_dir", str(out), *extra], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    ref = launch(tmp_path / "ref")
    kill_after_first_checkpoint(launch(tmp_path / "killed"), tmp_path / "killed")
    resumed = launch(tmp_path / "killed", "--resume_from_checkpoint", "latest")
    assert resumed.wait(timeout=600) == 0, resumed.stdout.read()
    assert ref.wait(timeout=600) == 0, ref.stdout.read()

    def last(out):
        res = json.loads((out / "results.json").read_text())
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        return rows[-1]["round"], rows[-1]["train_loss"], res["final"], res["per_client_accuracy"]

    assert last(tmp_path / "ref") == last(tmp_path / "killed")
    assert last(tmp_path / "ref")[0] == 3
