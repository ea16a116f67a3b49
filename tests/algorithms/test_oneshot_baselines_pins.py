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
from hfpfl.algorithms.dense import BNStatistics, Ensemble, generator_loss, kl_per_sample
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


def test_dense_run_uploads_only_the_local_model_and_distils_the_declared_steps(run_sim):
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


@pytest.mark.parametrize("reg", [0.0, 0.5])
def test_kip_loss_by_hand(reg):
    """Support (0), (1) with labels e_0, e_1; target (0.5) with label e_0. K_ss = [[1, a], [a, 1]], a = e^-1,
    K_ts = e^-0.25 (1, 1); lam = reg * trace / 2 = reg; (1, 1)(K_ss + lam I)^-1 = (1, 1) / (1 + lam + a), so the
    prediction is p (1, 1), p = e^-0.25 / (1 + lam + a); loss = 1/2 mean((1 - p)^2, p^2)."""
    p = math.exp(-0.25) / (1 + reg + math.exp(-1))
    loss = kip_loss(torch.tensor([[0.0], [1.0]]), torch.eye(2), torch.tensor([[0.5]]), torch.tensor([[1.0, 0.0]]),
                    reg=reg)
    assert loss.item() == pytest.approx(0.25 * ((1 - p) ** 2 + p ** 2), abs=1e-6)


def test_one_kip_step_moves_each_pixel_by_lr_against_the_hand_gradient():
    """One image per class as the client's data: the support starts at exactly those images (KIP's init); Adam's
    first step moves each pixel by lr * sign(dL/dx) of the KIP loss written out here (RBF, reg 0), then clips to
    [-1, 1]: the pixel at 0.999 pushed up stays at 1."""
    x = torch.tensor([[[[0.2, -0.4]]], [[[0.999, 0.1]]], [[[0.3, -0.2]]]])   # 3 images, 1 channel, 1 x 2 pixels
    y = torch.tensor([0, 1, 0])
    # classes 0 and 1 on this client; class 0 has two images, so the init is a random one of them: use a single
    # image per class for the hand step
    x1, y1 = x[:2], y[:2]
    xs, ys, losses = distill(x1, y1, num_classes=2, per_class=1, steps=1, lr=0.01, reg=0.0, gamma=1.0,
                             generator=torch.Generator().manual_seed(0))
    assert torch.equal(ys, torch.tensor([0, 1]))
    # the hand loss: support = the two images, target = the same two images
    s = x1.clone().flatten(1).requires_grad_(True)
    t = x1.flatten(1)
    ks = torch.exp(-((s[:, None] - s[None]) ** 2).sum(-1) / 2)
    kt = torch.exp(-((t[:, None] - s[None]) ** 2).sum(-1) / 2)
    pred = kt @ torch.linalg.inv(ks) @ torch.eye(2)
    hand = 0.5 * ((torch.eye(2) - pred) ** 2).mean()
    hand.backward()
    assert losses[0] == pytest.approx(hand.item(), abs=1e-6)
    g = s.grad.view_as(x1)
    expected = (x1 - 0.01 * torch.sign(g)).clamp(-1, 1)
    moved = g.abs() > 1e-6
    assert torch.allclose(xs[moved], expected[moved], atol=1e-6)
    assert xs.max() <= 1.0


def test_init_support_takes_per_class_real_images_in_class_order():
    x = torch.arange(5.0).view(5, 1, 1, 1)
    y = torch.tensor([2, 0, 2, 0, 2])
    xs, ys = init_support(x, y, 2, torch.Generator().manual_seed(0))
    assert ys.tolist() == [0, 0, 2, 2]
    assert sorted(xs[:2].flatten().tolist()) == [1.0, 3.0]   # both class-0 images, without replacement
    assert set(xs[2:].flatten().tolist()) <= {0.0, 2.0, 4.0} and len(set(xs[2:].flatten().tolist())) == 2
    xs, ys = init_support(x, y, 3, torch.Generator().manual_seed(0))   # class 0 has 2 < 3: with replacement
    assert ys.tolist() == [0, 0, 0, 2, 2, 2] and set(xs[:3].flatten().tolist()) <= {1.0, 3.0}


def test_fedd3_client_uploads_only_the_distilled_set_and_the_server_trains_on_its_union(monkeypatch):
    cfg = fedd3.FedD3Config(images_per_class=2, kip_steps=3, kip_lr=0.05, kip_reg=0.1, kernel_gamma=2.0,
                            classifier_steps=7)
    seen = {}

    def fake_distill(x, y, num_classes, per_class, steps, lr, reg, gamma, generator):
        seen.update(num_classes=num_classes, per_class=per_class, steps=steps, lr=lr, reg=reg, gamma=gamma,
                    seed=generator.initial_seed())
        return torch.full((4, 1, 1, 1), float(len(seen))), torch.tensor([0, 0, 1, 1]), [2.0, 1.0]

    monkeypatch.setattr(fedd3, "distill", fake_distill)

    class Data(list):
        pixel_values = torch.zeros(4, 1, 1, 1)
        labels = torch.tensor([0, 1, 0, 1])

    ctx = SimpleNamespace(train_data=lambda c: Data([0] * 4), data=SimpleNamespace(num_labels=3),
                          generator=lambda r, c, tag: torch.Generator().manual_seed(100 * r + c + len(tag)))
    me = SimpleNamespace(config=cfg, ctx=ctx)
    up = FedD3.client_update(me, 2, {}, None, 0)
    assert seen == dict(num_classes=3, per_class=2, steps=3, lr=0.05, reg=0.1, gamma=2.0, seed=2 + len("fedd3-kip"))
    assert set(up.upload) == {"distilled"} and set(up.upload["distilled"]) == {"pixel_values", "labels"}
    assert up.num_samples == 4 and up.metrics == {"kip_loss_first": 2.0, "kip_loss_last": 1.0}

    calls = {}
    ups = [SimpleNamespace(client_id=1, upload={"distilled": {"pixel_values": torch.ones(2, 1, 1, 1),
                                                              "labels": torch.tensor([1, 2])}}),
           SimpleNamespace(client_id=0, upload={"distilled": {"pixel_values": torch.zeros(1, 1, 1, 1),
                                                              "labels": torch.tensor([0])}})]

    def local_train(cid, r, **kw):
        calls.update(cid=cid, r=r, **kw)
        return {"steps": kw["steps"]}

    me = SimpleNamespace(config=cfg, ctx=SimpleNamespace(load=lambda v: calls.setdefault("loaded", v),
                                                         snapshot=lambda keys: {"w": torch.tensor(1.0)}),
                         global_keys=["w"], local_train=local_train)
    out = FedD3.aggregate(me, {"model": {"w": torch.tensor(0.0)}}, ups, 4)
    assert calls["cid"] == -1 and calls["r"] == 4 and calls["steps"] == 7 and calls["tag"] == "fedd3-classifier"
    assert calls["data"].labels.tolist() == [0, 1, 2]   # the union in client order
    assert calls["data"].pixel_values.flatten().tolist() == [0.0, 1.0, 1.0]
    assert me.server_training == {"steps": 7} and out["model"]["w"].item() == 1.0
    assert FedD3.aggregate(me, {"model": {}}, [], 0) == {"model": {}}
