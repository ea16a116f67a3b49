"""Server-side ensemble distillation (PerAda Sec. 4 / Alg. 1 Line 21, FedDF) and FedDF's aggregation against hand
values, on a model small enough to write out: ``z = W h + b`` with ``h = (x - mu) / sqrt(var + 1e-5)`` (a
BatchNorm1d(2) without affine parameters, then a Linear(2, 3)), 4 known inputs, known teacher and student weights.

The distillation of two steps is recomputed here in float64 from the paper's loss, with nothing from the code:
teacher logits = the mean of the teachers' logits (teachers in eval mode: their own running statistics), loss
KL(softmax(z_t / T) || softmax(z_s / T)) averaged over the batch, its gradient (softmax(z_s / T) - p_t) / (T B) with
respect to z_s, Adam (betas 0.9 / 0.999, eps 1e-8) with the learning rate cosine-annealed from kd_lr to 0 over
kd_steps (step 2 of 2 runs at kd_lr / 2). The pool, the checkpoint selection and the option checks are pinned on
stand-in objects that carry exactly what the functions read."""
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from datasets import Dataset
from torch import nn

import hfpfl.algorithms.distill as distill
import hfpfl.algorithms.feddf as feddf
from hfpfl.algorithms.distill import KDConfig, _is_repo_id, _logits, ensemble_distill, ood_kd_pixels, public_pool

X = [[1.0, 0.0], [0.0, 1.0], [2.0, -1.0], [-1.0, 1.0]]
STUDENT = {"fc.weight": [[0.5, -0.5], [0.0, 1.0], [1.0, 0.0]], "fc.bias": [0.0, 0.1, -0.1],
           "bn.running_mean": [0.5, 0.0], "bn.running_var": [1.0, 4.0]}
TEACHERS = [{"fc.weight": [[1.0, 0.0], [0.0, -1.0], [0.5, 0.5]], "fc.bias": [0.2, 0.0, 0.0],
             "bn.running_mean": [0.5, 0.0], "bn.running_var": [1.0, 4.0]},
            {"fc.weight": [[-1.0, 1.0], [2.0, 0.0], [0.0, 0.0]], "fc.bias": [0.0, -0.3, 0.5],
             "bn.running_mean": [0.0, 1.0], "bn.running_var": [0.25, 1.0]},
            {"fc.weight": [[0.0, 0.5], [1.0, 1.0], [-1.0, 0.0]], "fc.bias": [0.1, 0.1, 0.1],
             "bn.running_mean": [1.0, -1.0], "bn.running_var": [2.0, 1.0]}]
EPS_BN = 1e-5


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(2, affine=False)
        self.fc = nn.Linear(2, 3)

    def forward(self, pixel_values, labels=None):
        return SimpleNamespace(logits=self.fc(self.bn(pixel_values)))


def _state(d):
    s = {k: torch.tensor(v) for k, v in d.items()}
    s["bn.num_batches_tracked"] = torch.tensor(5)
    return s


def _algo(eval_batch_size=3):
    """What ensemble_distill reads of a method: its model, the simulation's state dict / batch size / device / KD
    generator / backward, and the trainable parameters among the distilled keys."""
    model = Tiny()
    sim = SimpleNamespace(model_state=model.state_dict(), run=SimpleNamespace(eval_batch_size=eval_batch_size),
                          device="cpu", generator=lambda r, c, tag: torch.Generator().manual_seed(0),
                          backward=lambda loss: loss.backward())
    allowed = lambda keys: [p for n, p in model.named_parameters() if n in set(keys)]  # noqa: E731
    return SimpleNamespace(ctx=sim, model=model, trainable_parameters=allowed)


def _hand_logits(W, b, mu, var, x):
    return ((x - mu) / torch.sqrt(var + EPS_BN)) @ W.T + b


def _d(v):
    return torch.tensor(v, dtype=torch.float64)


def _hand_distill(steps, lr, T, student_stats="eval"):
    """(losses, W, b) after ``steps`` full-batch KD steps, in float64 from the paper's loss (module docstring)."""
    x = _d(X)
    z_t = sum(_hand_logits(_d(t["fc.weight"]), _d(t["fc.bias"]), _d(t["bn.running_mean"]), _d(t["bn.running_var"]), x)
              for t in TEACHERS) / len(TEACHERS)
    p_t = torch.softmax(z_t / T, -1)
    if student_stats == "eval":
        h = (x - _d(STUDENT["bn.running_mean"])) / torch.sqrt(_d(STUDENT["bn.running_var"]) + EPS_BN)
    else:  # batch statistics (biased variance)
        h = (x - x.mean(0)) / torch.sqrt(x.var(0, unbiased=False) + EPS_BN)
    W, b = _d(STUDENT["fc.weight"]), _d(STUDENT["fc.bias"])
    m = {"W": torch.zeros_like(W), "b": torch.zeros_like(b)}
    v = {"W": torch.zeros_like(W), "b": torch.zeros_like(b)}
    losses = []
    for t in range(1, steps + 1):
        z_s = h @ W.T + b
        log_q = torch.log_softmax(z_s / T, -1)
        losses.append(float((p_t * (torch.log(p_t) - log_q)).sum(-1).mean()))
        dz = (torch.softmax(z_s / T, -1) - p_t) / (T * len(x))
        g = {"W": dz.T @ h, "b": dz.sum(0)}
        lr_t = lr * (1 + math.cos(math.pi * (t - 1) / steps)) / 2
        new = {}
        for k, p in (("W", W), ("b", b)):
            m[k] = 0.9 * m[k] + 0.1 * g[k]
            v[k] = 0.999 * v[k] + 0.001 * g[k] ** 2
            new[k] = p - lr_t * (m[k] / (1 - 0.9 ** t)) / (torch.sqrt(v[k] / (1 - 0.999 ** t)) + 1e-8)
        W, b = new["W"], new["b"]
    return losses, W, b


@pytest.fixture
def pool(monkeypatch):
    """public_pool replaced: the 4 known inputs, and (when set) a labelled selection split."""
    seen = {"val": None, "calls": []}

    def fake_pool(sim, config):
        seen["calls"].append((sim, config))
        return torch.tensor(X), seen["val"]

    monkeypatch.setattr(distill, "public_pool", fake_pool)
    return seen


@pytest.mark.parametrize("T", [1.0, 2.0])
def test_two_kd_steps_by_hand(pool, T):
    """Two full-batch steps (pool of 4 <= kd_batch_size 64): the logged first and last losses and the student's new
    weights are the hand values; the BatchNorm running statistics and num_batches_tracked come back as the average
    had them (the student's BNs in eval mode); the teachers' logits are taken in eval mode with their own statistics
    and batched by the run's eval batch size (3: batches of 3 and 1)."""
    algo = _algo()
    algo.model.train()
    cfg = KDConfig(kd_steps=2, kd_lr=0.1, kd_temperature=T, kd_batch_size=64)
    out, metrics = ensemble_distill(algo, _state(STUDENT), [_state(t) for t in TEACHERS], cfg, 1)
    losses, W, b = _hand_distill(2, 0.1, T)
    assert pool["calls"] == [(algo.ctx, cfg)]
    assert metrics == pytest.approx({"kd_loss_first": losses[0], "kd_loss_last": losses[1], "kd_steps": 2}, rel=1e-5)
    assert losses[0] > losses[1] > 0.05                       # the hand loss does fall and is far from round-off
    torch.testing.assert_close(out["fc.weight"].double(), W, rtol=0, atol=2e-6)
    torch.testing.assert_close(out["fc.bias"].double(), b, rtol=0, atol=2e-6)
    for k in ("bn.running_mean", "bn.running_var"):
        assert torch.equal(out[k], torch.tensor(STUDENT[k])), k
    assert int(out["bn.num_batches_tracked"]) == 5
    assert set(out) == set(STUDENT) | {"bn.num_batches_tracked"}


def test_kd_batches_are_drawn_from_the_runs_kd_generator(pool):
    """With batches smaller than the pool (2 of 4 rows) the batch order comes from the simulation's generator for
    (round, -1, 'kd'), not from torch's global RNG: two distillations under different global seeds agree."""
    outs = []
    for global_seed in (1, 2):
        algo, asked = _algo(), []
        algo.ctx.generator = lambda r, c, tag: asked.append((r, c, tag)) or torch.Generator().manual_seed(0)
        torch.manual_seed(global_seed)
        cfg = KDConfig(kd_steps=2, kd_lr=0.1, kd_batch_size=2)
        outs.append(ensemble_distill(algo, _state(STUDENT), [_state(t) for t in TEACHERS], cfg, 4)[0])
        assert asked == [(4, -1, "kd")]
    assert all(torch.equal(outs[0][k], outs[1][k]) for k in outs[0])


def test_kd_student_bn_train_uses_and_rewrites_batch_statistics(pool):
    """kd_student_bn='train' (the PerAda / FedDF code): the student normalises with the pool's batch statistics, and
    its running statistics move by BatchNorm's momentum 0.1: mu <- 0.9 mu + 0.1 mean(x), var <- 0.9 var + 0.1 *
    unbiased var(x), num_batches_tracked + 1. By hand: mean(x) = (0.5, 0.25), unbiased var = (5/3, 0.9167)."""
    algo = _algo()
    cfg = KDConfig(kd_steps=1, kd_lr=0.1, kd_temperature=1.0, kd_student_bn="train")
    out, metrics = ensemble_distill(algo, _state(STUDENT), [_state(t) for t in TEACHERS], cfg, 1)
    losses, W, b = _hand_distill(1, 0.1, 1.0, student_stats="batch")
    assert metrics["kd_loss_first"] == pytest.approx(losses[0], rel=1e-5)
    torch.testing.assert_close(out["fc.weight"].double(), W, rtol=0, atol=2e-6)
    x = _d(X)
    mu = 0.9 * _d(STUDENT["bn.running_mean"]) + 0.1 * torch.tensor([0.5, 0.25], dtype=torch.float64)
    var = 0.9 * _d(STUDENT["bn.running_var"]) + 0.1 * x.var(0, unbiased=True)
    torch.testing.assert_close(out["bn.running_mean"].double(), mu, rtol=0, atol=1e-6)
    torch.testing.assert_close(out["bn.running_var"].double(), var, rtol=0, atol=1e-6)
    assert int(out["bn.num_batches_tracked"]) == 6


@pytest.mark.parametrize("accs,every,evaluated_after,best", [
    ([0.5, 0.75, 0.6], 2, [2, 3], 1),      # steps 2 and 3 scored (every 2nd and the last); step 2 is best
    ([0.5, 0.5, 0.4], 2, [2, 3], 0),       # a tie keeps the plain average
    ([0.5, 0.2, 0.3, 0.9], 1, [1, 2, 3], 3),
])
def test_checkpoint_selection_keeps_the_best_scored_state(pool, monkeypatch, accs, every, evaluated_after, best):
    """kd_val_fraction > 0 (PerAda code): the plain average is scored first, then the student after every
    kd_eval_every-th step and after the last; the returned state is the best-scoring one (the average on ties), and the
    metrics report the best and the average's accuracy. Scores are scripted; the states are those the scorer saw."""
    pool["val"] = "VAL"
    seen = []

    steps_seen = []

    def fake_evaluate(model, data, batch_size=None, device=None):
        seen.append(({k: v.detach().clone() for k, v in model.state_dict().items()}, data, batch_size, device))
        scored_after.append(len(steps_seen))
        return {"accuracy": accs[len(seen) - 1]}

    scored_after = []
    monkeypatch.setattr(distill, "evaluate", fake_evaluate)
    algo = _algo(eval_batch_size=7)
    real_train_local = distill.train_local

    def spy_train_local(*a, after_step=None, **k):
        return real_train_local(*a, after_step=lambda s: steps_seen.append(s) or after_step(s), **k)

    monkeypatch.setattr(distill, "train_local", spy_train_local)
    cfg = KDConfig(kd_steps=3, kd_lr=0.1, kd_val_fraction=0.5, kd_eval_every=every)
    student = _state(STUDENT)
    out, metrics = ensemble_distill(algo, student, [_state(t) for t in TEACHERS], cfg, 1)
    assert scored_after == [0] + evaluated_after and steps_seen == [1, 2, 3]
    assert all(s[1:] == ("VAL", 7, "cpu") for s in seen)
    assert all(torch.equal(seen[0][0][k], v) for k, v in student.items())   # the average, scored before any step
    assert all(torch.equal(out[k], seen[best][0][k]) for k in student)
    assert metrics["kd_val_accuracy"] == max(accs) and metrics["kd_val_accuracy_avg"] == 0.5
    assert metrics["kd_steps"] == 3


def test_teacher_logits_are_batched_by_the_eval_batch_size():
    """_logits: the model's logits over the whole pool, in batches of the given size (5 rows in batches of 2)."""
    model = Tiny().eval()
    x = torch.arange(10.0).reshape(5, 2)
    with torch.no_grad():
        whole = model(pixel_values=x).logits
    for bs in (1, 2, 5, 8):
        assert torch.equal(_logits(model, x, bs, "cpu"), whole), bs


# ------------------------------------------------------------------------------------------------ the pool
def _pool_sim(n_public=10, seed=0):
    """Public split: image i is a constant i / 16 and has label i (each row identifiable)."""
    pub = None
    if n_public:
        pub = Dataset.from_dict({"pixel_values": [[[[i / 16.0]]] for i in range(n_public)],
                                 "labels": list(range(n_public))}).with_format("torch")
    caches: dict = {}
    return SimpleNamespace(data=SimpleNamespace(public=pub, image_size=8, num_channels=1), run=SimpleNamespace(seed=seed),
                           cache=lambda name: caches.setdefault(name, {}))


def _ids(pixels):
    return sorted(round(float(v) * 16) for v in pixels.flatten())


def test_public_pool_in_domain_splits_selection_and_kd_rows():
    """kd_pool='public': the KD pool is the public split minus the labelled selection split; kd_val_fraction 0.35 of
    10 rows holds out round(3.5) = 4 (labels kept, matching their images); kd_public_fraction 0.7 of the other 6 keeps
    round(4.2) = 4; a tiny fraction keeps 2; everything is cached per setting and drawn from the run seed."""
    sim = _pool_sim()
    pixels, val = public_pool(sim, KDConfig(kd_pool="public"))
    assert val is None and _ids(pixels) == list(range(10))
    pixels, val = public_pool(sim, KDConfig(kd_pool="public", kd_val_fraction=0.35))
    assert len(val.labels) == 4 and _ids(val.pixel_values) == sorted(val.labels.tolist())
    assert len(pixels) == 6 and sorted(_ids(pixels) + val.labels.tolist()) == list(range(10))
    cfg = KDConfig(kd_pool="public", kd_val_fraction=0.35, kd_public_fraction=0.7)
    few, val2 = public_pool(sim, cfg)
    assert len(few) == 4 and set(_ids(few)) <= set(_ids(pixels)) and torch.equal(val2.labels, val.labels)
    assert public_pool(sim, cfg)[0] is few                         # cached
    assert len(public_pool(sim, KDConfig(kd_pool="public", kd_public_fraction=0.01))[0]) == 2
    assert len(public_pool(sim, KDConfig(kd_pool="public", kd_val_fraction=0.1))[1].labels) == 1   # round(1.0)
    again = public_pool(_pool_sim(), cfg)[0]
    assert torch.equal(again, few)                                 # the same seed, the same rows
    others = [public_pool(_pool_sim(seed=s), KDConfig(kd_pool="public"))[0] for s in (1, 2)]
    assert not all(torch.equal(o, public_pool(sim, KDConfig(kd_pool="public"))[0]) for o in others)


def test_public_pool_out_of_domain(monkeypatch):
    """kd_pool='ood' (default): kd_pool_size images of the OOD pool at the dataset's image size and channels; the
    selection split, when asked for, still comes from the public split."""
    calls = []
    monkeypatch.setattr(distill, "ood_kd_pixels",
                        lambda n, size, ch: calls.append((n, size, ch)) or 100.0 + torch.arange(n, dtype=torch.float)[:, None])
    sim = _pool_sim()
    pixels, val = public_pool(sim, KDConfig(kd_pool_size=5))
    assert calls == [(5, 8, 1)] and val is None and sorted(pixels.flatten().tolist()) == [100.0, 101, 102, 103, 104]
    pixels, val = public_pool(sim, KDConfig(kd_pool_size=6, kd_val_fraction=0.2))
    assert len(pixels) == 6 and len(val.labels) == 2


def test_public_pool_needs_the_public_split_only_when_asked(monkeypatch):
    """An in-domain pool or a selection split needs a non-empty public split (None or 0 rows: a clear error; 1 row is
    enough); the default out-of-domain pool without selection needs none."""
    monkeypatch.setattr(distill, "ood_kd_pixels", lambda n, size, ch: torch.zeros(n, ch, size, size))
    empty = _pool_sim(n_public=1)
    empty.data.public = empty.data.public.select([])
    for sim in (_pool_sim(n_public=0), empty):
        for cfg in (KDConfig(kd_pool="public"), KDConfig(kd_val_fraction=0.2)):
            with pytest.raises(ValueError, match="needs the dataset's public split"):
                public_pool(sim, cfg)
    pixels, val = public_pool(_pool_sim(n_public=0), KDConfig(kd_pool_size=3))
    assert pixels.shape == (3, 1, 8, 8) and val is None
    assert _ids(public_pool(_pool_sim(n_public=1), KDConfig(kd_pool="public"))[0]) == [0]


def test_ood_pixels_are_the_ood_pool_as_model_inputs():
    """ood_kd_pixels(n, size, channels): the first n images of the OOD 'kd' split, resized, in [-1, 1]."""
    from hfpfl.data.ood import ood_arrays
    from PIL import Image

    x = ood_kd_pixels(3, 8, 1)
    raw, _ = ood_arrays("kd", 3)
    expect = torch.stack([torch.tensor(np.asarray(Image.fromarray(a).convert("L").resize((8, 8), Image.BILINEAR)),
                                       dtype=torch.float32)[None] * (2.0 / 255.0) - 1.0 for a in raw])
    assert x.shape == (3, 1, 8, 8) and torch.allclose(x, expect, atol=1e-6)
    assert ood_kd_pixels(2, 6, 3).shape == (2, 3, 6, 6)


# ------------------------------------------------------------------------------------------------ options
def test_kd_active_rounds_and_switches():
    """KD runs when use_kd, kd_steps > 0 and the round is within kd_rounds (None = every round)."""
    assert KDConfig().kd_active(1000)
    assert not KDConfig(use_kd=False).kd_active(1)
    assert not KDConfig(kd_steps=0).kd_active(1)
    assert KDConfig(kd_steps=1).kd_active(1)
    cfg = KDConfig(kd_rounds=3)
    assert cfg.kd_active(3) and not cfg.kd_active(4)
    assert not KDConfig(kd_rounds=0).kd_active(1)


def test_push_repo_id_is_checked():
    assert _is_repo_id("me/feddf-global") and not _is_repo_id("not a repo id")
    with pytest.raises(ValueError, match="push_adapters_to_hub_cache"):
        KDConfig(push_adapters_to_hub_cache="not a repo id")


# ------------------------------------------------------------------------------------------------ FedDF
def test_feddf_pushes_the_round_model_and_clears_kd_metrics(tmp_path, monkeypatch):
    """FedDF with push_adapters_to_hub_cache: after every round the global keys of the new server state are published
    as that round's revision; with KD off the metrics stay empty. On the toy federation of test_baseline_pins with a
    decaying server lr (0.5 per round; round 1 runs at lr 1) the round-1 state is the 2 : 3 average FEDAVG1."""
    from test_baseline_pins import FEDAVG1, P, close, make_sim, state

    pushed = []
    monkeypatch.setattr(feddf, "push_global_adapter",
                        lambda algo, st, r, repo: pushed.append((algo, {k: v.clone() for k, v in st.items()}, r, repo)))
    sim = make_sim(tmp_path, "feddf", KDConfig(use_kd=False, push_adapters_to_hub_cache="me/feddf-global"),
                   server_lr_decay=0.5)
    sim.step()
    close(sim.server_state["model"], state(P(FEDAVG1)), atol=1e-6)
    (algo, st, r, repo), = pushed
    assert algo is sim.algorithm and r == 1 and repo == "me/feddf-global"
    close(st, state(P(FEDAVG1)), atol=1e-6)
    assert sim.algorithm.last_kd == {}


def test_push_global_adapter_publishes_the_given_state_as_the_round_revision(monkeypatch):
    """push_global_adapter(algo, state, r, repo): the state is loaded into the model, which is published as revisions
    'round-<r>' and 'main' of repo (the snapshot path comes back); other processes publish nothing; a model without
    adapters is a clear error."""
    import hfpfl.models.adapters as adapters
    import hfpfl.models.adapters.io as io

    published = []
    monkeypatch.setattr(io, "publish_adapter", lambda model, repo, revisions: published.append(
        ({k: v.clone() for k, v in model.state_dict().items()}, repo, revisions)) or "/snap")
    monkeypatch.setattr(adapters, "is_adapter_model", lambda model: isinstance(model, Tiny))
    algo = _algo()
    algo.ctx.model, algo.ctx.is_main_process = algo.model, True
    st = _state(TEACHERS[1])
    assert distill.push_global_adapter(algo, st, 3, "me/g") == "/snap"
    (sd, repo, revisions), = published
    assert repo == "me/g" and revisions == ["round-3", "main"] and all(torch.equal(sd[k], v) for k, v in st.items())
    algo.ctx.is_main_process = False
    assert distill.push_global_adapter(algo, st, 4, "me/g") == "" and len(published) == 1
    algo.ctx.model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="needs an adapter model"):
        distill.push_global_adapter(algo, st, 5, "me/g")


def test_feddf_distils_with_its_own_model_and_config(tmp_path, monkeypatch):
    """FedDF hands ensemble_distill itself (its model and simulation) and its own KD options."""
    from test_baseline_pins import make_sim

    seen = []

    def fake_distill(algo, avg, teachers, config, round_idx):
        seen.append((algo, config))
        return {}, {"kd_steps": 0}

    monkeypatch.setattr(feddf, "ensemble_distill", fake_distill)
    cfg = KDConfig(kd_steps=7)
    sim = make_sim(tmp_path, "feddf", cfg)
    sim.step()
    (algo, config), = seen
    assert algo is sim.algorithm and config is sim.algorithm.config and config.kd_steps == 7
    assert sim.algorithm.last_kd == {"kd_steps": 0}
