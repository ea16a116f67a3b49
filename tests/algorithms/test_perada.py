"""PerAda's defining properties on real (small) Digits data with the pretrained tiny HF ResNet + residual adapters."""
import pytest
import torch

from hfpfl.algorithms.base import weighted_average
from hfpfl.algorithms.distill import kd_loss
from hfpfl.algorithms.perada import PerAdaConfig, corrupted_test_data
from hfpfl.federated.comm import tensor_bytes
from hfpfl.federated.state import load_into
from hfpfl.models.adapters import travel_keys
from hfpfl.models.pretrained import default_repo_id

pytestmark = pytest.mark.usefixtures("pretrained_backbone")  # temporary Hub cache holding the stand-in
BACKBONE = default_repo_id("tiny-resnet")  # the out-of-domain stand-in (conftest: temporary Hub cache)


@pytest.fixture
def perada(run_sim):
    def _run(cfg=None, run=True, **kw):
        kw = {"model": BACKBONE, "adapter": "residual", "momentum": 0.0, "num_rounds": 1, **kw}
        return run_sim("perada", cfg or PerAdaConfig(kd_steps=5), run=run, **kw)
    return _run


def _name_free(key: str) -> str:
    return key.replace(".modules_to_save", "").replace(".default", "")


def test_upload_is_exactly_the_adapter_and_personal_never_travels(perada):
    sim, res = perada()
    tk = travel_keys(sim.model, "default")
    assert tk and all("personal" not in k for k in tk)
    for u in sim.last_updates:
        assert {_name_free(k) for k in u.upload["model"]} == tk
        assert not any(".personal." in k for k in u.upload["model"])
    private = sim.store.get(0)["model"]
    assert private and all(".personal." in k for k in private)
    # v_i was trained and differs from what client 0 uploaded (w_i)
    up = sim.last_updates[0].upload["model"]
    k = next(k for k in up if "radapter_conv" in k)
    assert not torch.equal(private[k.replace(".default.", ".personal.")], up[k])
    # bytes up = exactly the adapter state; paper Tab. 1: trained = 2 x communicated
    assert res["communication"]["per_client"]["0"]["bytes_up"] == tensor_bytes(up)
    counts = sim.algorithm.trained_parameter_counts()
    assert counts["trained"] == 2 * counts["communicated"]
    params = dict(sim.model.named_parameters())
    assert counts["communicated"] == sum(v.numel() for k, v in up.items() if k in params)
    # the adapter by hand (PerAda's trained set on a basic-block ResNet): per block conv unit of width h a 1x1
    # adapter conv (h^2) + its BN (2h) + the trainable copy of the unit's BN (2h); the stem BN copy; the head
    cfg = sim.model.config
    units = sum(2 * d * (h * h + 4 * h) for d, h in zip(cfg.depths, cfg.hidden_sizes))
    head = cfg.hidden_sizes[-1] * 10 + 10
    assert counts["communicated"] == units + 2 * cfg.embedding_size + head


def _personal_after_one_update(sim, down, lam):
    algo = sim.algorithm
    algo.config.lam = lam
    torch.manual_seed(0)
    upd = algo.client_update(0, {"model": down}, None, 1)
    return upd.private["model"]


def _perturbed(sim, scale=0.05):
    algo = sim.algorithm
    w = algo.init_server_state()["model"]
    g = torch.Generator().manual_seed(1)
    return {k: v + scale * torch.randn(v.shape, generator=g) if v.is_floating_point() and "running" not in k else v
            for k, v in w.items()}


def test_lambda_zero_personal_adapter_ignores_global(perada):
    sim, _ = perada(run=False)
    w0 = sim.algorithm.init_server_state()["model"]
    w1 = _perturbed(sim)
    a, b = _personal_after_one_update(sim, w0, 0.0), _personal_after_one_update(sim, w1, 0.0)
    assert all(torch.equal(a[k], b[k]) for k in a)
    c, d = _personal_after_one_update(sim, w0, 1.0), _personal_after_one_update(sim, w1, 1.0)
    assert any(not torch.equal(c[k], d[k]) for k in c)


def test_large_lambda_pulls_personal_adapter_onto_received_global(perada):
    sim, _ = perada(run=False)
    down = _perturbed(sim, scale=0.05)
    params = dict(sim.model.named_parameters())

    def dist(v):
        return sum(float(((v[k.replace(".default.", ".personal.")] - down[k]) ** 2).sum())
                   for k in down if k in params) ** 0.5

    v0 = {k: t.clone() for k, t in sim.algorithm.init_private_state(0)["model"].items()}
    d_start = dist(v0)
    d0, d1, dbig = (dist(_personal_after_one_update(sim, down, lam)) for lam in (0.0, 1.0, 19.0))  # lr*19 = 0.95
    assert dbig < 0.3 * d_start and dbig < 0.3 * d0 and d1 < d0


def test_no_kd_is_plain_uniform_or_sample_weighted_average(perada):
    """PerAda w/o KD: the server state is the uniform mean of the uploaded local adapters (default), or the n_i-weighted
    mean with weighting=samples. (The KD step itself is pinned by hand in test_distill.py, the averaging-then-KD
    wiring in test_perada_pins.py.)"""
    off, _ = perada(PerAdaConfig(use_kd=False), output_dir="nokd")
    ups = off.last_updates
    avg = weighted_average([u.upload["model"] for u in ups], [1.0] * len(ups))
    for k, v in avg.items():
        assert torch.equal(off.server_state["model"][k], v), k
    assert off.algorithm.last_kd == {}
    w, _ = perada(PerAdaConfig(use_kd=False, weighting="samples"), output_dir="w")
    ref = weighted_average([u.upload["model"] for u in w.last_updates], [u.num_samples for u in w.last_updates])
    assert all(torch.equal(w.server_state["model"][k], ref[k]) for k in ref)


def test_kd_rounds_cutoff(perada):
    sim, _ = perada(PerAdaConfig(kd_steps=3, kd_rounds=1), num_rounds=2)
    assert sim.algorithm.last_kd == {}  # round 2 > kd_rounds: plain average
    ups = sim.last_updates
    avg = weighted_average([u.upload["model"] for u in ups], [1.0] * len(ups))
    assert all(torch.equal(sim.server_state["model"][k], avg[k]) for k in avg)


def test_kd_loss_is_zero_when_teacher_equals_student():
    """KL(p || p) = 0, and its gradient (softmax(z_s / T) - softmax(z_t / T)) / (T B) vanishes (paper Eq. 11): the
    value by hand is in test_distill.py."""
    x = torch.randn(8, 10, requires_grad=True)
    loss = kd_loss(x, x.detach(), 1.0)
    loss.backward()
    assert abs(float(loss)) < 1e-6 and float(x.grad.abs().max()) < 1e-6


def test_unsampled_client_keeps_its_personal_adapter(perada):
    sim, _ = perada(run=False, clients_per_round=2)
    state = sim.algorithm.init_server_state()
    state, _ = sim.run_round(1, state)
    before = {c: {k: v.clone() for k, v in sim.store.get(c)["model"].items()} for c in sim.store.clients()}
    sampled = sim.sample_clients(2)
    sim.run_round(2, state)
    for c, st in before.items():
        same = all(torch.equal(st[k], sim.store.get(c)["model"][k]) for k in st)
        assert same == (c not in sampled), c


def test_corrupted_test_metric(perada):
    """personal_accuracy_corrupted = the mean over clients of each personal model's accuracy on its corrupted test
    set, recounted here (argmax == label) from the final server state and the stored personal adapters."""
    sim, res = perada(PerAdaConfig(kd_steps=2, eval_corrupted="noise:5"))
    accs = []
    for cid in range(sim.num_clients):
        model = sim.algorithm.load_personal(cid, sim.server_state, sim.store.get(cid), 1).eval()
        bad = corrupted_test_data(sim, cid, "noise", 5)
        with torch.no_grad():
            pred = model(pixel_values=bad.pixel_values.to(sim.device)).logits.argmax(-1).cpu()
        accs.append(int((pred == bad.labels).sum()) / len(bad.labels))
    assert res["final"]["personal_accuracy_corrupted"] == pytest.approx(sum(accs) / len(accs), abs=1e-9)
    clean, bad = sim.test_data(0), corrupted_test_data(sim, 0, "noise", 5)
    assert torch.equal(clean.labels, bad.labels) and not torch.allclose(clean.pixel_values, bad.pixel_values)
    assert "personal_accuracy_corrupted" in sim.history[-1]
    with pytest.raises(ValueError, match="unknown corruption"):
        PerAdaConfig(eval_corrupted="fog:2")


def test_global_adapter_per_round_in_hub_cache(perada, tmp_path):
    from hfpfl import hub
    from hfpfl.models import build_classifier
    from hfpfl.models.adapters import ConvAdapterModel

    sim, _ = perada(PerAdaConfig(kd_steps=2, push_adapters_to_hub_cache="me/perada-global"), run=False, num_rounds=2)
    bases = [build_classifier(BACKBONE, num_labels=10) for _ in range(2)]
    with hub.use_hub_cache(tmp_path / "cache"):
        sim.run()
        assert hub.list_revisions("me/perada-global") == ["main", "round-1", "round-2"]
        # the documented call for residual/parallel adapters (README, beside the load line)
        pm = ConvAdapterModel.from_pretrained(bases[0], "me/perada-global", revision="round-2")
        sd = pm.state_dict()
        for k in sim.algorithm.global_keys:
            assert torch.equal(sd[k], sim.server_state["model"][k]), k
        r1 = ConvAdapterModel.from_pretrained(bases[1], "me/perada-global", revision="round-1").state_dict()
        assert any(not torch.equal(r1[k], sim.server_state["model"][k]) for k in sim.algorithm.global_keys)
        with pytest.raises(hub.RevisionNotCachedError, match="round-9"):
            hub.require_cached("me/perada-global", revision="round-9")
        snap = hub.require_cached("me/perada-global", revision="round-2")
    # a pulled adapter on a base model of another shape: clear error
    from hfpfl.models.adapters import load_adapter
    other = build_classifier("tiny-resnet", num_labels=10, hidden_sizes=[8, 16, 32, 64], embedding_size=8)
    with pytest.raises(ValueError, match="base model"):
        load_adapter(other, snap)


def test_perada_needs_an_adapter_backbone(perada):
    with pytest.raises(ValueError, match="--adapter residual"):
        perada(run=False, adapter="none", model="tiny-resnet")


def test_load_personal_uses_the_personal_slot(perada):
    sim, _ = perada()
    algo = sim.algorithm
    m = algo.load_personal(0, sim.server_state, sim.store.get(0)["model"], 1)
    assert sim.model.active_adapter == "personal"
    x = sim.test_data(0).pixel_values[:4].to(sim.device)
    m.eval()
    with torch.no_grad():
        p = m(pixel_values=x).logits
        g = algo.load_global(sim.server_state)(pixel_values=x).logits
    assert sim.model.active_adapter == "default" and not torch.allclose(p, g)
    load_into(sim.model_state, {})  # no-op, the state dict stays shared with the model
