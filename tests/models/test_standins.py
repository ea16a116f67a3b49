"""Honest stand-ins: the backbones' pretraining pool and the distillation pool share nothing with the clients; a
published LoRA adapter loads with plain peft (a subprocess that never imports hfpfl) and reproduces the accuracy the
run reported for its round; residual/parallel adapters load by the one documented call."""
import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from hfpfl.data import ood

torch.set_num_threads(1)
README = Path(__file__).resolve().parents[2] / "README.md"


def _px(ds) -> torch.Tensor:
    """The ``pixel_values`` of a model-input Dataset as one tensor."""
    return ds.with_format("torch")[:]["pixel_values"]


def _hashes(pixels) -> set[str]:
    """One hash per image of a model-input batch or Dataset (exact pixel equality)."""
    if not isinstance(pixels, torch.Tensor):
        pixels = _px(pixels)
    arr = pixels.detach().cpu().contiguous().numpy()
    return {hashlib.sha1(a.tobytes()).hexdigest() for a in arr}


@pytest.fixture(scope="module")
def digits_28():
    """4 Dirichlet clients on all four Digits domains, 28x28 RGB (the stand-ins' input format)."""
    from hfpfl.data import DataArguments, build_federated_dataset

    args = DataArguments(num_clients=4, partition="dirichlet", alpha=0.5, min_partition_size=5, max_per_domain=60,
                         image_size=28, val_fraction=0.1)
    return args, build_federated_dataset(args, seed=0)


def _client_pixel_hashes(fed) -> set[str]:
    out = set()
    for c in fed.clients + fed.new_clients:
        for split in (c.train, c.test, c.val):
            if split is not None and len(split):
                out |= _hashes(split)
    out |= _hashes(fed.global_test)
    return out


# ------------------------------------------------------------------------------------------ pretraining pool
def test_pretraining_pool_shares_no_class_with_client_datasets(digits_28):
    from hfpfl.data import load_source
    from hfpfl.data.builtin_sources import DIGIT_NAMES

    _, fed = digits_28
    client_classes = set(fed.label_names) | set(DIGIT_NAMES)
    pool = ood.load_ood("pretrain", 2 * ood.NUM_CLASSES)
    names = pool.features["label"].names
    assert len(names) == ood.NUM_CLASSES == len(set(names))
    # no class name, no glyph and no digit-like glyph of a client class
    bare = {n.split(":", 1)[1] for n in names}
    assert not (set(names) | bare) & client_classes
    assert not any(ch.isdigit() or ch in ood._EXCLUDED_GLYPHS for g in ood.GLYPHS for ch in g)
    # no photo the client domains are made of (compared by content: skimage's "cat" *is* chelsea)
    import skimage.data as skd

    client_photos = [np.asarray(getattr(skd, n)()) for n in ("astronaut", "coffee", "chelsea", "rocket",
                                                              "immunohistochemistry")]
    for p in ood.PHOTOS:
        mine = ood._photo(p)
        assert not any(c.shape[:2] == mine.shape[:2] and np.array_equal(c[..., :3], mine) for c in client_photos), p
    # and no image: the rendered pool and the client sources are pixel-disjoint
    from hfpfl.data import to_model_inputs

    pool_px = to_model_inputs(ood.load_ood("pretrain", 930), image_size=28)
    client_px = to_model_inputs(load_source("digits", "train", max_per_domain=100), image_size=28)
    assert not _hashes(pool_px) & _hashes(client_px)


def test_standin_is_trained_on_the_ood_pool_and_says_so(pretrained_backbone):
    from hfpfl import hub
    from hfpfl.models import build_classifier
    from hfpfl.models.pretrained import load_pretrain_info

    info = load_pretrain_info(pretrained_backbone)
    assert info["config"]["dataset"] == "ood" and info["config"]["ood_version"] == ood.OOD_VERSION
    card = (Path(hub.require_cached(pretrained_backbone)) / "README.md").read_text()
    assert "out-of-domain" in card and "shares no class" in card
    m = build_classifier(pretrained_backbone, num_labels=ood.NUM_CLASSES)  # by repo id, like microsoft/resnet-18
    assert set(m.config.id2label.values()) == set(ood.CLASS_NAMES)
    assert not set(m.config.id2label.values()) & {str(i) for i in range(10)}


def test_vit_standin_is_trained_on_the_ood_pool_and_says_so(vit_standin_cache):
    """The LoRA path's backbone: the same out-of-domain pool, said in its card, loaded by repo id."""
    from hfpfl import hub
    from hfpfl.models import build_classifier
    from hfpfl.models.pretrained import load_pretrain_info

    with hub.use_hub_cache(vit_standin_cache):
        info = load_pretrain_info("hfpfl/tiny-vit-ood")
        card = (Path(hub.require_cached("hfpfl/tiny-vit-ood")) / "README.md").read_text()
        m = build_classifier("hfpfl/tiny-vit-ood", num_labels=ood.NUM_CLASSES)
    assert info["config"]["model"] == "tiny-vit" and info["config"]["dataset"] == "ood"
    assert info["config"]["ood_version"] == ood.OOD_VERSION
    assert "out-of-domain" in card and "shares no class" in card
    assert type(m).__name__ == "ViTForImageClassification"
    assert set(m.config.id2label.values()) == set(ood.CLASS_NAMES)


# ------------------------------------------------------------------------------------------ distillation pool
def test_kd_pool_is_out_of_domain_and_disjoint_from_every_client_split(digits_28, pretrained_backbone, tmp_path):
    from hfpfl.algorithms.distill import public_pool
    from hfpfl.algorithms.perada import PerAdaConfig
    from hfpfl.config import RunArguments
    from hfpfl.federated.engine import Simulation

    data_args, fed = digits_28
    cfg = PerAdaConfig(kd_steps=1, kd_pool_size=300)
    assert cfg.kd_pool == "ood"  # the default
    sim = Simulation(RunArguments(method="perada", model=pretrained_backbone, adapter="residual", num_rounds=1,
                                  output_dir=str(tmp_path / "p"), progress=False, checkpoint_every=0),
                     data_args, cfg, fed_data=fed)
    pixels, val = public_pool(sim.ctx, cfg)
    assert val is None and len(pixels) == 300
    kd = _hashes(pixels)
    assert len(kd) == 300
    assert not kd & _client_pixel_hashes(fed)
    assert not kd & _hashes(fed.public)  # not the in-domain public split either
    # and not the backbone's pretraining images (disjoint index ranges of the generator)
    from hfpfl.data import to_model_inputs

    assert not kd & _hashes(to_model_inputs(ood.load_ood("pretrain", 930), image_size=28))
    # the in-domain ablation is selectable by flag, and then *is* the public split
    cfg_pub = PerAdaConfig(kd_steps=1, kd_pool="public")
    assert _hashes(public_pool(sim.ctx, cfg_pub)[0]) == _hashes(fed.public)
    with pytest.raises(ValueError, match="kd_pool"):
        PerAdaConfig(kd_pool="cifar100")


# ------------------------------------------------------------------------------------------ corruption protocol
def test_corrupted_tests_use_client_dependent_severity(digits_28, pretrained_backbone, tmp_path):
    from hfpfl.algorithms.perada import (PerAdaConfig, client_severity, corrupted_personal_accuracy,
                                         corrupted_test_data, parse_corruption)
    from hfpfl.config import RunArguments
    from hfpfl.federated.engine import Simulation

    assert parse_corruption("noise:client") == ("noise", None)
    assert [client_severity(i) for i in range(7)] == [1, 2, 3, 4, 5, 1, 2]
    data_args, fed = digits_28
    sim = Simulation(RunArguments(method="perada", model=pretrained_backbone, adapter="residual", num_rounds=1,
                                  output_dir=str(tmp_path / "p"), progress=False, checkpoint_every=0),
                     data_args, PerAdaConfig(kd_steps=1, kd_pool_size=64, eval_corrupted="noise:client"), fed_data=fed)
    res = sim.run()
    assert 0 <= res["final"]["personal_accuracy_corrupted"] <= 1
    direct = corrupted_personal_accuracy(sim.algorithm, 1, sim.server_state, "noise:client")
    assert direct["personal_accuracy_corrupted"] == pytest.approx(res["final"]["personal_accuracy_corrupted"])
    per = direct["personal_accuracy_corrupted_per_client"]
    assert set(per) == {str(i) for i in range(4)}
    # noise grows with the client's severity: client 3 (severity 4) is noisier than client 0 (severity 1)
    def noise(cid):
        clean = sim.test_data(cid).pixel_values
        bad = corrupted_test_data(sim.ctx, cid, "noise", client_severity(cid)).pixel_values
        return float((bad - clean).std())
    assert noise(3) > 1.5 * noise(0)


# ------------------------------------------------------------------------------------------ adapters load
PLAIN_PEFT_LOADER = textwrap.dedent("""
    import json, sys
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForImageClassification

    backbone, repo, revision, data_file = sys.argv[1:5]
    data = load_file(data_file)
    base = AutoModelForImageClassification.from_pretrained(backbone, num_labels=10, ignore_mismatched_sizes=True)
    model = PeftModel.from_pretrained(base, repo, revision=revision).eval()
    with torch.no_grad():
        pred = torch.cat([model(pixel_values=data["pixel_values"][i:i + 256]).logits.argmax(-1)
                          for i in range(0, len(data["labels"]), 256)])
    acc = int((pred == data["labels"]).sum()) / len(data["labels"])
    assert not any(m == "hfpfl" or m.startswith("hfpfl.") for m in sys.modules), "hfpfl was imported"
    print(json.dumps({"accuracy": acc}))
""")


@pytest.fixture(scope="module")
def vit_standin_cache(tmp_path_factory):
    from hfpfl import hub
    from hfpfl.models.pretrained import ensure_standin

    cache = tmp_path_factory.mktemp("hf-hub-vit")
    with hub.use_hub_cache(cache):
        ensure_standin("hfpfl/tiny-vit-ood", pool_size=930, epochs=1, batch_size=32)
    return cache


@pytest.mark.slow
def test_published_lora_adapter_loads_with_plain_peft_and_reproduces_its_round(digits_28, vit_standin_cache,
                                                                               tmp_path):
    from safetensors.torch import save_file

    from hfpfl import hub
    from hfpfl.algorithms.perada import PerAdaConfig
    from hfpfl.config import RunArguments
    from hfpfl.federated.engine import Simulation

    data_args, fed = digits_28
    backbone, repo = "hfpfl/tiny-vit-ood", "me/perada-vit-lora"
    with hub.use_hub_cache(vit_standin_cache):
        sim = Simulation(RunArguments(method="perada", model=backbone, adapter="lora", num_rounds=2, eval_every=1,
                                      lr=0.1, momentum=0.0, output_dir=str(tmp_path / "run"), progress=False,
                                      checkpoint_every=0),
                         data_args, PerAdaConfig(kd_steps=3, kd_pool_size=64, push_adapters_to_hub_cache=repo),
                         fed_data=fed)
        sim.run()
    reported = {h["round"]: h["global_accuracy"] for h in sim.history if "global_accuracy" in h}
    assert set(reported) >= {1, 2}
    test = sim.global_test_data()
    data_file = tmp_path / "global_test.safetensors"
    save_file({"pixel_values": test.pixel_values.contiguous(), "labels": test.labels.contiguous()}, str(data_file))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_CACHE=str(vit_standin_cache), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    got = {}
    for rnd in (1, 2):
        out = subprocess.run([sys.executable, "-c", PLAIN_PEFT_LOADER, backbone, repo, f"round-{rnd}", str(data_file)],
                             capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        got[rnd] = json.loads(out.stdout.strip().splitlines()[-1])["accuracy"]
    # same number of correct predictions as the run reported (tolerance 1e-6 << 1 / len(test.labels))
    assert got[1] == pytest.approx(reported[1], abs=1e-6) and got[2] == pytest.approx(reported[2], abs=1e-6)
    # the adapter files are peft's own format (no hfpfl config beside them)
    with hub.use_hub_cache(vit_standin_cache):
        files = set(os.listdir(str(hub.require_cached(repo, revision="round-2"))))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files and "hfpfl_adapter_config.json" not in files
    # the load line the README gives is the one run above
    assert 'PeftModel.from_pretrained(base, repo_id, revision="round-3")' in " ".join(README.read_text().split())


@pytest.mark.parametrize("kind", ["residual", "parallel"])
def test_conv_adapters_load_by_the_documented_call(kind, pretrained_backbone, tmp_path):
    """README: ``ConvAdapterModel.from_pretrained(base, repo_id, revision=...)`` -- and plain peft says no clearly."""
    from peft import PeftModel

    from hfpfl import hub
    from hfpfl.models import build_classifier
    from hfpfl.models.adapters import (ConvAdapterModel, ParallelAdapterConfig, ResidualAdapterConfig,
                                       get_adapter_model)

    torch.manual_seed(0)
    cfg = ResidualAdapterConfig(init_std=0.05) if kind == "residual" else ParallelAdapterConfig(init="he")
    model = get_adapter_model(build_classifier(pretrained_backbone, num_labels=10), cfg).eval()
    x = torch.randn(4, 3, 28, 28)
    with torch.no_grad():
        ref = model(pixel_values=x).logits
    model.save_pretrained(tmp_path / "ada")
    hub.push_folder_to_cache(tmp_path / "ada", f"me/{kind}-adapter", revision="round-1")
    base = build_classifier(pretrained_backbone, num_labels=10)
    loaded = ConvAdapterModel.from_pretrained(base, f"me/{kind}-adapter", revision="round-1")
    with torch.no_grad():
        assert torch.equal(loaded(pixel_values=x).logits, ref)
    assert "ConvAdapterModel.from_pretrained" in (tmp_path / "ada" / "README.md").read_text()
    # the one call the README documents beside the LoRA load line
    assert ("hfpfl.models.adapters.ConvAdapterModel.from_pretrained(base, repo_id, revision="
            in " ".join(README.read_text().split()))
    with pytest.raises(ValueError, match="adapter_config.json"):  # not a peft adapter: peft refuses, it does not crash
        PeftModel.from_pretrained(build_classifier(pretrained_backbone, num_labels=10), str(tmp_path / "ada"))
