import os
import runpy
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from huggingface_hub import constants  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from hfpfl import hub  # noqa: E402
from hfpfl.models import build_classifier  # noqa: E402
from hfpfl.models import pretrained as pt  # noqa: E402

QUICK = dict(pool_size=186, max_steps=4, batch_size=8, epochs=1, val_fraction=0.2)  # out-of-domain pool (default)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(d))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return d


def test_pretrain_publish_load_and_idempotent(cache, tmp_path, monkeypatch):
    out = tmp_path / "out"
    repo = pt.ensure_pretrained("hfpfl/tiny-resnet-test", output_dir=str(out), **QUICK)
    assert repo == "hfpfl/tiny-resnet-test"
    assert {"config.json", "model.safetensors", "hfpfl_pretrain.json", "results.json"} <= {p.name for p in out.iterdir()}
    saved = load_file(str(out / "model.safetensors"))

    from hfpfl.data.ood import CLASS_NAMES

    full = build_classifier(repo, num_labels=len(CLASS_NAMES))  # by repo id, offline, like a real checkpoint
    sd = full.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in saved.items())
    assert full.config.id2label[3] == CLASS_NAMES[3]
    m = build_classifier(repo, num_labels=10)  # a client's 10 classes: new head, same backbone
    assert m.config.id2label[3] == "3"
    card = (out / "README.md").read_text()
    assert "out-of-domain" in card and "no digit" in card
    m5 = build_classifier(repo, num_labels=5)  # new head, same backbone
    assert torch.equal(m5.state_dict()["resnet.embedder.embedder.convolution.weight"],
                       saved["resnet.embedder.embedder.convolution.weight"])
    info = pt.load_pretrain_info(repo)
    assert info["metrics"]["steps"] == 4 and 0.0 <= info["metrics"]["val_accuracy"] <= 1.0

    # second call: cached with the same config -> no training
    ref = cache / "models--hfpfl--tiny-resnet-test" / "refs" / "main"
    commit = ref.read_text()

    def boom(*a, **k):
        raise AssertionError("retrained")

    monkeypatch.setattr(pt, "train_backbone", boom)
    assert pt.ensure_pretrained("hfpfl/tiny-resnet-test", **QUICK) == repo  # boom: it did not train again
    assert ref.read_text() == commit
    # a different config does retrain
    with pytest.raises(AssertionError, match="retrained"):
        pt.ensure_pretrained("hfpfl/tiny-resnet-test", **{**QUICK, "max_steps": 5})


def test_same_seed_same_weights(tmp_path):
    c = tmp_path / "c"
    a = pt.ensure_pretrained("hfpfl/a", model="tiny-vit", cache_dir=str(c), output_dir=str(tmp_path / "a"), **QUICK)
    b = pt.ensure_pretrained("hfpfl/b", model="tiny-vit", cache_dir=str(c), output_dir=str(tmp_path / "b"), **QUICK)
    sa, sb = (hub.pull_state_dict(r, cache_dir=c) for r in (a, b))
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    # explicit cache_dir works through build_classifier too
    m = build_classifier("hfpfl/a", 10, cache_dir=str(c))
    assert torch.equal(m.state_dict()["vit.embeddings.cls_token"], sa["vit.embeddings.cls_token"])


def test_cli(cache, tmp_path, monkeypatch, capsys):
    argv = ["pretrain.py", "--model", "tiny-resnet", "--repo_id", "hfpfl/cli", "--cache_dir", str(cache)]
    argv += [f"--{k}={v}" for k, v in QUICK.items()]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(ROOT / "recipes" / "pretrain.py"), run_name="__main__")
    assert "hfpfl/cli@main: pool held-out accuracy" in capsys.readouterr().out
    assert hub.list_revisions("hfpfl/cli", cache_dir=cache) == ["main"]
    monkeypatch.setattr(sys, "argv", ["pretrain.py", "--help"])
    with pytest.raises(SystemExit):
        runpy.run_path(str(ROOT / "recipes" / "pretrain.py"), run_name="__main__")
    assert "--epochs" in capsys.readouterr().out
