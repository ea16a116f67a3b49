"""DENSE and FedD3, the one-shot baselines of FedBiP's Tables 1-2 that need no LDM, pinned by hand: DENSE's generator
objective (one-hot CE, the BatchNorm-statistics hook, the boundary-support adversarial KL) and student KL at
temperature T, the teacher ensemble's mean logits; FedD3's RBF kernel, KIP loss and one Adam step of its distilled
pixels; what each client uploads (and nothing else) and what the server trains on, for how many steps."""
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hfpfl.algorithms import dense, fedd3
from hfpfl.algorithms.dense import DENSE, BNStatistics, Ensemble, generator_loss, kl_per_sample
from hfpfl.algorithms.fedd3 import FedD3, distill, init_support, kip_loss, rbf_kernel


# ------------------------------------------------------------------------------------------------ DENSE
def test_kl_per_sample_by_hand_at_t1_and_t2():
    """KL(p_teacher || p_student) per sample, times T^2: teacher logits (0, ln 3) -> p = (1/4, 3/4), student uniform:
    1/4 ln(1/2) + 3/4 ln(3/2); at T = 2 the teacher's p = (1, sqrt 3) / (1 + sqrt 3), scaled by 4."""
    t = torch.tensor([[0.0, math.log(3.0)]])
    s = torch.zeros(1, 2)
    assert kl_per_sample(s, t).item() == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5), abs=1e-6)
    p0, p1 = 1 / (1 + math.sqrt(3)), math.sqrt(3) / (1 + math.sqrt(3))
    assert kl_per_sample(s, t, 2.0).item() == pytest.approx(4 * (p0 * math.log(2 * p0) + p1 * math.log(2 * p1)),
                                                            abs=1e-6)
    # a student that equals the teacher: zero
    assert kl_per_sample(t, t, 3.0).item() == pytest.approx(0.0, abs=1e-7)


def test_generator_loss_terms_by_hand():
    """L_G = oh * CE(t, y) + bn * sum(bn terms) + adv * -(mean of KL * [argmax s == argmax t]); sample 0's student
    agrees with the teacher's argmax (its KL counts), sample 1's does not (masked out), so L_adv = -KL_0 / 2."""
    t = torch.tensor([[0.0, math.log(3.0)], [2.0, 0.0]])
    s = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    y = torch.tensor([1, 1])
    total, parts = generator_loss(t, s, y, [torch.tensor(0.5), torch.tensor(0.25)], oh=1.0, bn=2.0, adv=3.0)
    ce = (-math.log(0.75) - math.log(1 / (1 + math.exp(2.0)))) / 2
    q = (1 / (1 + math.e), math.e / (1 + math.e))   # softmax(0, 1)
    kl0 = 0.25 * math.log(0.25 / q[0]) + 0.75 * math.log(0.75 / q[1])
    assert parts["oh"].item() == pytest.approx(ce, abs=1e-6)
    assert parts["bn"].item() == pytest.approx(0.75, abs=1e-7)
    assert parts["adv"].item() == pytest.approx(-kl0 / 2, abs=1e-6)
    assert total.item() == pytest.approx(ce + 2 * 0.75 - 3 * kl0 / 2, abs=1e-6)
    zero, _ = generator_loss(t, s, y, [], oh=0.0, bn=5.0, adv=0.0)   # no BN layers: no BN term
    assert zero.item() == 0.0


def test_bn_statistics_hook_by_hand():
    """||running_var - var(x)||_2 + ||running_mean - mean(x)||_2 over batch and space, var biased: channel 0 holds
    (1, 3): mean 2, var 1; channel 1 holds (0, 0). running mean (1, 0), var (1, 2): sqrt(0 + 4) + sqrt(1 + 0) = 3."""
    bn = nn.BatchNorm2d(2).eval()
    bn.running_mean.copy_(torch.tensor([1.0, 0.0]))
    bn.running_var.copy_(torch.tensor([1.0, 2.0]))
    hook = BNStatistics(bn)
    bn(torch.tensor([[[[1.0]], [[0.0]]], [[[3.0]], [[0.0]]]]))
    assert hook.loss.item() == pytest.approx(3.0, abs=1e-6)
    hook.remove()
    bn(torch.zeros(2, 2, 1, 1))
    assert hook.loss.item() == pytest.approx(3.0, abs=1e-6)   # removed: no longer updated


class Lin(nn.Module):
    """logits = x @ W (flattened) behind a BatchNorm1d whose running statistics the ensemble's hooks read."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(2, affine=False)
        self.fc = nn.Linear(2, 2, bias=False)

    def forward(self, pixel_values):
        return SimpleNamespace(logits=self.fc(self.bn(pixel_values.flatten(1))))


def test_ensemble_is_the_mean_of_frozen_teacher_logits_with_their_bn_hooks():
    template = Lin()
    w1, w2 = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([[3.0, 1.0], [0.0, -1.0]])
    ens = Ensemble(template, [{"fc.weight": w1}, {"fc.weight": w2}])
    x = torch.tensor([[1.0, 2.0]])
    # eval mode: running mean 0, var 1 -> x / sqrt(1 + 1e-5)
    xs = x / math.sqrt(1 + 1e-5)
    expected = (xs @ w1.T + xs @ w2.T) / 2
    assert torch.allclose(ens(x), expected, atol=1e-6)
    assert len(ens.bn_losses()) == 2   # one hook per teacher BN layer
    # BN term of one teacher: ||1 - var||_2 + ||0 - mean||_2 over the batch of one: var 0, mean x
    assert ens.bn_losses()[0].item() == pytest.approx(math.sqrt(2) + math.sqrt(5), abs=1e-5)
    assert all(not p.requires_grad for m in ens.models for p in m.parameters())
    assert torch.equal(template.fc.weight, template.fc.weight.detach())   # the template is untouched
    assert not torch.equal(template.fc.weight, w1) or not torch.equal(template.fc.weight, w2)
    ens.close()


def test_dense_generator_has_the_classifier_image_shape_in_tanh_range():
    g = dense.Generator(z_dim=8, image_size=12, channels=3, ngf=4)
    x = g(torch.randn(5, 8))
    assert x.shape == (5, 3, 12, 12) and float(x.detach().abs().max()) <= 1.0
    with pytest.raises(ValueError, match="multiple of 4"):
        dense.Generator(8, 14, 3, 4)


def test_zz_dense_engine_run_uploads_only_the_local_model_and_distils_the_declared_steps(run_sim):
    """The engine runs one round; each client uploads exactly its trained model (part "model"), nothing else; the
    server's student takes classifier_steps steps (the run's budget), each after a generator step; the global model
    changed from the initial weights."""
    from hfpfl.algorithms.dense import DENSEConfig

    sim, res = run_sim("dense", DENSEConfig(classifier_steps=3, z_dim=8, generator_width=4), num_rounds=1,
                       local_steps=2)
    assert res["num_rounds"] == 1
    assert all(set(u.upload) == {"model"} and set(u.upload["model"]) == set(sim.algorithm.global_keys)
               for u in sim.last_updates)
    assert res["budget"]["optimizer_steps_per_model"] == 3


# ------------------------------------------------------------------------------------------------ FedD3
def test_rbf_kernel_by_hand():
    a, b = torch.tensor([[0.0], [1.0]]), torch.tensor([[0.0], [2.0]])
    k = rbf_kernel(a, b)
    assert torch.allclose(k, torch.tensor([[1.0, math.exp(-4)], [math.exp(-1), math.exp(-1)]]), atol=1e-7)
    # D = 2 inputs, gamma 0.5: exp(-||(1, 1)||^2 / (0.5 * 2)) = exp(-2)
    assert rbf_kernel(torch.zeros(1, 2), torch.ones(1, 2), 0.5).item() == pytest.approx(math.exp(-2), abs=1e-7)
    # gamma 2, D = 2: exp(-2 / 4)
    assert rbf_kernel(torch.zeros(1, 2), torch.ones(1, 2), 2.0).item() == pytest.approx(math.exp(-0.5), abs=1e-7)


@pytest.mark.parametrize("reg", [0.0, 0.5])
def test_kip_loss_by_hand(reg):
    """Support (0), (1) with labels e_0, e_1; target (0.5) with label e_0. K_ss = [[1, a], [a, 1]], a = e^-1,
    K_ts = e^-0.25 (1, 1); lam = reg * trace / 2 = reg; (1, 1)(K_ss + lam I)^-1 = (1, 1) / (1 + lam + a), so the
    prediction is p (1, 1), p = e^-0.25 / (1 + lam + a); loss = 1/2 mean((1 - p)^2, p^2)."""
    p = math.exp(-0.25) / (1 + reg + math.exp(-1))
    loss = kip_loss(torch.tensor([[0.0], [1.0]]), torch.eye(2), torch.tensor([[0.5]]), torch.tensor([[1.0, 0.0]]),
                    reg=reg)
    assert loss.item() == pytest.approx(0.25 * ((1 - p) ** 2 + p ** 2), abs=1e-6)
    # gamma 2 (D = 1): a = e^-1/2, K_ts = e^-1/8 (1, 1)
    p = math.exp(-0.125) / (1 + reg + math.exp(-0.5))
    loss = kip_loss(torch.tensor([[0.0], [1.0]]), torch.eye(2), torch.tensor([[0.5]]), torch.tensor([[1.0, 0.0]]),
                    reg=reg, gamma=2.0)
    assert loss.item() == pytest.approx(0.25 * ((1 - p) ** 2 + p ** 2), abs=1e-6)


def test_one_kip_step_moves_each_pixel_by_lr_against_the_hand_gradient():
    """Client images: two of class 0, one of class 1, 3 classes in the task; the support starts at one real image
    per class (class 0's drawn by the client's generator, without replacement). Adam's first step moves each pixel
    by lr * sign(dL/dx) of the KIP loss written out here (RBF with gamma 2, reg 0.1, one-hot labels over 3 classes),
    then clips to [-1, 1]."""
    x = torch.tensor([[[[0.2, -0.4]]], [[[0.9, 0.1]]], [[[0.3, -0.2]]]])   # 1 channel, 1 x 2 pixels
    y = torch.tensor([0, 1, 0])
    xs, ys, losses = distill(x, y, 3, 1, 1, 0.01, 0.1, 2.0, torch.Generator().manual_seed(0))
    first0 = [0, 2][int(torch.randperm(2, generator=torch.Generator().manual_seed(0))[0])]
    init = torch.stack([x[first0], x[1]])
    assert torch.equal(ys, torch.tensor([0, 1]))
    s = init.flatten(1).clone().requires_grad_(True)
    t = x.flatten(1)
    ks = torch.exp(-((s[:, None] - s[None]) ** 2).sum(-1) / 4)
    kt = torch.exp(-((t[:, None] - s[None]) ** 2).sum(-1) / 4)
    lam = 0.1 * torch.trace(ks) / 2
    eye3 = torch.eye(3)
    pred = kt @ torch.linalg.inv(ks + lam * torch.eye(2)) @ eye3[[0, 1]]
    hand = 0.5 * ((eye3[[0, 1, 0]] - pred) ** 2).mean()
    hand.backward()
    assert losses == [pytest.approx(hand.item(), abs=1e-6)]
    g = s.grad.view_as(init)
    assert bool((g.abs() > 1e-6).all())
    assert torch.allclose(xs, (init - 0.01 * torch.sign(g)).clamp(-1, 1), atol=1e-6)


def test_kip_pixels_stay_in_the_model_input_range():
    """Large steps push pixels past +-1; every step clips them back, so some sit exactly at the bounds."""
    x = torch.tensor([[[[0.9, -0.9]]], [[[-0.8, 0.8]]], [[[0.5, 0.4]]]])
    xs, _, _ = distill(x, torch.tensor([0, 1, 0]), 2, 1, 3, 5.0, 0.1, 1.0, torch.Generator().manual_seed(1))
    assert float(xs.max()) <= 1.0 and float(xs.min()) >= -1.0
    assert bool(((xs == 1.0) | (xs == -1.0)).any())


def test_init_support_takes_per_class_real_images_in_class_order():
    x = torch.arange(5.0).view(5, 1, 1, 1)
    y = torch.tensor([2, 0, 2, 0, 2])
    xs, ys = init_support(x, y, 2, torch.Generator().manual_seed(0))
    assert ys.tolist() == [0, 0, 2, 2] and ys.dtype == torch.long
    g = torch.Generator().manual_seed(0)   # class 0 (images 1, 3): a permutation; class 2 (0, 2, 4): its first two
    p0, p2 = torch.randperm(2, generator=g), torch.randperm(3, generator=g)[:2]
    assert xs.flatten().tolist() == [float([1, 3][i]) for i in p0] + [float([0, 2, 4][i]) for i in p2]
    xs, ys = init_support(x, y, 3, torch.Generator().manual_seed(5))   # class 0 has 2 < 3: with replacement
    g = torch.Generator().manual_seed(5)
    r0 = torch.randint(0, 2, (3,), generator=g)
    p2 = torch.randperm(3, generator=g)
    assert ys.tolist() == [0, 0, 0, 2, 2, 2]
    assert xs.flatten().tolist() == [float([1, 3][i]) for i in r0] + [float([0, 2, 4][i]) for i in p2]


def test_fedd3_client_uploads_only_the_distilled_set_and_the_server_trains_on_its_union(monkeypatch):
    cfg = fedd3.FedD3Config(images_per_class=2, kip_steps=3, kip_lr=0.05, kip_reg=0.1, kernel_gamma=2.0,
                            classifier_steps=7)
    seen = {}

    def fake_distill(x, y, num_classes, per_class, steps, lr, reg, gamma, generator):
        seen.update(x=x, y=y, num_classes=num_classes, per_class=per_class, steps=steps, lr=lr, reg=reg, gamma=gamma,
                    seed=generator.initial_seed())
        return torch.full((4, 1, 1, 1), 7.0), torch.tensor([0, 0, 1, 1]), [2.0, 1.5, 1.0][:steps]

    monkeypatch.setattr(fedd3, "distill", fake_distill)

    class Data(list):
        pixel_values = torch.zeros(4, 1, 1, 1)
        labels = torch.tensor([0, 1, 0, 1])

    data = {2: Data([0] * 4)}
    ctx = SimpleNamespace(train_data=lambda c: data[c], data=SimpleNamespace(num_labels=3),
                          generator=lambda r, c, tag: torch.Generator().manual_seed(100 * r + c + {"fedd3-kip": 50}[tag]))
    me = SimpleNamespace(config=cfg, ctx=ctx)
    up = FedD3.client_update(me, 2, {}, None, 0)
    assert seen.pop("x") is Data.pixel_values and seen.pop("y") is Data.labels
    assert seen == dict(num_classes=3, per_class=2, steps=3, lr=0.05, reg=0.1, gamma=2.0, seed=52)
    assert set(up.upload) == {"distilled"} and set(up.upload["distilled"]) == {"pixel_values", "labels"}
    assert torch.equal(up.upload["distilled"]["pixel_values"], torch.full((4, 1, 1, 1), 7.0))
    assert up.client_id == 2 and up.num_samples == 4 and up.metrics == {"kip_loss_first": 2.0, "kip_loss_last": 1.0}
    me.config = fedd3.FedD3Config(kip_steps=0)
    assert FedD3.client_update(me, 2, {}, None, 0).metrics == {}   # no step, no loss to report

    calls = {}
    ups = [SimpleNamespace(client_id=1, upload={"distilled": {"pixel_values": torch.ones(2, 1, 1, 1),
                                                              "labels": torch.tensor([1, 2])}}),
           SimpleNamespace(client_id=0, upload={"distilled": {"pixel_values": torch.zeros(1, 1, 1, 1),
                                                              "labels": torch.tensor([0])}})]

    def local_train(cid, r, **kw):
        calls.update(cid=cid, r=r, **kw)
        return {"steps": kw["steps"]}

    me = SimpleNamespace(config=cfg, ctx=SimpleNamespace(load=lambda v: calls.setdefault("loaded", v),
                                                         snapshot=lambda keys: {"w": torch.tensor(1.0 * len(keys))}),
                         global_keys=["w"], local_train=local_train)
    out = FedD3.aggregate(me, {"model": {"w": torch.tensor(0.0)}}, ups, 4)
    assert calls["cid"] == -1 and calls["r"] == 4 and calls["steps"] == 7 and calls["tag"] == "fedd3-classifier"
    assert calls["data"].labels.tolist() == [0, 1, 2]   # the union in client order
    assert calls["data"].pixel_values.flatten().tolist() == [0.0, 1.0, 1.0]
    assert me.server_training == {"steps": 7} and out["model"]["w"].item() == 1.0
    assert calls["loaded"] == {"w": torch.tensor(0.0)}
    assert FedD3.aggregate(me, {"model": {}}, [], 0) == {"model": {}}


# ------------------------------------------------------------------------------------------------ wiring, on stand-ins
class TinyNet(nn.Module):
    """A student / teacher: 1x1 conv -> BatchNorm -> mean pool -> linear, 3 classes."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 3)

    def forward(self, pixel_values):
        return SimpleNamespace(logits=self.fc(self.bn(self.conv(pixel_values)).mean(dim=(2, 3))))


SEEDS = {"dense-noise": 11, "dense-generator": 12, "dense-local": 13}
BATCH = {"z": torch.randn(4, 5, generator=torch.Generator().manual_seed(3)), "labels": torch.tensor([0, 1, 2, 1])}


def _dense_self(calls, cfg):
    torch.manual_seed(0)
    model = TinyNet()
    hp = SimpleNamespace(batch_size=4, optimizer="sgd", lr=0.3, momentum=0.7, weight_decay=0.0)

    def local_train(cid, r, **kw):
        calls.append(dict(cid=cid, r=r, **kw))
        if "loss_fn" in kw:   # both stages on one batch, while the server's ensemble and its hooks are live
            calls[-1]["losses"] = [fn(model, BATCH).item() for fn in kw["loss_fn"]]
        return {"steps": kw.get("steps"), "examples": 8, "train_loss": 0.5}

    ctx = SimpleNamespace(device=torch.device("cpu"), run_hparams=hp,
                          data=SimpleNamespace(image_size=4, num_channels=3, num_labels=3),
                          load=lambda v: calls.append({"loaded": v}),
                          snapshot=lambda keys: calls.append({"snapshot": keys}) or {"w": torch.tensor(2.0)},
                          seed_for=lambda r, c, tag: 1000 * r + 100 * (c + 1) + SEEDS[tag],
                          generator=lambda r, c, tag: torch.Generator().manual_seed(1000 * r + 100 * (c + 1)
                                                                                     + SEEDS[tag]),
                          train_data=lambda c: [0] * 6)
    me = SimpleNamespace(config=cfg, ctx=ctx, model=model, global_keys=["w"], local_train=local_train,
                         trainable_parameters=lambda: list(model.parameters()))
    me.noise_codes = lambda r: DENSE.noise_codes(me, r)
    return me


def test_dense_server_wiring_noise_optimizers_losses_and_budget():
    """aggregate: the server's seeded noise codes (steps x batch rows of z_dim, labels 0..C-1 from the "dense-noise"
    generator), the generator (width, seeded by "dense-generator") with Adam(generator_lr, betas (0.5, 0.999)), the
    student with the run's optimizer, the generator step = DENSE's loss with the config's weights on the ensemble of
    the uploads, the student step = the KL at T on the generator's batch; classifier_steps steps; the budget is the
    student's."""
    from hfpfl.algorithms.dense import DENSEConfig, logits_of

    calls = []
    cfg = DENSEConfig(classifier_steps=3, generator_lr=0.02, z_dim=5, generator_width=2, oh_weight=0.5,
                      bn_weight=0.25, adv_weight=2.0, temperature=3.0)
    me = _dense_self(calls, cfg)
    teacher_states = [{k: v * (i + 1) for k, v in me.model.state_dict().items() if k.endswith("weight")}
                      for i in range(2)]
    ups = [SimpleNamespace(client_id=1, upload={"model": teacher_states[1]}),
           SimpleNamespace(client_id=0, upload={"model": teacher_states[0]})]
    import copy

    before = copy.deepcopy(me.model)   # the student as the generator step saw it (running statistics included)
    out = DENSE.aggregate(me, {"model": {"w": torch.tensor(1.0)}}, ups, 2)
    assert out == {"model": {"w": torch.tensor(2.0)}}
    assert calls[0] == {"loaded": {"w": torch.tensor(1.0)}}
    kw = calls[1]
    assert kw["cid"] == -1 and kw["r"] == 2 and kw["steps"] == 3 and kw["tag"] == "dense-distill"
    g = torch.Generator().manual_seed(2000 + SEEDS["dense-noise"])
    z = torch.randn(12, 5, generator=g)
    y = torch.randint(0, 3, (12,), generator=g)
    assert torch.equal(kw["data"].columns["z"], z) and torch.equal(kw["data"].columns["labels"], y)
    gen = me.generator
    assert gen.l1.out_features == 2 * 2 * 1 and gen.conv[-2].out_channels == 3   # width 2, 4 px = 1 x 1 seed map
    torch.manual_seed(2000 + SEEDS["dense-generator"])   # the generator's initial weights: the server's seed
    fresh = dense.Generator(5, 4, 3, 2)
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), gen.parameters()))
    gen_params, student_params = kw["params"]
    assert gen_params == list(gen.parameters()) and student_params == list(me.model.parameters())
    g_opt, s_opt = kw["optimizer"](gen_params, me.ctx.run_hparams), kw["optimizer"](student_params,
                                                                                     me.ctx.run_hparams)
    assert isinstance(g_opt, torch.optim.Adam) and g_opt.defaults["lr"] == 0.02
    assert g_opt.defaults["betas"] == (0.5, 0.999)
    assert isinstance(s_opt, torch.optim.SGD) and s_opt.defaults["lr"] == 0.3 and s_opt.defaults["momentum"] == 0.7
    assert me.server_training == {"steps": 3, "examples": 8, "train_loss": 0.5}
    # the two loss functions on a batch, against their definitions on the same teachers
    loss, s_loss = kw["losses"]
    batch = BATCH
    teachers = []
    for st in teacher_states:
        t = copy_model(before, st)
        teachers.append(t)
    x = gen(batch["z"])
    t_logits = torch.stack([logits_of(t, x) for t in teachers]).mean(0)
    hooks_bn = []
    for t in teachers:
        for m in t.modules():
            if isinstance(m, nn.BatchNorm2d):
                xin = t.conv(x)
                hooks_bn.append(torch.norm(m.running_var - xin.var((0, 2, 3), unbiased=False), 2)
                                + torch.norm(m.running_mean - xin.mean((0, 2, 3)), 2))
    s_logits = logits_of(before.eval(), x)
    expected, _ = generator_loss(t_logits, s_logits, batch["labels"], hooks_bn, 0.5, 0.25, 2.0)
    assert loss == pytest.approx(expected.item(), rel=1e-5)
    assert s_loss == pytest.approx(kl_per_sample(logits_of(me.model, x.detach()), t_logits.detach(),
                                                        3.0).mean().item(), rel=1e-5)


def copy_model(template, state):
    import copy

    m = copy.deepcopy(template)
    m.load_state_dict({**template.state_dict(), **state})
    return m.eval()


def test_dense_client_trains_with_the_engine_and_uploads_its_model():
    calls = []
    me = _dense_self(calls, dense.DENSEConfig())
    up = DENSE.client_update(me, 2, {"model": {"w": torch.tensor(0.0)}}, None, 5)
    assert calls[0] == {"loaded": {"w": torch.tensor(0.0)}}
    assert calls[1] == {"cid": 2, "r": 5, "tag": "dense-local"}
    assert up.client_id == 2 and up.upload == {"model": {"w": torch.tensor(2.0)}} and up.num_samples == 6
    assert up.metrics == {"steps": None, "examples": 8, "train_loss": 0.5}
