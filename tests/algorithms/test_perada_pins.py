"""PerAda's evaluation protocols and server wiring against hand values: the corruption spec, PerAda's client-dependent
severity, the corrupted copy of a client's test set (pixels back to images and back, exactly), the corrupted
personal-accuracy metric (mean and std by hand), the aggregation (uniform / sample-weighted mean by hand, then the
distillation from the uploads), ``load_personal`` and the new-client protocol (personal adapter started at the global
adapter, trained on CE + (lambda/2)||v - w||^2 toward it: the regularizer's value by hand).

Most tests need no model: a stand-in simulation object carries exactly what the function reads. The adapter tests
use one tiny-ResNet + residual-adapter PerAda (random backbone: only where tensors go is checked), built once."""
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

import hfpfl.algorithms.perada as perada
import hfpfl.data as data_mod
from hfpfl.algorithms.base import FROZEN, GLOBAL, MODEL, PRIVATE
from hfpfl.algorithms.perada import (PERSONAL_SLOT, PerAda, PerAdaConfig, _is_corruption, client_severity, corrupted_personal_accuracy,
                                     corrupted_test_data, parse_corruption)
from hfpfl.federated.protocol import Update
from hfpfl.training import TensorData


# ------------------------------------------------------------------------------------------------ corruption spec
def test_parse_corruption_by_hand():
    """'<kind>:<severity>' -> (kind, severity); no severity = 3; 'client' = None (client-dependent); 1..5 inclusive."""
    assert parse_corruption("noise:1") == ("noise", 1)
    assert parse_corruption("rotation:5") == ("rotation", 5)
    assert parse_corruption("color") == ("color", 3)
    assert parse_corruption("noise:client") == ("noise", None)
    for bad in ("noise:0", "noise:6"):
        with pytest.raises(ValueError, match=r"must be in 1\.\.5, got [06]"):
            parse_corruption(bad)
    with pytest.raises(ValueError, match=r"must be an integer 1\.\.5 or 'client', got 'x'"):
        parse_corruption("noise:x")
    # the kind is what precedes the first ':' (the rest is the severity)
    with pytest.raises(ValueError, match=r"must be an integer 1\.\.5 or 'client', got '3:1'"):
        parse_corruption("noise:3:1")
    with pytest.raises(ValueError, match="unknown corruption 'fog'"):
        parse_corruption("fog:2")
    assert _is_corruption("noise:2") and _is_corruption("noise:client")
    assert not _is_corruption("fog:2") and not _is_corruption("noise:9")
    with pytest.raises(ValueError, match="--eval_corrupted: corruption severity must be in 1..5, got 7"):
        PerAdaConfig(eval_corrupted="noise:7")


def test_client_severity_is_one_plus_id_mod_five():
    """PerAda's OOD protocol: client i's test set at severity 1 + (i mod 5), so every severity occurs."""
    assert [client_severity(i) for i in range(12)] == [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]
    assert client_severity(torch.tensor(13)) == 4


# ------------------------------------------------------------------------------------------------ corrupted test data
def _stand_in_sim(pixels, labels, channels, seed=7, client_id=3):
    test = {client_id: TensorData(pixels, labels)}
    caches: dict = {}
    return SimpleNamespace(run=SimpleNamespace(seed=seed), test_data=lambda cid: test[cid],
                           cache=lambda name: caches.setdefault(name, {}),
                           data=SimpleNamespace(num_labels=10, image_size=pixels.shape[-1], num_channels=channels))


@pytest.fixture
def degrade_calls(monkeypatch):
    """``hfpfl.data.degrade`` replaced by the identity, recording (kind, severity, seed): the round trip
    pixels -> images -> pixels is then checked exactly."""
    calls = []

    def identity(ds, kind, severity=3, seed=0, domain_suffix=False):
        calls.append((kind, severity, seed))
        return ds

    monkeypatch.setattr(data_mod, "degrade", identity)
    return calls


def _levels(shape, offset):
    """Model inputs that came from 8-bit pixels k: k * 2/255 - 1 (k = offset, offset + 7, ... mod 256)."""
    k = (torch.arange(math.prod(shape)) * 7 + offset) % 256
    return (k.float() * (2.0 / 255.0) - 1.0).reshape(shape)


@pytest.mark.parametrize("channels", [3, 1])
def test_corrupted_test_data_round_trips_pixels_and_seeds_per_client(degrade_calls, channels):
    """With the corruption replaced by the identity, the corrupted copy is the clean split itself: inputs in [-1, 1]
    back to 8-bit images ((x * 0.5 + 0.5) * 255, rounded, clamped to 0..255) and back to inputs give the same
    floats; inputs outside [-1, 1] come back clamped to -1 / 1 (black / white). Colour images stay colour (each
    channel its own values, 4x4 images so that no other axis has length 3), grey stay grey. The corruption is asked
    for with the given kind and severity and the seed 1000 * run seed + client id (7 * 1000 + 3)."""
    x = _levels((2, channels, 4, 4), offset=1)
    x[0, 0, 0, 0], x[0, 0, 0, 1], x[1, -1, 3, 3] = -1.5, 1.5, -1.0   # out of range, and an exact black pixel
    labels = torch.tensor([4, 9])
    sim = _stand_in_sim(x, labels, channels)
    out = corrupted_test_data(sim, 3, "rotation", 5)
    assert degrade_calls == [("rotation", 5, 7003)]
    expect = x.clone()
    expect[0, 0, 0, 0], expect[0, 0, 0, 1] = -1.0, 1.0
    assert out.pixel_values.shape == (2, channels, 4, 4)
    assert torch.allclose(out.pixel_values, expect, atol=1e-6)
    assert torch.equal(out.labels, labels)


def test_corrupted_test_data_is_cached_per_client_kind_and_severity(degrade_calls):
    """The same (client, kind, severity) is built once per simulation; another severity is another copy."""
    sim = _stand_in_sim(_levels((2, 1, 4, 4), 0), torch.tensor([0, 1]), 1)
    a = corrupted_test_data(sim, 3, "noise", 2)
    assert corrupted_test_data(sim, 3, "noise", 2) is a
    b = corrupted_test_data(sim, 3, "noise", 4)
    assert b is not a and corrupted_test_data(sim, 3, "color", 2) is not a
    assert degrade_calls == [("noise", 2, 7003), ("noise", 4, 7003), ("color", 2, 7003)]


def test_corrupted_test_data_applies_the_real_corruption():
    """With the real ``degrade``: severity-5 Gaussian noise (std 0.38 * 255 per 8-bit pixel) moves a mid-grey image;
    the labels stay; the same call on a fresh simulation gives the same images (seeded)."""
    x = torch.zeros(3, 1, 4, 4)  # 8-bit 127.5 -> 128
    sims = [_stand_in_sim(x, torch.tensor([1, 2, 3]), 1) for _ in range(2)]
    a, b = (corrupted_test_data(s, 3, "noise", 5) for s in sims)
    assert torch.equal(a.pixel_values, b.pixel_values) and torch.equal(a.labels, torch.tensor([1, 2, 3]))
    assert float((a.pixel_values - 2 / 255).abs().mean()) > 0.2  # E|N(0, 0.38)| * 2 = 0.6 on the [-1, 1] scale


# ------------------------------------------------------------------------------------------------ corrupted metric
def test_corrupted_personal_accuracy_by_hand(monkeypatch):
    """The metric evaluates each client the process owns with its personal model as the clean evaluation builds it
    (``ctx.personal_models(owned clients, server_state, round)``) on its corrupted test set (client
    severity 1 + id mod 5 for 'noise:client', the default, or the fixed severity), with the run's eval batch size and
    device, and reports the mean, the population std and each client's accuracy. Accuracies 0.5, 0.25, 1.0: mean
    7/12, std sqrt(((-1/12)^2 + (-4/12)^2 + (5/12)^2) / 3)."""
    acc = {0: 0.5, 1: 0.25, 2: 1.0}
    seen = {"load": [], "data": [], "eval": []}

    def personal_models(client_ids, server_state, round_idx):
        for cid in client_ids:
            seen["load"].append((cid, server_state, round_idx))
            yield cid, f"model{cid}"

    sim = SimpleNamespace(num_clients=3, owned=lambda ids: list(ids)[::-1], personal_models=personal_models,
                          run=SimpleNamespace(eval_batch_size=17), device="dev", gather=lambda rows: rows)
    algo = SimpleNamespace()
    algo.ctx = sim
    monkeypatch.setattr(perada, "corrupted_test_data",
                        lambda s, cid, kind, sev: seen["data"].append((s, cid, kind, sev)) or f"data{cid}")

    def fake_evaluate(model, data, batch_size=None, device=None):
        seen["eval"].append((model, data, batch_size, device))
        return {"accuracy": acc[int(model[-1])]}

    monkeypatch.setattr(perada, "evaluate", fake_evaluate)
    out = corrupted_personal_accuracy(algo, 4, "state")
    assert seen["load"] == [(c, "state", 4) for c in (2, 1, 0)]      # the owned clients, in the order owned gives
    assert sorted(seen["data"], key=lambda r: r[1]) == [(sim, 0, "noise", 1), (sim, 1, "noise", 2), (sim, 2, "noise", 3)]
    assert sorted(seen["eval"]) == [(f"model{c}", f"data{c}", 17, "dev") for c in range(3)]
    std = math.sqrt(((1 / 12) ** 2 + (4 / 12) ** 2 + (5 / 12) ** 2) / 3)
    assert out.pop("personal_accuracy_corrupted_per_client") == {"0": 0.5, "1": 0.25, "2": 1.0}
    assert out == pytest.approx({"personal_accuracy_corrupted": 7 / 12, "personal_accuracy_corrupted_std": std})
    seen["data"].clear()
    corrupted_personal_accuracy(algo, 4, "state", "rotation:4")
    assert sorted(r[1:] for r in seen["data"]) == [(c, "rotation", 4) for c in range(3)]
    sim.owned = lambda ids: []          # a process that owns no client reports nothing
    assert corrupted_personal_accuracy(algo, 4, "state") == {}


def test_extra_metrics_report_the_corrupted_accuracy_only_when_asked(monkeypatch):
    calls = []
    monkeypatch.setattr(perada, "corrupted_personal_accuracy",
                        lambda algo, r, state, spec: calls.append((r, state, spec)) or {"x": 1.0})
    algo = PerAda.__new__(PerAda)
    algo.config = PerAdaConfig()
    assert algo.extra_metrics(2, "s") == {} and calls == []
    algo.config = PerAdaConfig(eval_corrupted="color:2")
    assert algo.extra_metrics(2, "s") == {"x": 1.0} and calls == [(2, "s", "color:2")]


# ------------------------------------------------------------------------------------------------ server
def _updates(keys, values, samples):
    return [Update(i, {MODEL: {k: torch.full((2,), float(v)) for k in keys}}, n) for i, (v, n) in
            enumerate(zip(values, samples))]


@pytest.mark.parametrize("weighting,mean", [("uniform", (1.0 + 3.0) / 2), ("samples", (1 * 1.0 + 3 * 3.0) / 4)])
def test_aggregate_averages_then_distils_from_the_uploads(monkeypatch, weighting, mean):
    """Line 21: the server averages the uploaded local adapters (uniform 1/K, or n_i-weighted), then distils that
    average from the uploads as teachers; the distilled tensors replace the average, every other key of the server
    state stays. Uploads 1.0 (n = 1) and 3.0 (n = 3): uniform 2.0, weighted 2.5. Past kd_rounds: the average alone."""
    calls = []

    def fake_distill(algo, avg, teachers, config, round_idx):
        calls.append(({k: v.clone() for k, v in avg.items()}, teachers, round_idx))
        return {"a": torch.tensor([9.0, 9.0])}, {"kd_steps": 1}

    monkeypatch.setattr(perada, "ensemble_distill", fake_distill)
    algo = PerAda.__new__(PerAda)
    algo.config = PerAdaConfig(weighting=weighting, kd_rounds=1)
    algo._activate = lambda slot: None
    ups = _updates(["a", "b"], [1.0, 3.0], [1, 3])
    state = {MODEL: {"a": torch.zeros(2), "b": torch.zeros(2), "frozen": torch.ones(2)}, "other": 5}
    out = algo.aggregate(state, ups, 1)
    (avg, teachers, r), = calls
    assert r == 1 and teachers == [u.upload[MODEL] for u in ups]
    assert all(torch.equal(avg[k], torch.full((2,), mean)) for k in ("a", "b")) and set(avg) == {"a", "b"}
    assert torch.equal(out[MODEL]["a"], torch.tensor([9.0, 9.0])) and torch.equal(out[MODEL]["b"], torch.full((2,), mean))
    assert torch.equal(out[MODEL]["frozen"], torch.ones(2)) and out["other"] == 5
    assert algo.last_kd == {"kd_steps": 1}
    out = algo.aggregate(state, ups, 2)   # round 2 > kd_rounds
    assert len(calls) == 1 and algo.last_kd == {}
    assert torch.equal(out[MODEL]["a"], torch.full((2,), mean))
    assert algo.aggregate(state, [], 1) is state


# ------------------------------------------------------------------------------------------------ adapters
@pytest.fixture(scope="module")
def adapter_sim(small_digits, tmp_path_factory):
    """One PerAda on the tiny ResNet with residual adapters (16x16 Digits), not run."""
    from hfpfl.config import RunArguments
    from hfpfl.federated.engine import Simulation

    data_args, fed = small_digits
    run = RunArguments(method="perada", model="tiny-resnet", adapter="residual", random_backbone_ok=True,
                       num_rounds=1, batch_size=16, lr=0.05, momentum=0.0, progress=False, new_client_epochs=2,
                       output_dir=str(tmp_path_factory.mktemp("perada-pins")), overwrite_output_dir=True)
    return Simulation(run, data_args, PerAdaConfig(kd_steps=1), fed_data=fed, keep_uploads=True)


def _slot(model, slot):
    return {k: v.detach().clone() for k, v in model.state_dict().items() if f".{slot}." in k}


def _personal(key):
    return key.replace(".default.", ".personal.")


def _known_global(algo, shift):
    """The initial global adapter with every floating tensor (BN statistics too) moved by ``shift``."""
    w0 = algo.init_server_state()[MODEL]
    return {MODEL: {k: v + shift if v.is_floating_point() else v for k, v in w0.items()}}


def test_load_personal_loads_the_stored_personal_adapter_or_w0(adapter_sim):
    """``load_personal``: the global slot holds the server's w, the personal slot the client's stored v_i (here w0 +
    0.25), active; a client with no stored state gets v_i^0 = w^0 (the initial global adapter)."""
    algo = adapter_sim.algorithm
    w0 = algo.init_server_state()[MODEL]
    server = _known_global(algo, 0.5)
    private = {MODEL: {_personal(k): v + 0.25 if v.is_floating_point() else v for k, v in w0.items()}}
    model = algo.load_personal(0, server, private, 1)
    assert adapter_sim.model.active_adapter == "personal"
    sd = model.state_dict()
    for k, v in server[MODEL].items():
        assert torch.equal(sd[k], v), k
        assert torch.equal(sd[_personal(k)], private[MODEL][_personal(k)]), k
    model = algo.load_personal(1, server, None, 1)
    sd = model.state_dict()
    for k, v in w0.items():
        assert torch.equal(sd[_personal(k)], v) and torch.equal(sd[k], server[MODEL][k]), k


@pytest.mark.parametrize("lam,prox_half,coef", [(1.0, True, 1.0), (0.5, False, 1.0), (2.0, False, 4.0), (0.0, True, None)])
def test_new_client_starts_at_the_global_adapter_with_prox_toward_it(adapter_sim, monkeypatch, lam, prox_half, coef):
    """``personalize_new_client``: both slots start at the downloaded global adapter w, the personal slot is active,
    and it trains --new_client_epochs (2) epochs on the new client's data with the regularizer coef/2 ||v - w||^2
    (coef = lambda, or 2 lambda for the code form; none when lambda = 0). By hand: with every trainable personal
    parameter at w + 0.5, the regularizer is coef/2 * 0.25 * (number of those parameters)."""
    algo = adapter_sim.algorithm
    algo.config = PerAdaConfig(kd_steps=1, lam=lam, prox_half=prox_half)
    server = _known_global(algo, 0.5)
    seen = []

    def record(client_id, round_idx, **kw):
        model = algo.model
        seen.append((client_id, round_idx, kw, model.active_adapter, _slot(model, "default"), _slot(model, "personal")))
        if kw.get("regularizer") is not None:
            trainable = {n: p for n, p in model.named_parameters() if ".personal." in n and p.requires_grad}
            with torch.no_grad():
                for n, p in trainable.items():
                    p.copy_(server[MODEL][n.replace(".personal.", ".default.")] + 0.5)
            n_params = sum(p.numel() for p in trainable.values())
            seen.append((float(kw["regularizer"](model).detach()), coef / 2 * 0.25 * n_params))
        return {}

    monkeypatch.setattr(algo, "local_train", record)
    data = adapter_sim.train_data(0)
    algo.personalize_new_client(4, server, data, 3)
    (cid, r, kw, active, default, personal), *reg = seen
    assert (cid, r, active) == (4, 3, "personal")
    assert set(kw) == {"epochs", "tag", "data", "regularizer"}
    assert kw["epochs"] == 2 and kw["data"] is data and kw["tag"] == "new-client"
    for k, v in server[MODEL].items():
        assert torch.equal(default[k], v) and torch.equal(personal[_personal(k)], v), k
    if coef is None:
        assert kw["regularizer"] is None and reg == []
    else:
        (value, by_hand), = reg
        assert value == pytest.approx(by_hand, rel=1e-5)


def test_new_client_with_zero_epochs_is_the_global_adapter(adapter_sim, monkeypatch):
    """--new_client_epochs 0: no training; the personal adapter is the global one."""
    algo = adapter_sim.algorithm
    monkeypatch.setattr(adapter_sim, "args", dataclasses.replace(adapter_sim.args, new_client_epochs=0))
    monkeypatch.setattr(algo, "local_train", lambda *a, **k: pytest.fail("trained with 0 epochs"))
    server = _known_global(algo, -0.5)
    model = algo.personalize_new_client(4, server, adapter_sim.train_data(0), 1)
    sd = model.state_dict()
    assert all(torch.equal(sd[_personal(k)], v) for k, v in server[MODEL].items())


def test_client_update_trains_personal_then_local_and_uploads_only_w(adapter_sim, monkeypatch):
    """Alg. 1 Lines 10 and 15 on a client: first v_i (personal slot active, --personal_epochs, its own 'personal' batch
    stream, CE + lambda/2 ||v - w||^2 toward the received w: value by hand as above), then w_i from w (global slot active,
    the run's schedule, 'local' stream, plain CE); the upload is exactly the global slot, the private state exactly
    the personal slot, both as they were when each training ended."""
    algo = adapter_sim.algorithm
    algo.config = PerAdaConfig(kd_steps=1, lam=1.0, personal_epochs=2)
    down = _known_global(algo, 0.5)
    seen = []

    def record(client_id, round_idx, **kw):
        model = algo.model
        seen.append((client_id, round_idx, {k: v for k, v in kw.items() if k != "regularizer"}, model.active_adapter))
        if kw.get("regularizer") is not None:
            trainable = {n: p for n, p in model.named_parameters() if ".personal." in n and p.requires_grad}
            with torch.no_grad():
                for n, p in trainable.items():
                    p.copy_(down[MODEL][n.replace(".personal.", ".default.")] + 0.5)
            n_params = sum(p.numel() for p in trainable.values())
            seen.append((float(kw["regularizer"](model).detach()), 0.5 * 0.25 * n_params))
        else:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if ".default." in n and p.requires_grad:
                        p.add_(1.0)
        return {"train_loss": 0.25 if kw.get("tag") == "personal" else 0.75}

    monkeypatch.setattr(algo, "local_train", record)
    upd = algo.client_update(1, down, None, 2)
    (c1, r1, kw1, a1), (value, by_hand), (c2, r2, kw2, a2) = seen
    assert (c1, r1, a1, kw1) == (1, 2, "personal", {"epochs": 2, "tag": "personal"})
    assert value == pytest.approx(by_hand, rel=1e-5)
    assert (c2, r2, a2, kw2) == (1, 2, "default", {"tag": "local"})
    params = dict(algo.model.named_parameters())
    v0 = algo.init_private_state(1)[MODEL]               # a first-time client's v_i^0 (Line 10 starts from v_i)
    for k, v in down[MODEL].items():
        trained = k in params and params[k].requires_grad
        assert torch.equal(upd.upload[MODEL][k], v + 1.0 if trained else v), k     # w + the local step only
        assert torch.equal(upd.private[MODEL][_personal(k)], v + 0.5 if trained else v0[_personal(k)]), k
    assert set(upd.upload[MODEL]) == set(down[MODEL]) and set(upd.private[MODEL]) == {_personal(k) for k in down[MODEL]}
    assert upd.num_samples == len(adapter_sim.train_data(1))
    assert upd.metrics == {"train_loss": 0.75, "personal_train_loss": 0.25}


@pytest.mark.parametrize("adapter,role", [("residual", FROZEN), ("parallel", FROZEN), ("lora", PRIVATE)])
def test_key_role_freezes_backbone_statistics_under_residual_and_parallel_adapters(adapter, role):
    """A key the engine would keep per client (a backbone BatchNorm statistic) is frozen under residual and parallel
    adapters (their BNs stay in eval mode), private under LoRA; a personal-slot key is private under every adapter."""
    algo = PerAda.__new__(PerAda)
    algo.ctx = SimpleNamespace(run=SimpleNamespace(adapter=adapter))
    assert algo.key_role("resnet.embedder.norm.running_mean", PRIVATE) == role
    assert algo.key_role(f"conv.adapters.{PERSONAL_SLOT}.weight", GLOBAL) == PRIVATE
    assert algo.key_role("classifier.weight", GLOBAL) == GLOBAL
