"""Server-side ensemble distillation (PerAda's Line 21, FedDF), pinned by hand: the KD loss on known logits, the
loss and the first Adam step of a real distillation against an independent computation, and BatchNorm running
statistics left as the average made them (the student's BNs in eval mode)."""
import math

import pytest
import torch
from torch import nn

from hfpfl.algorithms.base import MODEL
from hfpfl.algorithms.distill import KDConfig, ensemble_distill, kd_loss, public_pool
from hfpfl.algorithms.perada import PerAdaConfig
from hfpfl.federated.state import load_into
from hfpfl.models.pretrained import default_repo_id

BACKBONE = default_repo_id("tiny-resnet")


def test_kd_loss_is_kl_teacher_to_student_at_temperature_without_t_squared():
    """PerAda Sec. 4: l_KL = KL(softmax(z_t / T) || softmax(z_s / T)), teacher first; batch mean; the PerAda and
    FedDF code have no T^2 factor. Known logits, T = 2, the value written out with math."""
    s = torch.tensor([[0.0, 1.0, 2.0], [1.0, 0.0, 0.0]])
    t = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 3.0]])
    T = 2.0

    def softmax(row):
        e = [math.exp(v / T) for v in row]
        return [x / sum(e) for x in e]

    def kl(p, q):
        return sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q))

    rows = [kl(softmax(tr), softmax(sr)) for tr, sr in zip(t.tolist(), s.tolist())]
    by_hand = sum(rows) / 2
    # row 0: p_t = softmax([1, 0, 0]), p_s = softmax([0, .5, 1]) (numbers for the reader)
    assert rows[0] == pytest.approx(0.3870, abs=1e-4)
    assert float(kd_loss(s, t, T)) == pytest.approx(by_hand, rel=1e-6)
    reverse = sum(kl(softmax(sr), softmax(tr)) for tr, sr in zip(t.tolist(), s.tolist())) / 2
    assert abs(by_hand - reverse) > 0.01                        # the direction is visible in the value
    assert abs(by_hand - T * T * by_hand) > 0.05                 # so is a T^2 factor
    assert float(kd_loss(s, t, 1.0)) == pytest.approx(
        sum(kl(softmax([v * 2 for v in tr]), softmax([v * 2 for v in sr])) for tr, sr in zip(t.tolist(), s.tolist()))
        / 2, rel=1e-6)                                            # T = 1: the plain softmax


def _bn_buffers(state):
    return {k: v for k, v in state.items() if "running_" in k or "num_batches_tracked" in k}


@pytest.fixture
def kd_round(run_sim, request):
    """One round of ``method`` without KD: its uploads are the teachers and the average is the student. Dropout off
    (the adapter's default 0.3) so that the student's logits are a function of its weights. PerAda runs on the
    pretrained stand-in backbone (temporary Hub cache), FedDF on the plain tiny ResNet."""
    def make(method):
        if method == "perada":
            request.getfixturevalue("pretrained_backbone")
            cfg = PerAdaConfig(use_kd=False)
            kw = dict(model=BACKBONE, adapter="residual")
        else:
            cfg = KDConfig(use_kd=False)
            kw = dict(model="tiny-resnet", adapter="none")
        sim, _ = run_sim(method, cfg, run=False, num_rounds=1, momentum=0.0, local_steps=3, output_dir=method, **kw)
        for m in sim.model.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0
        sim.run()
        algo = sim.algorithm
        if method == "perada":
            algo._activate("default")
        # the uploads, pulled apart (a seeded N(0, 0.1^2) on every parameter; BN buffers as uploaded) so that the
        # teachers disagree with their average by a loss well above float32 round-off
        params, g = dict(sim.model.named_parameters()), torch.Generator().manual_seed(3)
        teachers = [{k: v + 0.1 * torch.randn(v.shape, generator=g) if k in params else v
                     for k, v in u.upload[MODEL].items()} for u in sim.last_updates]
        keys = list(teachers[0])
        student = {k: torch.stack([t[k].double() for t in teachers]).mean(0).to(teachers[0][k].dtype)
                   if teachers[0][k].is_floating_point() else teachers[0][k] for k in keys}
        return sim, algo, student, teachers
    return make


@pytest.mark.parametrize("method", ["perada", "feddf"])
def test_distillation_loss_and_first_adam_step_by_hand_and_bn_statistics_unchanged(kd_round, method):
    """One KD step on a 24-image pool (one batch): the logged loss is KL(mean teacher logits / T || student / T),
    computed here from the model's own forward passes; the step is Adam's first step lr * g / (|g| + eps) on every
    trainable tensor (g = the gradient of that hand loss); BatchNorm running statistics and num_batches_tracked come
    back exactly as the average had them. Catches: a reversed KL, a dropped temperature, an added T^2, a dead
    optimizer step (lr ~ 0), teachers not averaged, and the student's BNs taking the pool's statistics."""
    sim, algo, student, teachers = kd_round(method)
    cfg = type(algo.config)(kd_steps=1, kd_lr=1e-3, kd_temperature=2.0, kd_pool_size=24, kd_batch_size=32)
    pixels, _ = public_pool(sim.ctx, cfg)
    assert len(pixels) == 24
    model, T, keys = sim.model, 2.0, list(student)

    def logits(state):
        load_into(sim.model_state, state)
        model.eval()
        return model(pixel_values=pixels.to(sim.device)).logits

    with torch.no_grad():
        z_t = sum(logits(t) for t in teachers) / len(teachers)
    model.zero_grad(set_to_none=True)
    z_s = logits(student)
    p_t = torch.softmax(z_t / T, -1)
    by_hand = (p_t * (torch.log(p_t) - torch.log_softmax(z_s / T, -1))).sum(-1).mean()
    by_hand.backward()
    named = dict(model.named_parameters())
    trained = [k for k in keys if k in named and named[k].requires_grad]
    grads = {k: named[k].grad.detach().clone() for k in trained}
    model.zero_grad(set_to_none=True)

    out, metrics = ensemble_distill(algo, student, teachers, cfg, 1)
    assert metrics["kd_steps"] == 1
    assert metrics["kd_loss_first"] == pytest.approx(float(by_hand.detach()), rel=1e-4)
    assert float(by_hand.detach()) > 1e-3                                    # teachers and student do disagree
    moved = 0
    for k in trained:
        step = -1e-3 * grads[k] / (grads[k].abs() + 1e-8)           # Adam, step 1 (bias-corrected), lr = kd_lr
        delta, clear = out[k] - student[k], grads[k].abs() > 1e-6   # below, float32 round-off of g decides
        assert torch.allclose(delta[clear], step[clear], atol=3e-7), k
        assert float(delta.abs().max()) <= 1e-3 + 3e-7, k
        moved += int(clear.sum())
    assert moved > 0.1 * sum(grads[k].numel() for k in trained)        # most of the step is pinned
    bufs = _bn_buffers(student)
    assert bufs and all(torch.equal(out[k], v) for k, v in bufs.items())
    assert set(out) == set(student)


@pytest.mark.parametrize("method", ["perada", "feddf"])
def test_student_bn_train_mode_is_the_codes_behaviour_and_rewrites_statistics(kd_round, method):
    """``kd_student_bn='train'`` (the PerAda/FedDF code): the pool's batch statistics enter the running statistics:
    num_batches_tracked advances by exactly the number of KD steps on every trainable BN; the default leaves it."""
    sim, algo, student, teachers = kd_round(method)
    cfg = type(algo.config)(kd_steps=3, kd_pool_size=24, kd_batch_size=8, kd_student_bn="train")
    out, _ = ensemble_distill(algo, student, teachers, cfg, 1)
    counts = {k: v for k, v in student.items() if k.endswith("num_batches_tracked")}
    assert counts and all(int(out[k]) == int(v) + 3 for k, v in counts.items())
    assert all(not torch.equal(out[k], student[k]) for k in student if k.endswith("running_mean"))
    cfg = type(algo.config)(kd_steps=3, kd_pool_size=24, kd_batch_size=8)
    out, _ = ensemble_distill(algo, student, teachers, cfg, 1)
    assert all(torch.equal(out[k], v) for k, v in _bn_buffers(student).items())


def test_kd_student_bn_is_a_declared_option():
    from hfpfl.options import validate

    with pytest.raises(ValueError, match="--kd_student_bn"):
        validate(KDConfig(kd_student_bn="frozen"))
