"""``kd_teacher_mode`` of the server-side distillation (PerAda Sec. 4 / Alg. 1 Line 21, FedDF) against hand values, on
the tiny model of test_distill_pins: ``z = W h + b`` with ``h = (x - mu) / sqrt(var + 1e-5)`` (BatchNorm1d(2) without
affine parameters) and the 4 known inputs X.

eval (default): every teacher normalises with its own running statistics. train (the PerAda / FedDF code's teachers,
called right after their local training): every teacher normalises with the statistics of the batch it sees -- the
pool in batches of the run's eval batch size -- with the biased variance, whatever its running statistics; those
running statistics are put back afterwards. The batch statistics are written out below by plain arithmetic."""
import math

import pytest
import torch

from hfpfl.algorithms.distill import KDConfig, _teacher_logits, ensemble_distill
from test_distill_pins import STUDENT, TEACHERS, X, _algo, _state, pool  # noqa: F401  (pool: a fixture)

EPS = 1e-5


def _d(v):
    return torch.tensor(v, dtype=torch.float64)


def _hand(rows, mean, var, W, b):
    """W h + b for each row with h = (x - mean) / sqrt(var + eps), written out element by element."""
    out = []
    for x in rows:
        h = [(x[j] - mean[j]) / math.sqrt(var[j] + EPS) for j in range(2)]
        out.append([W[i][0] * h[0] + W[i][1] * h[1] + b[i] for i in range(3)])
    return out


def _mean_over_teachers(per_teacher):
    return [[sum(t[r][c] for t in per_teacher) / len(per_teacher) for c in range(3)] for r in range(len(X))]


# batch statistics of X by hand (biased variance: BatchNorm's normalisation in train mode)
# whole pool: column 0 = 1, 0, 2, -1 -> mean 0.5, var (0.25 + 0.25 + 2.25 + 2.25) / 4 = 1.25
#             column 1 = 0, 1, -1, 1 -> mean 0.25, var (0.0625 + 0.5625 + 1.5625 + 0.5625) / 4 = 0.6875
WHOLE = ((0.5, 0.25), (1.25, 0.6875))
# batches of 2: rows (1, 0), (0, 1) -> mean (0.5, 0.5), var (0.25, 0.25)
#               rows (2, -1), (-1, 1) -> mean (0.5, 0.0), var (2.25, 1.0)
HALVES = (((0.5, 0.5), (0.25, 0.25)), ((0.5, 0.0), (2.25, 1.0)))


def _eval_hand():
    return _mean_over_teachers([_hand(X, t["bn.running_mean"], t["bn.running_var"], t["fc.weight"], t["fc.bias"])
                                for t in TEACHERS])


def _train_hand(batches):
    per_teacher = []
    for t in TEACHERS:
        rows = []
        for (lo, hi), (mean, var) in batches:
            rows += _hand(X[lo:hi], mean, var, t["fc.weight"], t["fc.bias"])
        per_teacher.append(rows)
    return _mean_over_teachers(per_teacher)


def _run(mode, eval_batch_size, algo=None):
    algo = algo or _algo(eval_batch_size=eval_batch_size)
    keys = list(_state(STUDENT))
    before = {k: v.clone() for k, v in algo.ctx.model_state.items()}
    z = _teacher_logits(algo.ctx, algo.model, [_state(t) for t in TEACHERS], keys, torch.tensor(X),
                        KDConfig(kd_teacher_mode=mode), 1)
    return algo, before, z


def test_eval_teachers_use_their_running_statistics():
    """kd_teacher_mode='eval' (default): the mean of the teachers' logits, each with its own running mean / var."""
    assert KDConfig().kd_teacher_mode == "eval"
    _, _, z = _run("eval", 3)
    torch.testing.assert_close(z.double(), _d(_eval_hand()), rtol=0, atol=1e-5)


@pytest.mark.parametrize("eval_batch_size,batches", [
    (4, [((0, 4), WHOLE)]),
    (2, [((0, 2), HALVES[0]), ((2, 4), HALVES[1])]),
])
def test_train_teachers_use_batch_statistics_and_leave_running_statistics(eval_batch_size, batches):
    """kd_teacher_mode='train': each teacher normalises each batch of the pool (eval batch size 4: one batch; 2: two)
    with that batch's mean and biased variance -- the hand values above, whatever the teacher's running statistics --
    so the logits differ from eval mode's; afterwards the model's BatchNorm buffers (running mean / var and
    num_batches_tracked) hold exactly what they held before, and the model is back in eval mode."""
    algo, before, z = _run("train", eval_batch_size)
    expect = _d(_train_hand(batches))
    torch.testing.assert_close(z.double(), expect, rtol=0, atol=1e-5)
    assert float((expect - _d(_eval_hand())).abs().max()) > 0.1        # the two modes do differ on these weights
    after = algo.ctx.model_state
    for k in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        assert torch.equal(after[k], before[k]), k
    assert not algo.model.training


def test_train_teachers_feed_the_distillation_loss(pool):  # noqa: F811
    """End to end through ensemble_distill: with kd_teacher_mode='train' the first logged KD loss is KL(p_t || q_s)
    with p_t = softmax of the batch-statistics teacher logits (eval batch size 4) and q_s the student in eval mode
    (its running statistics), T = 1, batch mean; with the default it is the same KL with the eval teachers."""
    student = STUDENT

    def kl(z_t):
        q = _hand(X, student["bn.running_mean"], student["bn.running_var"], student["fc.weight"], student["fc.bias"])
        total = 0.0
        for zt, zs in zip(z_t, q):
            lse_t = math.log(sum(math.exp(v) for v in zt))
            lse_s = math.log(sum(math.exp(v) for v in zs))
            total += sum(math.exp(a - lse_t) * ((a - lse_t) - (s - lse_s)) for a, s in zip(zt, zs))
        return total / len(z_t)

    for mode, z_t in (("train", _train_hand([((0, 4), WHOLE)])), ("eval", _eval_hand())):
        algo = _algo(eval_batch_size=4)
        cfg = KDConfig(kd_steps=1, kd_lr=0.1, kd_batch_size=64, kd_teacher_mode=mode)
        out, metrics = ensemble_distill(algo, _state(STUDENT), [_state(t) for t in TEACHERS], cfg, 1)
        assert metrics["kd_loss_first"] == pytest.approx(kl(z_t), rel=1e-5), mode
        assert int(out["bn.num_batches_tracked"]) == 5 and torch.equal(out["bn.running_mean"],
                                                                       torch.tensor(STUDENT["bn.running_mean"]))


def test_train_teachers_do_not_touch_the_global_rng():
    """The teachers' dropout draws come from the run's KD generator inside a forked RNG: the global torch RNG state
    is the same after the call as before it."""
    algo = _algo(eval_batch_size=4)     # the model's init draws from the global RNG: before the state is taken
    torch.manual_seed(123)
    state = torch.get_rng_state()
    _run("train", 4, algo)
    assert torch.equal(torch.get_rng_state(), state)


def test_kd_teacher_mode_is_a_declared_option():
    """Anything but eval / train is refused in one line naming the option."""
    with pytest.raises(ValueError, match=r"^--kd_teacher_mode must be one of eval, train, got 'batch'$"):
        KDConfig(kd_teacher_mode="batch")


class _Dropped(torch.nn.Module):
    """x -> Dropout(0.5)(x) @ W.T: in train mode each input is zeroed or doubled."""

    def __init__(self):
        super().__init__()
        self.drop = torch.nn.Dropout(0.5)
        self.fc = torch.nn.Linear(2, 3, bias=False)

    def forward(self, pixel_values, labels=None):
        from types import SimpleNamespace
        return SimpleNamespace(logits=self.fc(self.drop(pixel_values)))


def test_train_teachers_dropout_is_active_and_drawn_from_the_runs_kd_seed():
    """kd_teacher_mode='train' switches the teachers' dropout on (every input coordinate of the mean teacher logits
    is 0 or 2x its eval value, and some are 0), and its draw comes from the seed of the run's KD generator
    (round, -1, 'kd-teacher'): the same under any global RNG state, different under another seed."""
    from types import SimpleNamespace

    asked = []

    def run(global_seed, kd_seed):
        model = _Dropped()
        sim = SimpleNamespace(model_state=model.state_dict(), run=SimpleNamespace(eval_batch_size=8), device="cpu",
                              generator=lambda r, c, tag: asked.append((r, c, tag)) or
                              torch.Generator().manual_seed(kd_seed))
        W = {"fc.weight": torch.eye(3, 2)}                 # logits = (x0', x1', 0): the dropped inputs themselves
        torch.manual_seed(global_seed)
        x = torch.ones(64, 2)
        return _teacher_logits(sim, model, [W], ["fc.weight"], x, KDConfig(kd_teacher_mode="train"), 1)

    a, b, c = run(1, 0), run(2, 0), run(1, 7)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert asked == [(1, -1, "kd-teacher")] * 3  # the server's stream of this round (client id -1), its own tag
    kept = a[:, :2]
    assert set(kept.unique().tolist()) == {0.0, 2.0}
