"""Where FedBiP's frozen LDM comes from and how it is held: ``resolve_ldm`` (a folder as is, the shipped tiny LDM
published on first use, a cached Hub snapshot, a clear offline error naming the fix, else a download) and
``load_ldm`` (one frozen, eval-mode pipeline per folder and device, shared by every client and run of the process).
The Hub and the loading are stubs: no network, no weights."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import re  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import hfpfl.fedbip.ldm as ldm  # noqa: E402
import hfpfl.fedbip.method as fedbip_mod  # noqa: E402
from hfpfl.fedbip.method import load_ldm  # noqa: E402
from hfpfl.fedbip.ldm import resolve_ldm  # noqa: E402


@pytest.fixture
def hub(monkeypatch):
    import huggingface_hub
    import huggingface_hub.constants

    seen = []
    monkeypatch.setattr(ldm, "ensure_pretrained_ldm", lambda repo: seen.append(("ensure", repo)) or "/shipped")
    monkeypatch.setattr(ldm, "cached_snapshot", lambda repo: {"org/cached": "/cache/org-cached"}.get(repo))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo: seen.append(("download", repo)) or "/dl")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    return seen


def test_resolve_ldm_per_kind_of_name(hub, tmp_path, monkeypatch):
    assert resolve_ldm(str(tmp_path)) == str(tmp_path) and hub == []
    assert resolve_ldm("hfpfl/tiny-ldm-digits-broad") == "/shipped" and hub == [("ensure", "hfpfl/tiny-ldm-digits-broad")]
    assert resolve_ldm("org/cached") == "/cache/org-cached"
    assert resolve_ldm("org/online") == "/dl" and hub[-1] == ("download", "org/online")


@pytest.mark.parametrize("env", ["1", "on", "Yes", "TRUE"])
def test_resolve_ldm_offline_names_the_fix(hub, monkeypatch, env):
    """Offline (any of HF_HUB_OFFLINE's true spellings) and not cached: an OSError saying what to do, no download."""
    monkeypatch.setenv("HF_HUB_OFFLINE", env)
    msg = ("LDM 'org/missing' is not a local folder and not in the local Hub cache, and HF_HUB_OFFLINE=1: download it "
           "once online (huggingface-cli download org/missing), pass a local folder, or use the default "
           "'hfpfl/tiny-ldm-digits-broad'")
    with pytest.raises(OSError, match="^" + re.escape(msg) + "$"):
        resolve_ldm("org/missing")
    assert hub == []


def test_resolve_ldm_offline_by_the_hub_constant(hub, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(OSError, match="HF_HUB_OFFLINE=1"):
        resolve_ldm("org/missing")
    assert hub == []


class Part(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))


def test_load_ldm_holds_one_frozen_pipeline_per_folder_and_device(monkeypatch, tmp_path):
    """Loaded once per (real path, device): UNet, VAE and text encoder in eval mode with no gradients, progress bars
    off, moved to the device (CPU when none is given); a symlink to the same folder shares it, another device gets
    its own."""
    from hfpfl.pipelines.pipeline_fedbip import FedBiPPipeline

    loads = []

    def fake_from_pretrained(path):
        p = SimpleNamespace(unet=Part(), vae=Part(), text_encoder=Part(), bars=None, device=None, path=path)
        p.set_progress_bar_config = lambda **kw: setattr(p, "bars", kw)
        p.to = lambda device: setattr(p, "device", device)
        loads.append(p)
        return p

    monkeypatch.setattr(FedBiPPipeline, "from_pretrained", staticmethod(fake_from_pretrained))
    monkeypatch.setattr(fedbip_mod, "_PIPES", {})
    (tmp_path / "ldm").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "ldm")
    p = load_ldm(str(tmp_path / "ldm"))
    assert p.path == str(tmp_path / "ldm") and p.device == torch.device("cpu") and p.bars == {"disable": True}
    for m in (p.unet, p.vae, p.text_encoder):
        assert not m.training and not m.w.requires_grad
    assert load_ldm(str(tmp_path / "link"), "cpu") is p and len(loads) == 1
    q = load_ldm(str(tmp_path / "ldm"), "meta")
    assert q is not p and q.device == torch.device("meta") and len(loads) == 2
    assert set(fedbip_mod._PIPES) == {f"{tmp_path / 'ldm'}@cpu", f"{tmp_path / 'ldm'}@meta"}


def test_resolve_ldm_online_when_hf_hub_offline_is_unset(hub, monkeypatch):
    """No HF_HUB_OFFLINE at all counts as online: an uncached id is downloaded."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert resolve_ldm("org/online") == "/dl" and hub == [("download", "org/online")]
