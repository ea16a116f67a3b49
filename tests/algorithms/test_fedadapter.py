"""Adapter backbones in the engine (every baseline on a frozen pretrained ResNet + parallel/residual adapters), FedNova,
FedDF and the fedadapter recipe's configs."""
import pytest
import torch

from hfpfl.algorithms import get_algorithm
from hfpfl.algorithms.base import weighted_average
from hfpfl.algorithms.distill import KDConfig
from hfpfl.algorithms.fednova import NORM, normalizer
from hfpfl.models.adapters import travel_keys
from hfpfl.models.pretrained import default_repo_id

pytestmark = pytest.mark.usefixtures("pretrained_backbone")  # temporary Hub cache holding the stand-in
BACKBONE = default_repo_id("tiny-resnet")  # the out-of-domain stand-in (conftest: temporary Hub cache)


def _name_free(key):
    return key.replace(".modules_to_save", "").replace(".default", "")


@pytest.mark.parametrize("adapter", ["parallel", "residual"])
def test_baselines_run_on_frozen_backbone_and_send_only_adapters(run_sim, adapter):
    from hfpfl.models import build_classifier

    pretrained = build_classifier(BACKBONE, num_labels=10).state_dict()
    for method in ("fedavg", "fedprox", "fedavg_ft", "ditto", "fedrep", "local", "fednova"):
        sim, res = run_sim(method, model=BACKBONE, adapter=adapter, num_rounds=1, output_dir=f"{adapter}-{method}")
        tk = travel_keys(sim.model)
        sent = {_name_free(k) for u in sim.last_updates for k in u.upload.get("model", {})}
        assert all(set(u.upload) <= {"model", NORM} for u in sim.last_updates)
        if method == "local":
            assert not sent
        elif method == "fedrep":  # the head is personal there
            assert sent == {k for k in tk if "classifier" not in k}
        else:
            assert sent == tk, method
        # the backbone stayed bit-identical: every frozen key equals the pretrained checkpoint
        for k in sim.keys_by_role["frozen"]:
            plain = k.removeprefix("base_model.").replace(".base_layer", "").replace(".original_module", "")
            if plain in pretrained and not plain.startswith("classifier"):  # the 10-class head is a fresh init
                assert torch.equal(sim.model_state[k].cpu(), pretrained[plain]), (method, k)
        assert 0 <= res["final"]["personal_accuracy"] <= 1


def test_parallel_adapters_send_a_fraction_of_full_model_bytes(run_sim):
    _, full = run_sim("fedavg", model=BACKBONE, num_rounds=1, output_dir="full")
    _, ada = run_sim("fedavg", model=BACKBONE, adapter="parallel", num_rounds=1, output_dir="ada")
    ratio = full["communication"]["bytes_up"] / ada["communication"]["bytes_up"]
    assert ratio > 5, ratio
    assert ada["parameters"]["trainable"] < 0.15 * ada["parameters"]["total"]


def test_adapter_targeting_no_module_is_a_clear_error(run_sim):
    with pytest.raises(ValueError, match="matched no module"):
        run_sim("fedavg", model="tiny-vit", adapter="parallel", run=False)
    from hfpfl.config import RunArguments
    with pytest.raises(ValueError, match="adapter must be one of"):
        RunArguments(adapter="paralel")


def test_fednova_equal_steps_is_fedavg(run_sim):
    kw = dict(model=BACKBONE, adapter="parallel", num_rounds=1, local_steps=3)
    avg, _ = run_sim("fedavg", output_dir="n_avg", **kw)
    nova, _ = run_sim("fednova", output_dir="n_nova", **kw)
    assert {float(u.upload[NORM]["a"]) for u in nova.last_updates} == {normalizer(3, 0.9)}
    for k, v in avg.server_state["model"].items():
        if v.is_floating_point():
            assert torch.allclose(nova.server_state["model"][k], v, atol=1e-6, rtol=0), k
        else:
            assert torch.equal(nova.server_state["model"][k], v), k


def test_fednova_normalizes_unequal_steps(run_sim):
    sim, _ = run_sim("fednova", model=BACKBONE, adapter="parallel", num_rounds=1, momentum=0.0, output_dir="nova_u",
                     run=False)
    x = sim.algorithm.init_server_state()["model"]
    sim.run()
    ups = sim.last_updates
    taus = [float(u.upload[NORM]["a"]) for u in ups]
    assert len(set(taus)) > 1  # clients of different sizes run different step counts
    n = sum(u.num_samples for u in ups)
    p = [u.num_samples / n for u in ups]
    tau_eff = sum(pi * t for pi, t in zip(p, taus))
    key = next(k for k in sim.algorithm._param_keys() if "padapter_conv" in k)
    expect = x[key].double() - tau_eff * sum(pi * (x[key].double() - u.upload["model"][key].double()) / t
                                             for pi, t, u in zip(p, taus, ups))
    assert torch.allclose(sim.server_state["model"][key].double(), expect, atol=1e-6)
    fedavg = weighted_average([u.upload["model"] for u in ups], [u.num_samples for u in ups])
    assert not torch.allclose(sim.server_state["model"][key], fedavg[key], atol=1e-6)
    assert normalizer(4, 0.0) == 4 and normalizer(1, 0.9) == pytest.approx(1.0)


def test_fednova_rejects_adaptive_optimizers(run_sim):
    with pytest.raises(ValueError, match="sgd"):
        run_sim("fednova", optimizer="adam", run=False)


def test_feddf_distils_the_fedavg_model(run_sim):
    kw = dict(model=BACKBONE, adapter="parallel", num_rounds=1)
    avg, _ = run_sim("fedavg", output_dir="df_avg", **kw)
    off, _ = run_sim("feddf", KDConfig(use_kd=False), output_dir="df_off", **kw)
    a, o = avg.server_state["model"], off.server_state["model"]
    assert all(torch.equal(a[k], o[k]) for k in a)
    on, res = run_sim("feddf", KDConfig(kd_steps=5), output_dir="df_on", **kw)
    assert any(not torch.equal(a[k], on.server_state["model"][k]) for k in a)
    assert on.algorithm.last_kd["kd_steps"] == 5 and "global_accuracy" in res["final"]


def test_fedadapter_recipe_defaults_and_configs():
    from pathlib import Path

    from conftest import load_script
    from hfpfl.arguments import parse_run_args

    root = Path(__file__).resolve().parents[2]
    recipe = load_script("recipes/fedadapter.py", "fedadapter_recipe")
    run, _, _ = parse_run_args([], method="fedavg", defaults=recipe.DEFAULTS)
    assert (run.adapter, run.model) == ("parallel", BACKBONE)
    run, _, cfg = parse_run_args(["--method", "fedprox", "--mu", "0.1", "--adapter", "none"], defaults=recipe.DEFAULTS)
    assert (run.method, run.adapter, cfg.mu) == ("fedprox", "none", 0.1)
    run, data, _ = parse_run_args(["--config", str(root / "recipes/configs/fedadapter_cross_silo.yaml")])
    assert (data.num_clients, run.client_fraction, run.local_epochs, data.partition, data.alpha) == (10, 1.0, 1, "dirichlet", 0.5)
    run, data, _ = parse_run_args(["--config", str(root / "recipes/configs/fedadapter_cross_device.yaml"),
                                   "--method", "fednova"])
    assert (run.method, data.num_clients, run.client_fraction, run.local_epochs) == ("fednova", 100, 0.2, 5)
    _, data, _ = parse_run_args(["--config", str(root / "recipes/configs/fedadapter_cross_silo_pathological.yaml")])
    assert (data.partition, data.classes_per_client) == ("label_quantity", 2)
    _, data, _ = parse_run_args(["--config", str(root / "recipes/configs/fedadapter_cross_silo_noise.yaml")])
    assert (data.dataset, data.partition, data.noise_skew, data.noise_skew_rule) == ("digits", "iid", 0.1, "paper")
    assert get_algorithm("fednova") and get_algorithm("feddf") and get_algorithm("perada")
