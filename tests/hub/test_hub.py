import os

import pytest
import torch

torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from huggingface_hub import constants  # noqa: E402
from transformers import AutoModelForImageClassification  # noqa: E402

from hfpfl import hub  # noqa: E402
from hfpfl.models import build_classifier  # noqa: E402


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """Redirect huggingface_hub's cache and force offline mode: the env vars are read into constants at import,
    so patch the constants (transformers/peft read them at call time) as well as the env."""
    d = tmp_path / "hub"
    d.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(d))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(d))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return d


def _save_tiny(tmp_path, name, seed):
    torch.manual_seed(seed)
    m = build_classifier("tiny-resnet", 4)
    out = tmp_path / name
    m.save_pretrained(out)
    return m, out


def test_push_folder_revisions_load_with_plain_from_pretrained(cache, tmp_path):
    m1, f1 = _save_tiny(tmp_path, "r1", 1)
    m2, f2 = _save_tiny(tmp_path, "r2", 2)
    snap = hub.push_folder_to_cache(f1, "org/tiny", revision="round-1")
    hub.push_folder_to_cache(f2, "org/tiny", revision="round-2")
    hub.push_folder_to_cache(f2, "org/tiny")  # main
    assert os.path.isdir(snap) and (cache / "models--org--tiny" / "refs" / "round-1").is_file()
    assert os.path.islink(os.path.join(snap, "model.safetensors"))
    assert hub.list_revisions("org/tiny") == ["main", "round-1", "round-2"]

    for rev, ref in (("round-1", m1), ("round-2", m2), (None, m2)):
        kw = {} if rev is None else {"revision": rev}
        loaded = AutoModelForImageClassification.from_pretrained("org/tiny", **kw)
        for k, v in ref.state_dict().items():
            assert torch.equal(loaded.state_dict()[k], v), (rev, k)
    # same path through the model zoo, new head size
    m = build_classifier("org/tiny", num_labels=7, revision="round-1")
    assert m.classifier[-1].out_features == 7
    assert torch.equal(m.state_dict()["resnet.embedder.embedder.convolution.weight"],
                       m1.state_dict()["resnet.embedder.embedder.convolution.weight"])


def test_state_dict_roundtrip_keeps_other_files(cache, tmp_path):
    _, f1 = _save_tiny(tmp_path, "r1", 1)
    hub.push_folder_to_cache(f1, "org/states", revision="round-3")
    state = {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(2, dtype=torch.int64)}
    hub.push_state_dict(state, "org/states", revision="round-3", filename="clients/c0.safetensors",
                        metadata={"round": 3})
    files = hub.list_repo_files("org/states", "round-3")
    assert {"config.json", "model.safetensors", "clients/c0.safetensors"} <= set(files)
    got = hub.pull_state_dict("org/states", "round-3", filename="clients/c0.safetensors")
    assert set(got) == {"a", "b"} and torch.equal(got["a"], state["a"]) and got["b"].dtype == torch.int64
    # fresh repo, default file name
    hub.push_state_dict(state, "org/only-state")
    assert torch.equal(hub.pull_state_dict("org/only-state")["a"], state["a"])


def test_peft_lora_adapter_from_cache_by_revision(cache, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    torch.manual_seed(0)
    base_dir = tmp_path / "base"
    build_classifier("tiny-vit", 3).save_pretrained(base_dir)
    hub.push_folder_to_cache(base_dir, "org/base")
    cfg = LoraConfig(r=2, target_modules=["q_proj", "v_proj"], modules_to_save=["classifier"])
    adapters = {}
    for rnd in (1, 2):
        base = AutoModelForImageClassification.from_pretrained("org/base")
        pm = get_peft_model(base, cfg)
        torch.manual_seed(rnd)
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_B" in n:
                    p.normal_()
        out = tmp_path / f"ad{rnd}"
        pm.save_pretrained(out)
        adapters[rnd] = {k: v.clone() for k, v in pm.state_dict().items() if "lora_" in k}
        hub.push_folder_to_cache(out, "org/adapter", revision=f"round-{rnd}")

    base = AutoModelForImageClassification.from_pretrained("org/base")
    pm = PeftModel.from_pretrained(base, "org/adapter", revision="round-2")
    sd = pm.state_dict()
    for k, v in adapters[2].items():
        assert torch.equal(sd[k], v), k
    assert not all(torch.equal(sd[k], adapters[1][k]) for k in adapters[1])


@pytest.mark.parametrize(
    "bad", ["../evil", "/abs/path", "org/../x", "org\\name", "a/b/c", "", "org/..", "org/na me", "~/x"]
)
def test_bad_repo_ids_rejected(cache, tmp_path, bad):
    with pytest.raises(ValueError):
        hub.push_state_dict({"a": torch.zeros(1)}, bad)
    with pytest.raises(ValueError):
        hub.repo_cache_path(bad)


@pytest.mark.parametrize("bad", ["../x.safetensors", "/etc/x.safetensors", "a/../../x.safetensors", "a\\b.safetensors"])
def test_bad_filenames_rejected(cache, bad):
    with pytest.raises(ValueError):
        hub.push_state_dict({"a": torch.zeros(1)}, "org/x", filename=bad)
    with pytest.raises(ValueError):
        hub.pull_state_dict("org/x", filename=bad)


def test_bad_revision_rejected(cache):
    for bad in ("../main", "a/b", "", "x y"):
        with pytest.raises(ValueError):
            hub.push_state_dict({"a": torch.zeros(1)}, "org/x", revision=bad)


def test_unknown_revision_lists_known(cache):
    hub.push_state_dict({"a": torch.zeros(1)}, "org/x", revision="round-1")
    hub.push_state_dict({"a": torch.zeros(1)}, "org/x", revision="round-2")
    with pytest.raises(hub.RevisionNotCachedError, match=r"round-9.*\['round-1', 'round-2'\]"):
        hub.pull_state_dict("org/x", revision="round-9")
    with pytest.raises(OSError, match="round-1"):
        build_classifier("org/x", 2, revision="round-9")


def test_pickles_refused(cache, tmp_path):
    torch.save({"a": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    hub.push_folder_to_cache(tmp_path, "org/pickled")  # storing is fine, loading is not
    for name in ("pytorch_model.bin", "model.pt", "state.pkl"):
        with pytest.raises(hub.UnsafeFormatError, match="pickle"):
            hub.pull_state_dict("org/pickled", filename=name)
    with pytest.raises(hub.UnsafeFormatError):
        hub.push_state_dict({"a": torch.zeros(1)}, "org/pickled", filename="x.bin")


def test_uncached_id_fails_fast_offline(cache, network_calls):
    with pytest.raises(hub.OfflineModelError, match=r"microsoft/resnet-18.*hf download microsoft/resnet-18"):
        build_classifier("microsoft/resnet-18", 10)
    with pytest.raises(OSError, match="pretrain.py"):
        hub.require_cached("hfpfl/tiny-resnet-digits")
    assert network_calls == []


def test_corrupt_checkpoint_names_file(cache, tmp_path):
    _, f = _save_tiny(tmp_path, "ok", 0)
    path = f / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(hub.CorruptCheckpointError, match="model.safetensors"):
        build_classifier(str(f), 4)  # local dir
    hub.push_folder_to_cache(f, "org/corrupt")
    with pytest.raises(hub.CorruptCheckpointError, match="model.safetensors"):
        build_classifier("org/corrupt", 4)  # cached repo id
    with pytest.raises(hub.CorruptCheckpointError, match="model.safetensors"):
        hub.pull_state_dict("org/corrupt")


def test_use_hub_cache_context(tmp_path):
    before = (constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE)
    with hub.use_hub_cache(tmp_path / "c") as d:
        assert constants.HF_HUB_CACHE == d and constants.HF_HUB_OFFLINE and hub.is_offline()
        hub.push_state_dict({"a": torch.ones(1)}, "org/ctx")
        assert (tmp_path / "c" / "models--org--ctx").is_dir()
    assert (constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE) == before
