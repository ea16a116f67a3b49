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


def _folder(tmp_path, name, **files):
    folder = tmp_path / name
    folder.mkdir()
    for rel, text in files.items():
        (folder / rel).write_text(text)
    return folder


def test_cached_snapshot_is_the_pushed_revision_or_none_without_the_network(cache, tmp_path, network_calls):
    """The snapshot a push wrote, for its revision; None for a repo or revision not cached, a snapshot without the
    required file, and an invalid id: never an attempt to reach the Hub."""
    snap = hub.push_folder_to_cache(_folder(tmp_path, "a", **{"model_index.json": "{}"}), "org/ldm")
    other = hub.push_folder_to_cache(_folder(tmp_path, "b", **{"config.json": "{}"}), "org/ldm", revision="round-1")
    assert hub.cached_snapshot("org/ldm") == snap != other
    assert hub.cached_snapshot("org/ldm", revision="round-1") == other
    assert hub.cached_snapshot("org/ldm", cache_dir=cache, required_file="model_index.json") == snap
    assert hub.cached_snapshot("org/ldm", revision="round-1", required_file="model_index.json") is None
    assert hub.cached_snapshot("org/ldm", revision="round-2") is None
    assert hub.cached_snapshot("org/other") is None
    assert hub.cached_snapshot("../escape") is None
    assert hub.cached_snapshot("org/ldm", cache_dir=tmp_path / "empty") is None
    assert network_calls == []


def test_ensure_published_publishes_once_then_only_when_stale_forced_or_incomplete(cache, tmp_path):
    """Not cached: ``publish()`` runs and its path is returned. Cached and current: returned as is, publish not
    called. ``stale(path)`` giving a reason: one log line naming it, then publish. ``force``: publish, no line. A
    cached snapshot without ``required_file`` counts as not cached (publish, no line)."""
    calls, lines, reasons = [], [], {}

    def publish():
        calls.append(len(calls))
        return hub.push_folder_to_cache(_folder(tmp_path, f"v{len(calls)}", **{"model_index.json": str(len(calls))}),
                                        "org/ldm")

    def ensure(**kw):
        return hub.ensure_published("org/ldm", publish, stale=lambda path: reasons.get(path), log=lines.append,
                                    required_file="model_index.json", **kw)

    first = ensure()
    assert calls == [0] and first == hub.cached_snapshot("org/ldm") and lines == []
    assert ensure() == first and calls == [0]
    reasons[first] = "is of recipe version 3, not 4"
    second = ensure()
    assert calls == [0, 1] and second != first
    assert lines == ["[hub] cached org/ldm is of recipe version 3, not 4: replacing it"]
    third = ensure(force=True)
    assert calls == [0, 1, 2] and third not in (first, second) and len(lines) == 1
    hub.push_folder_to_cache(_folder(tmp_path, "incomplete", **{"README.md": "no model"}), "org/ldm")
    assert ensure() != third and calls == [0, 1, 2, 3] and len(lines) == 1
    with pytest.raises(ValueError, match="invalid repo id"):
        hub.ensure_published("../escape", publish)
    assert len(calls) == 4


def test_ensure_published_looks_again_once_it_holds_the_lock(cache, tmp_path):
    """Several processes may ask at once: one publishes, and whoever waited on the lock finds a current snapshot and
    returns it without publishing again (here the stale copy turns current while the lock is taken)."""
    snap = hub.push_folder_to_cache(_folder(tmp_path, "a", **{"model_index.json": "{}"}), "org/ldm")
    answers = ["published by an older hfpfl"]  # the first look: stale; the look under the lock: current

    def publish():
        raise AssertionError("published twice")

    lines = []
    assert hub.ensure_published("org/ldm", publish, stale=lambda path: answers.pop(0) if answers else None,
                                log=lines.append) == snap
    assert lines == ["[hub] cached org/ldm published by an older hfpfl: replacing it"]
    assert (cache / ".locks").is_dir()
