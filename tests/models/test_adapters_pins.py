"""Adapter layers pinned by hand on one 2-channel conv unit with set weights: the residual fold (Rebuffi et al.'s
series adapter, as PerAda uses it) W' = (I + A diag(s)) W with s = gamma / sqrt(var + eps) and the next BN's running
mean shifted by A c, c = beta - mean * s; the parallel fold W'[:, :, 1, 1] = W[:, :, 1, 1] + a; unmerge restoring
every tensor exactly; safe_merge; adapter slots (names, delete, grad flags); dtype following the base conv; and the
ConvAdapterModel calls around them (delete_adapter, load_adapter, from_pretrained's options, merge_and_unload,
save_pretrained's selection); and the model's targeting and bookkeeping, by name on the tiny ResNet and on small
config-less nets: which units get adapters or BN copies (defaults, exclude_modules, modules_to_save, the parallel
default's 1x1 filter), the base-model signature and name recorded in each slot, slot names, and every refusal's
message."""
import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from hfpfl.models.adapters import (  # noqa: E402
    ConvAdapterModel,
    ParallelAdapterConfig,
    ResidualAdapterConfig,
    ResidualAdapterLayer,
    adapter_state_dict,
    get_adapter_model,
    is_adapter_model,
)
from hfpfl.models.adapters.layer import ParallelAdapterLayer  # noqa: E402

torch.set_num_threads(1)

W = torch.arange(36, dtype=torch.float32).reshape(2, 2, 3, 3) / 10  # the unit's 3x3 conv, 2 -> 2 channels
A = torch.tensor([[0.5, 1.0], [0.0, 2.0]])                          # the 1x1 adapter [out, in]


class _Unit(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.convolution = nn.Conv2d(2, 2, 3, padding=1, bias=False, dtype=dtype)
        self.normalization = nn.BatchNorm2d(2, dtype=dtype)
        self.activation = nn.ReLU()
        with torch.no_grad():
            self.convolution.weight.copy_(W)
            self.normalization.running_mean.copy_(torch.tensor([0.1, -0.2]))
            self.normalization.running_var.copy_(torch.tensor([1.5, 0.5]))

    def forward(self, x):
        return self.activation(self.normalization(self.convolution(x)))


def _bn(bn, mean, var, weight, bias, eps=None):
    with torch.no_grad():
        bn.running_mean.copy_(torch.tensor(mean)), bn.running_var.copy_(torch.tensor(var))
        bn.weight.copy_(torch.tensor(weight)), bn.bias.copy_(torch.tensor(bias))
    if eps is not None:
        bn.eps = eps


def _residual(adapter_bn=True, train_norms=True):
    layer = ResidualAdapterLayer(_Unit())
    layer.update_layer("default", ResidualAdapterConfig(dropout=0.0, adapter_bn=adapter_bn, train_norms=train_norms),
                       with_adapter=True)
    layer.set_adapter("default")
    with torch.no_grad():
        layer.radapter_conv["default"].weight.copy_(A[:, :, None, None])
    if adapter_bn:
        # var + eps = (1, 4): s = (2 / 1, 1 / 2) = (2, 0.5); c = beta - mean * s = (0.5 - 2, -1 - 1.5) = (-1.5, -2.5)
        _bn(layer.radapter_bn["default"], [1.0, 3.0], [0.75, 3.75], [2.0, 1.0], [0.5, -1.0], eps=0.25)
    if train_norms:
        _bn(layer.radapter_norm["default"], [1.0, 2.0], [4.0, 1.0], [1.0, 1.0], [0.0, 0.0])
    return layer.eval()


def test_residual_merge_by_hand_and_unmerge_restores_every_tensor():
    """M = I + A diag(2, 0.5) = [[2, 0.5], [0, 2]]: W'[0] = 2 W[0] + 0.5 W[1], W'[1] = 2 W[1]. A c = (0.5 * -1.5 +
    1 * -2.5, 2 * -2.5) = (-3.25, -5): the unit's BN copy (running mean (1, 2)) now holds (4.25, 7) and is the unit's
    normalization. Eval outputs agree with the unmerged layer; unmerge gives back W, the original BN object and the
    copy's mean (1, 2), bit for bit."""
    layer = _residual()
    x = torch.randn(3, 2, 5, 5, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = layer(x)
    original_bn, copy_bn = layer.base_layer.normalization, layer.radapter_norm["default"]
    layer.merge("default")
    w = layer.base_layer.convolution.weight.data
    torch.testing.assert_close(w[0], 2 * W[0] + 0.5 * W[1], rtol=0, atol=1e-6)
    torch.testing.assert_close(w[1], 2 * W[1], rtol=0, atol=1e-6)
    assert layer.base_layer.normalization is copy_bn and layer.radapter_norm["default"] is original_bn
    torch.testing.assert_close(copy_bn.running_mean, torch.tensor([4.25, 7.0]), rtol=0, atol=1e-6)
    assert layer.merged and layer.merged_adapters == ["default"]
    with torch.no_grad():
        torch.testing.assert_close(layer(x), before, rtol=0, atol=1e-5)  # merged: the plain unit computes it
    layer.unmerge()
    assert not layer.merged and layer._merge_cache == {}
    assert torch.equal(layer.base_layer.convolution.weight.data, W)
    assert layer.base_layer.normalization is original_bn and layer.radapter_norm["default"] is copy_bn
    assert torch.equal(copy_bn.running_mean, torch.tensor([1.0, 2.0]))
    with torch.no_grad():
        assert torch.equal(layer(x), before)


def test_residual_without_adapter_bn_or_norm_copy_by_hand():
    """adapter_bn False, train_norms False: the forward is h + A h (no inner BN), and the fold has s = 1, c = 0:
    W' = (I + A) W = [[1.5, 1], [0, 3]] W, the pretrained BN's running mean (0.1, -0.2) is unchanged (A c = 0)."""
    layer = _residual(adapter_bn=False, train_norms=False)
    assert "default" not in layer.radapter_bn and "default" not in layer.radapter_norm
    x = torch.zeros(1, 2, 3, 3)
    x[0, 0, 1, 1], x[0, 1, 1, 1] = 1.0, -1.0
    with torch.no_grad():
        h = layer.base_layer.convolution(x)
        mixed = torch.stack([1.5 * h[0, 0] + 1.0 * h[0, 1], 3.0 * h[0, 1]])[None]
        torch.testing.assert_close(layer(x), layer.base_layer.activation(layer.base_layer.normalization(mixed)),
                                   rtol=0, atol=1e-6)
    layer.merge("default")
    w = layer.base_layer.convolution.weight.data
    torch.testing.assert_close(w[0], 1.5 * W[0] + 1.0 * W[1], rtol=0, atol=1e-6)
    torch.testing.assert_close(w[1], 3.0 * W[1], rtol=0, atol=1e-6)
    assert torch.equal(layer.base_layer.normalization.running_mean, torch.tensor([0.1, -0.2]))
    layer.unmerge()
    assert torch.equal(layer.base_layer.convolution.weight.data, W)


def test_norm_only_unit_merges_by_swapping_its_bn_copy_and_unmerges_back():
    """A unit with only a trainable BN copy (with_adapter False, e.g. the stem): merge makes the copy the unit's BN and
    leaves W; unmerge swaps the original back."""
    layer = ResidualAdapterLayer(_Unit())
    layer.update_layer("default", ResidualAdapterConfig(), with_adapter=False)
    layer.set_adapter("default")
    original_bn, copy_bn = layer.base_layer.normalization, layer.radapter_norm["default"]
    layer.merge("default")
    assert layer.base_layer.normalization is copy_bn and torch.equal(layer.base_layer.convolution.weight.data, W)
    layer.unmerge()
    assert layer.base_layer.normalization is original_bn and layer.radapter_norm["default"] is copy_bn
    assert torch.equal(copy_bn.running_mean, torch.tensor([0.1, -0.2]))


def _parallel():
    layer = ParallelAdapterLayer(_Unit())
    layer.update_layer("default", ParallelAdapterConfig(), with_adapter=True)
    layer.set_adapter("default")
    with torch.no_grad():
        layer.padapter_conv["default"].weight.copy_(A[:, :, None, None])
    return layer.eval()


def test_parallel_merge_adds_a_at_the_kernel_centre_and_unmerge_restores():
    """W'[:, :, 1, 1] = W[:, :, 1, 1] + A, every other tap unchanged; the BN copy becomes the unit's BN; unmerge
    gives W back exactly."""
    layer = _parallel()
    delta = layer.delta_weight("default")
    want = torch.zeros(2, 2, 3, 3)
    want[:, :, 1, 1] = A
    assert torch.equal(delta, want)
    x = torch.randn(2, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = layer(x)
    original_bn, copy_bn = layer.base_layer.normalization, layer.padapter_norm["default"]
    layer.merge("default")
    assert torch.equal(layer.base_layer.convolution.weight.data, W + want)
    assert layer.base_layer.normalization is copy_bn
    with torch.no_grad():
        torch.testing.assert_close(layer(x), before, rtol=0, atol=1e-5)
    layer.unmerge()
    assert torch.equal(layer.base_layer.convolution.weight.data, W) and not layer.merged
    assert layer.base_layer.normalization is original_bn
    assert torch.equal(original_bn.running_mean, torch.tensor([0.1, -0.2]))


@pytest.mark.parametrize("make", [_residual, _parallel])
def test_one_merge_at_a_time_safe_merge_and_unmerge_warning(make):
    """A second merge raises; unmerge of an unmerged layer warns; a NaN adapter merges silently by default (peft's
    safe_merge=False) and raises with safe_merge=True, which merges a finite adapter as the default does."""
    layer = make()
    with pytest.warns(UserWarning, match=r"^Already unmerged\. Nothing to do\.$"):
        layer.unmerge()
    layer.merge("default", safe_merge=True)
    safe = layer.base_layer.convolution.weight.data.clone()
    with pytest.raises(ValueError, match=rf"^{type(layer).__name__} can merge exactly one adapter at a time\.$"):
        layer.merge("default")
    layer.unmerge()
    layer.merge("default")
    assert torch.equal(layer.base_layer.convolution.weight.data, safe)
    layer.unmerge()
    with torch.no_grad():
        layer._conv_dict()["default"].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaNs detected in the merged weights; adapter default"):
        layer.merge("default", safe_merge=True)
    assert not layer.merged and torch.equal(layer.base_layer.convolution.weight.data, W)
    layer.merge("default")
    assert torch.isnan(layer.base_layer.convolution.weight.data).any()


@pytest.mark.parametrize("make", [_residual, _parallel])
def test_disabling_a_merged_layer_unmerges_and_runs_the_pretrained_unit(make):
    layer = make()
    x = torch.randn(1, 2, 3, 3, generator=torch.Generator().manual_seed(2))
    layer.merge("default")
    layer.disabled = True
    with torch.no_grad():
        out = layer(x)
    assert not layer.merged and torch.equal(layer.base_layer.convolution.weight.data, W)
    with torch.no_grad():
        assert torch.equal(out, _Unit().eval()(x))


@pytest.mark.parametrize("cls,cfg", [(ResidualAdapterLayer, ResidualAdapterConfig(dropout=0.0)),
                                     (ResidualAdapterLayer, ResidualAdapterConfig(dropout=0.0, adapter_bn=False)),
                                     (ParallelAdapterLayer, ParallelAdapterConfig(init="he"))])
def test_adapter_tensors_take_the_base_convs_dtype(cls, cfg):
    """A float64 base gets float64 adapter convs and BNs (a float32 adapter would fail on a float64 input), and its
    merge computes in float64 (the fold's s / c of a BN-less residual adapter included)."""
    layer = cls(_Unit(dtype=torch.float64))
    layer.update_layer("default", cfg, with_adapter=True)
    layer.set_adapter("default")
    assert {p.dtype for p in layer.parameters()} == {torch.float64}
    assert {b.dtype for n, b in layer.named_buffers() if "running" in n} == {torch.float64}
    x = torch.ones(1, 2, 3, 3, dtype=torch.float64)
    with torch.no_grad():
        out = layer.eval()(x)
    assert out.dtype == torch.float64
    layer.merge("default")
    assert layer.base_layer.convolution.weight.dtype == torch.float64
    with torch.no_grad():
        torch.testing.assert_close(layer(x), out, rtol=0, atol=1e-12)


def test_adapter_slots_names_grads_and_delete():
    """Two residual slots (dropout 0.1: an nn.Dropout(0.1) inside each): adapter_names lists both; set_adapter makes only the active one's tensors trainable;
    deleting the inactive slot keeps the active one, deleting the active slot clears it (and its dropout)."""
    layer = ResidualAdapterLayer(_Unit())
    for n in ("a", "b"):
        layer.update_layer(n, ResidualAdapterConfig(dropout=0.1), with_adapter=True)
    assert layer.adapter_names() == {"a", "b"}
    assert type(layer.radapter_dropout["a"]) is nn.Dropout and layer.radapter_dropout["a"].p == 0.1
    assert type(_residual().radapter_dropout["default"]) is nn.Identity  # dropout 0: no dropout module
    layer.set_adapter("a")
    for c in ("radapter_conv", "radapter_bn", "radapter_norm"):
        assert all(p.requires_grad for p in getattr(layer, c)["a"].parameters())
        assert not any(p.requires_grad for p in getattr(layer, c)["b"].parameters())
    layer.delete_adapter("b")
    assert layer.adapter_names() == {"a"} and layer.active_adapter == "a"
    assert set(layer.radapter_dropout) == {"a"}
    layer.delete_adapter("a")
    assert layer.adapter_names() == set() and layer.active_adapter is None
    assert len(layer.radapter_dropout) == 0
    assert repr(layer).startswith("radapter.ResidualAdapterLayer(")
    assert repr(ParallelAdapterLayer(_Unit())).startswith("padapter.ParallelAdapterLayer(")


# ------------------------------------------------------------------------------------------------ the model
def _tiny_resnet(seed=0):
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(seed)
    cfg = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
                       num_labels=3)
    return ResNetForImageClassification(cfg).eval()


def _perturb(model, name, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for k, t in adapter_state_dict(model, name).items():
            if t.is_floating_point():
                t.add_(torch.randn(t.shape, generator=g) * 0.1)


X = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(3))


def test_model_delete_adapter_moves_to_the_next_slot():
    model = get_adapter_model(_tiny_resnet(), ResidualAdapterConfig())
    model.add_adapter("personal", ResidualAdapterConfig())
    assert model.active_adapter == "default"
    model.delete_adapter("default")
    assert list(model.peft_config) == ["personal"] and model.active_adapter == "personal"
    assert not any(".default." in k or k.endswith(".default") for k in model.state_dict())
    assert any(".personal." in k for k in model.state_dict())
    with pytest.raises(ValueError, match="unknown adapter 'nope'"):
        model.delete_adapter("nope")
    model.delete_adapter("personal")
    assert model.peft_config == {} and model.active_adapter is None


def test_load_adapter_into_a_second_slot_and_from_pretrained_options(tmp_path, monkeypatch):
    """save_pretrained(selected_adapters=["personal"]) puts that slot's weights at the top of the folder;
    load_adapter puts them in a named slot (frozen unless is_trainable); from_pretrained names the slot, is frozen
    and in eval mode by default and trainable in train mode with is_trainable, reads a subfolder, and hands
    revision / cache_dir / subfolder (load_adapter: revision / cache_dir) to the folder resolver."""
    import hfpfl.models.adapters.io as io

    model = get_adapter_model(_tiny_resnet(), ParallelAdapterConfig(init="normal", init_std=0.05))
    model.add_adapter("personal", ParallelAdapterConfig(init="normal", init_std=0.05))
    _perturb(model, "personal", 1)
    model.set_adapter("personal")
    model.eval()
    with torch.no_grad():
        ref_personal = model(pixel_values=X).logits
    model.set_adapter("default")
    model.eval()
    with torch.no_grad():
        ref_default = model(pixel_values=X).logits
    assert not torch.allclose(ref_personal, ref_default)
    model.save_pretrained(tmp_path / "p", selected_adapters=["personal"])
    model.save_pretrained(tmp_path / "both")  # default at the top, personal in its subfolder
    assert sorted(os.listdir(tmp_path / "p")) == ["README.md", "hfpfl_adapter_config.json",
                                                  "hfpfl_adapter_model.safetensors"]

    other = get_adapter_model(_tiny_resnet(), ParallelAdapterConfig())
    other.load_adapter(str(tmp_path / "p"), "mine")
    other.load_adapter(str(tmp_path / "p"), "mine_t", is_trainable=True)
    other.set_adapter("mine")
    with torch.no_grad():
        assert torch.equal(other.eval()(pixel_values=X).logits, ref_personal)
    assert other.peft_config["mine"].inference_mode and not other.peft_config["mine_t"].inference_mode
    assert not any(p.requires_grad for p in other.parameters())
    other.set_adapter("mine_t")
    assert any(p.requires_grad for p in other.parameters())

    loaded = ConvAdapterModel.from_pretrained(_tiny_resnet(), tmp_path / "p")
    assert list(loaded.peft_config) == ["default"] and not loaded.training
    assert not any(p.requires_grad for p in loaded.parameters())
    with torch.no_grad():
        assert torch.equal(loaded(pixel_values=X).logits, ref_personal)
    named = ConvAdapterModel.from_pretrained(_tiny_resnet(), tmp_path / "both", adapter_name="x",
                                             subfolder="personal", is_trainable=True)
    assert list(named.peft_config) == ["x"] and named.training and not named.peft_config["x"].inference_mode
    assert any(p.requires_grad for p in named.parameters())
    with torch.no_grad():
        assert torch.equal(named.eval()(pixel_values=X).logits, ref_personal)

    seen = {}
    real = io.resolve_adapter_folder

    def spy(name_or_path, revision=None, cache_dir=None, subfolder=None):
        seen.update(revision=revision, cache_dir=cache_dir, subfolder=subfolder)
        return real(name_or_path, subfolder=subfolder)

    monkeypatch.setattr(io, "resolve_adapter_folder", spy)
    ConvAdapterModel.from_pretrained(_tiny_resnet(), tmp_path / "both", revision="r1", cache_dir="c1",
                                     subfolder="personal")
    assert seen == {"revision": "r1", "cache_dir": "c1", "subfolder": "personal"}
    other.load_adapter(str(tmp_path / "p"), "third", revision="r2", cache_dir="c2")
    assert seen == {"revision": "r2", "cache_dir": "c2", "subfolder": None}


def test_merge_and_unload_without_norm_copies_nan_guard_and_heads():
    """merge_and_unload folds units whose adapter has a conv but no BN copy (train_norms False) too: the plain model
    gives the adapted model's eval outputs, and every parameter is trainable again. A slot without a head copy
    keeps the original head. safe_merge=True refuses a NaN adapter; the default folds it."""
    model = get_adapter_model(_tiny_resnet(), ResidualAdapterConfig(train_norms=False, init_std=0.1))
    _perturb(model, "default", 2)
    model.eval()
    with torch.no_grad():
        ref = model(pixel_values=X).logits
    plain = model.merge_and_unload()
    assert is_adapter_model(model) and not is_adapter_model(plain)
    assert all(p.requires_grad for p in plain.parameters())
    with torch.no_grad():
        torch.testing.assert_close(plain.eval()(pixel_values=X).logits, ref, rtol=0, atol=1e-5)

    base = _tiny_resnet()
    head = base.classifier[-1].weight.detach().clone()
    model = get_adapter_model(base, ResidualAdapterConfig())
    model.add_adapter("nohead", ResidualAdapterConfig(modules_to_save=[]))
    _perturb(model, "default", 3)
    plain = model.merge_and_unload("nohead")
    assert torch.equal(plain.classifier[-1].weight, head)
    with pytest.raises(ValueError, match="unknown adapter 'nope'"):
        get_adapter_model(_tiny_resnet(), ResidualAdapterConfig()).merge_and_unload("nope")

    for safe in (True, False):
        model = get_adapter_model(_tiny_resnet(), ResidualAdapterConfig())
        with torch.no_grad():
            next(t for k, t in model.named_parameters() if "radapter_conv" in k)[0, 0] = float("nan")
        if safe:
            with pytest.raises(ValueError, match="NaNs detected"):
                model.merge_and_unload(safe_merge=True)
        else:
            plain = model.merge_and_unload()
            assert any(torch.isnan(p).any() for p in plain.parameters())


@pytest.mark.parametrize("conv", [
    dict(kernel_size=(3, 5), padding=(1, 2)),          # not square
    dict(kernel_size=4, padding=2),                      # even: no centre tap
    dict(kernel_size=3, padding=1, dilation=2),          # dilated: the centre tap sees another offset pattern
    dict(kernel_size=3, padding=1, groups=2),            # grouped
    dict(kernel_size=3, padding=1, padding_mode="reflect"),
])
def test_parallel_adapter_refuses_convs_a_same_stride_1x1_cannot_align_with(conv):
    unit = _Unit()
    unit.convolution = nn.Conv2d(2, 2, bias=False, **conv)
    layer = ParallelAdapterLayer(unit)
    with pytest.raises(ValueError, match="ParallelAdapter needs an odd square kxk conv"):
        layer.update_layer("default", ParallelAdapterConfig(), with_adapter=True)


# ------------------------------------------------------------------------------------------------ targeting
RESNET_UNITS = ["resnet.embedder.embedder", "resnet.encoder.stages.0.layers.0.layer.0",
                "resnet.encoder.stages.0.layers.0.layer.1", "resnet.encoder.stages.1.layers.0.shortcut",
                "resnet.encoder.stages.1.layers.0.layer.0", "resnet.encoder.stages.1.layers.0.layer.1"]
TINY_SIGNATURE = {"model_type": "resnet", "num_channels": 3, "embedding_size": 8, "hidden_sizes": [8, 16],
                  "depths": [1, 1], "layer_type": "basic", "num_labels": 3}


def _wrapped(model, cls):
    return sorted(n for n, m in model.base_model.named_modules() if isinstance(m, cls))


def test_conv_units_list_a_wrapped_unit_once_by_its_wrappers_name():
    """conv_units names the 6 conv units of the tiny ResNet (stem, 4 block convs, the shortcut); once wrapped, each
    wrapped unit is listed by its wrapper's name only, never again as `<name>.base_layer`."""
    from hfpfl.models.adapters.model import conv_units

    base = _tiny_resnet()
    assert conv_units(base) == RESNET_UNITS
    model = get_adapter_model(base, ResidualAdapterConfig())
    assert conv_units(model.base_model) == RESNET_UNITS
    assert conv_units(model) == ["base_model." + n for n in RESNET_UNITS]


def test_model_signature_fields_by_hand():
    """The signature is the config's architecture fields that are set (None fields left out), tuples as lists (so it
    equals its own JSON round trip); a model without a config, or whose config has none of the fields, has None."""
    from types import SimpleNamespace

    from hfpfl.models.adapters.model import model_signature

    assert model_signature(_tiny_resnet()) == TINY_SIGNATURE
    toy = nn.Linear(1, 1)
    toy.config = SimpleNamespace(model_type="toy", hidden_sizes=(4, 8), depths=None, other=1)
    sig = model_signature(toy)
    assert sig == {"model_type": "toy", "hidden_sizes": [4, 8]} and type(sig["hidden_sizes"]) is list
    toy.config = SimpleNamespace(other=1)
    assert model_signature(toy) is None
    assert model_signature(nn.Linear(1, 1)) is None


def test_injection_fills_signature_and_base_name_and_refuses_another_base():
    """add_adapter records the base's signature and `_name_or_path` in the slot's config ("" -> None; a name the
    config already has is kept); a config made for another base (num_labels 4) is refused with the one-line fix."""
    base = _tiny_resnet()
    model = get_adapter_model(base, ResidualAdapterConfig())
    assert model.peft_config["default"].base_model_signature == TINY_SIGNATURE
    assert model.peft_config["default"].base_model_name_or_path is None  # the tiny config's _name_or_path is ""
    base = _tiny_resnet()
    base.config._name_or_path = "org/tiny-resnet"
    model = get_adapter_model(base, ResidualAdapterConfig())
    assert model.peft_config["default"].base_model_name_or_path == "org/tiny-resnet"
    model.add_adapter("given", ResidualAdapterConfig(base_model_name_or_path="elsewhere"))
    assert model.peft_config["given"].base_model_name_or_path == "elsewhere"
    model.add_adapter("same", ResidualAdapterConfig(base_model_signature=dict(TINY_SIGNATURE)))
    other = dict(TINY_SIGNATURE, num_labels=4)
    msg = (f"ResidualAdapterConfig was created for a base model with {other}, but this model has {TINY_SIGNATURE}. "
           "Load the adapter onto the base model it was trained on.")
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        get_adapter_model(_tiny_resnet(), ResidualAdapterConfig(base_model_signature=other))


def test_default_targets_exclude_modules_and_the_configs_own_copy():
    """Residual defaults on the basic tiny ResNet: adapters on the 4 block convs, a BN copy only on the stem, the
    shortcut untouched; the parallel default stays the regex (every hit is 3x3, so no per-name list). exclude_modules
    drops one block conv and keeps the ones after it. The slot keeps a deep copy of the config: the caller's lists
    can change afterwards."""
    cfg = ResidualAdapterConfig()
    model = get_adapter_model(_tiny_resnet(), cfg)
    assert _wrapped(model, ResidualAdapterLayer) == sorted(RESNET_UNITS[:3] + RESNET_UNITS[4:])
    assert {n for n, m in model.base_model.named_modules()
            if isinstance(m, ResidualAdapterLayer) and "default" in m.radapter_conv} == set(RESNET_UNITS[1:3] + RESNET_UNITS[4:])
    assert cfg.target_modules is None and cfg.base_model_signature is None
    cfg.modules_to_save.append("pooler")
    assert model.peft_config["default"].modules_to_save == ["classifier"]

    model = get_adapter_model(_tiny_resnet(), ParallelAdapterConfig())
    assert model.peft_config["default"].target_modules == r"((.*\.)?layers\.\d+\.layer\.\d+|(.*\.)?embedder\.embedder)"
    assert _wrapped(model, ParallelAdapterLayer) == sorted(RESNET_UNITS[:3] + RESNET_UNITS[4:])

    model = get_adapter_model(_tiny_resnet(), ResidualAdapterConfig(exclude_modules=["stages.0.layers.0.layer.0"]))
    assert _wrapped(model, ResidualAdapterLayer) == sorted([RESNET_UNITS[0], RESNET_UNITS[2]] + RESNET_UNITS[4:])


def test_adapter_names_defaults_and_positional_forward():
    """ConvAdapterModel(base, config) names its slot "default"; get_adapter_model passes adapter_name on; the model
    takes the base's positional arguments (pixel_values first)."""
    from hfpfl.models.adapters.model import ConvAdapterModel as Model

    assert list(Model(_tiny_resnet(), ResidualAdapterConfig()).peft_config) == ["default"]
    model = get_adapter_model(_tiny_resnet(), ResidualAdapterConfig(), adapter_name="mine")
    assert list(model.peft_config) == ["mine"] and model.active_adapter == "mine"
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(X).logits, model(pixel_values=X).logits)


def test_bad_adapter_calls_are_refused_with_their_message():
    """Each refusal names what was wrong: a taken name, a name with '.' or empty, a config that is not a conv adapter
    config, another kind, an unknown slot, a unit another kind already wraps, a target that matches no unit or
    non-units (at most 10 listed)."""
    model = get_adapter_model(_tiny_resnet(), ResidualAdapterConfig())
    model.add_adapter("personal", ResidualAdapterConfig())
    for call, exc, msg in [
        (lambda: model.add_adapter("default", ResidualAdapterConfig()), ValueError, "adapter 'default' already exists"),
        (lambda: model.add_adapter("a.b", ResidualAdapterConfig()), ValueError,
         "adapter name must be a non-empty string without '.', got 'a.b'"),
        (lambda: model.add_adapter("", ResidualAdapterConfig()), ValueError,
         "adapter name must be a non-empty string without '.', got ''"),
        (lambda: model.add_adapter("x", {}), TypeError,
         "expected a ResidualAdapterConfig or ParallelAdapterConfig, got dict"),
        (lambda: model.add_adapter("x", ParallelAdapterConfig()), ValueError,
         "this model holds residual adapters; cannot add a parallel adapter"),
        (lambda: model.set_adapter("nope"), ValueError, "unknown adapter 'nope'; this model has ['default', 'personal']"),
        (lambda: get_adapter_model(model.base_model, ParallelAdapterConfig()), ValueError,
         "resnet.embedder.embedder is already wrapped by ResidualAdapterLayer"),
        (lambda: get_adapter_model(_tiny_resnet(), ResidualAdapterConfig(target_modules=["nothing"])), ValueError,
         f"ResidualAdapterConfig: target_modules=['nothing'] matched no module of ResNetForImageClassification. "
         f"Available conv units: {RESNET_UNITS}"),
        (lambda: get_adapter_model(_tiny_resnet(), ResidualAdapterConfig(target_modules=".*")), ValueError,
         "ResidualAdapterConfig: target_modules='.*' matches modules that are not conv units (Conv2d .convolution + "
         "BatchNorm2d .normalization): ['resnet', 'resnet.embedder', 'resnet.embedder.embedder.convolution', "
         "'resnet.embedder.embedder.normalization', 'resnet.embedder.embedder.activation', 'resnet.embedder.pooler', "
         "'resnet.encoder', 'resnet.encoder.stages', 'resnet.encoder.stages.0', 'resnet.encoder.stages.0.layers']. "
         f"Available conv units: {RESNET_UNITS}"),
    ]:
        with pytest.raises(exc, match=f"^{re.escape(msg)}$"):
            call()
    assert list(model.peft_config) == ["default", "personal"]


def test_a_wrapped_units_inner_modules_are_never_targets():
    """A later slot whose target names the pretrained conv inside a wrapper (`<unit>.base_layer.convolution`)
    matches nothing: the inner modules of a wrapped unit are invisible to targeting."""
    model = get_adapter_model(_tiny_resnet(), ResidualAdapterConfig())
    spec = r".*\.base_layer\.convolution"
    with pytest.raises(ValueError, match=re.escape(f"target_modules={spec!r} matched no module of ")):
        model.add_adapter("inner", ResidualAdapterConfig(target_modules=spec))


class _Block(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.layer = nn.ModuleList([_Unit() for _ in range(n)])


class _Net(nn.Module):
    """No `config`. Conv units at transformers ResNet's names (`layers.0.layer.0/1`); a `head` registered before them
    that holds a conv unit of its own (at a name the default target matches) and an `fc`; a `tail.fc`."""

    def __init__(self):
        super().__init__()
        self.head = nn.ModuleDict({"layers": nn.ModuleList([_Block(1)]), "fc": nn.Linear(2, 2)})
        self.layers = nn.ModuleList([_Block(2)])
        self.tail = nn.ModuleDict({"fc": nn.Linear(2, 2)})


def test_modules_to_save_are_copied_whole_and_their_copies_never_wrapped_again():
    """modules_to_save=["head", "fc"] on _Net: the two block units get adapters; the head is copied whole (its own
    conv unit stays a plain unit, and the units after it are still found); "fc" matches `tail.fc` by suffix, while the
    `fc` inside the head's copies is left alone, on the first slot and on a second. A model without a config gets no
    signature and no base name; modules_to_save=None copies nothing."""
    from hfpfl.models.adapters.layer import ModulesToSave

    model = get_adapter_model(_Net(), ResidualAdapterConfig(modules_to_save=["head", "fc"]))
    model.add_adapter("personal", ResidualAdapterConfig(modules_to_save=["head", "fc"]))
    assert _wrapped(model, ResidualAdapterLayer) == ["layers.0.layer.0", "layers.0.layer.1"]
    assert _wrapped(model, ModulesToSave) == ["head", "tail.fc"]
    head = model.base_model.head
    assert set(head.modules_to_save) == {"default", "personal"} and set(model.base_model.tail.fc.modules_to_save) == {
        "default", "personal"}
    for copy_ in (head.original_module, head.modules_to_save["default"], head.modules_to_save["personal"]):
        assert type(copy_["fc"]) is nn.Linear and type(copy_["layers"][0].layer[0]) is _Unit
    cfg = model.peft_config["default"]
    assert cfg.base_model_signature is None and cfg.base_model_name_or_path is None

    model = get_adapter_model(_tiny_resnet(), ResidualAdapterConfig(modules_to_save=None))
    assert _wrapped(model, ModulesToSave) == [] and type(model.base_model.classifier) is nn.Sequential


def _units_net(*convs):
    """A config-less net whose conv units sit at `layers.0.layer.K` (the default targets), with the given convs."""
    net = nn.Module()
    net.layers = nn.ModuleList([_Block(len(convs))])
    for unit, conv in zip(net.layers[0].layer, convs):
        unit.convolution = nn.Conv2d(2, 2, bias=False, **conv)
    return net


@pytest.mark.parametrize("odd", [dict(kernel_size=(3, 1), padding=(1, 0)), dict(kernel_size=2, padding=1)])
def test_parallel_default_leaves_out_only_1x1_convs(odd):
    """The parallel default target drops the 1x1 convs it hits (bottleneck ResNets), and only those: a (3, 1) or a 2x2
    conv it hits is refused by the adapter (no centre tap to align a 1x1 with), not silently left unadapted."""
    model = get_adapter_model(_units_net(dict(kernel_size=1), dict(kernel_size=3, padding=1)), ParallelAdapterConfig())
    assert model.peft_config["default"].target_modules == ["layers.0.layer.1"]
    assert _wrapped(model, ParallelAdapterLayer) == ["layers.0.layer.1"]
    with pytest.raises(ValueError, match="^ParallelAdapter needs an odd square kxk conv"):
        get_adapter_model(_units_net(dict(kernel_size=3, padding=1), odd), ParallelAdapterConfig())


# ------------------------------------------------------------------------------------------------ layer edges
def test_a_conv_unit_needs_both_a_conv_and_a_bn_and_a_non_unit_is_refused():
    """is_conv_unit needs .convolution Conv2d AND .normalization BatchNorm2d; a layer refuses anything else by name;
    a unit without .activation (a ResNet shortcut) takes no adapter."""
    from hfpfl.models.adapters.layer import is_conv_unit

    half = nn.Module()
    half.convolution = nn.Conv2d(2, 2, 1)
    assert is_conv_unit(_Unit()) and not is_conv_unit(half)
    half = nn.Module()
    half.normalization = nn.BatchNorm2d(2)
    assert not is_conv_unit(half)
    with pytest.raises(ValueError, match=re.escape("ResidualAdapterLayer needs a module with .convolution (Conv2d) and "
                                                   ".normalization (BatchNorm2d), got Linear")):
        ResidualAdapterLayer(nn.Linear(1, 1))
    msg = ("ResNetShortCut (a shortcut/downsample unit: conv + BN, no activation) cannot take a residual adapter or a "
           "trainable BN copy; remove it from target_modules / norm_modules")
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        get_adapter_model(_tiny_resnet(), ResidualAdapterConfig(target_modules=["stages.1.layers.0.shortcut"]))


class _ArgUnit(_Unit):
    def forward(self, x, shift=0.0, *, scale=1.0):
        return super().forward(x) * scale + shift


@pytest.mark.parametrize("path", ["disabled", "merged", "no adapter active", "slot without this unit"])
def test_the_plain_unit_paths_run_the_pretrained_unit_with_every_argument(path):
    """Whenever the wrapper runs the unit itself (disabled, merged, no active adapter, or an active slot that does not
    touch this unit), it is the pretrained unit called with all the caller's arguments: out = relu(BN(W*x)) * 2 + 1
    for layer(x, 1.0, scale=2.0); the adapter "a" (A at the centre, its BN copy shifted) would change it."""
    layer = ParallelAdapterLayer(_ArgUnit())
    layer.update_layer("a", ParallelAdapterConfig(), with_adapter=True)
    with torch.no_grad():
        layer.padapter_conv["a"].weight.copy_(A[:, :, None, None])
        layer.padapter_norm["a"].running_mean.add_(5.0)
    layer.set_adapter("a")
    layer.eval()
    x = torch.randn(1, 2, 3, 3, generator=torch.Generator().manual_seed(4))
    if path == "disabled":
        layer.disabled = True
    elif path == "merged":
        with torch.no_grad():
            layer.padapter_conv["a"].weight.zero_()  # a zero adapter with the pretrained BN: merged = pretrained
        layer.padapter_norm["a"].load_state_dict(layer.base_layer.normalization.state_dict())
        layer.merge("a")
    elif path == "no adapter active":
        layer.set_adapter(None)
    else:
        layer.set_adapter("b")
    plain = _Unit().eval()
    with torch.no_grad():
        assert torch.equal(layer(x, 1.0, scale=2.0), plain(x) * 2.0 + 1.0)


def test_disabled_model_runs_the_original_head_and_heads_take_keywords():
    """Inside disable_adapter() the classifier is the original head, not the active slot's trained copy: the logits
    are the pretrained network's. A ModulesToSave passes keyword arguments on (original and copy)."""
    from hfpfl.models.adapters.layer import ModulesToSave

    model = get_adapter_model(_tiny_resnet(), ParallelAdapterConfig())
    _perturb(model, "default", 5)
    model.eval()
    with torch.no_grad(), model.disable_adapter():
        assert torch.equal(model(pixel_values=X).logits, _tiny_resnet()(pixel_values=X).logits)

    lin = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[1.0, 2.0]]))
    mts = ModulesToSave(lin)
    v = torch.tensor([[3.0, 4.0]])
    assert mts(input=v).item() == 11.0  # no active copy: the original, 1 * 3 + 2 * 4
    mts.update_layer("a")
    mts.set_adapter("a")
    with torch.no_grad():
        mts.modules_to_save["a"].weight.mul_(2.0)
    assert mts(input=v).item() == 22.0


def test_parallel_init_draws_by_hand():
    """Seeded: after the 1x1 conv's own construction (4 -> 8 channels), "normal" draws init_std * z and "he" draws
    sqrt(2 / fan_out) * z = sqrt(2 / 8) * z = 0.5 * z (Kaiming normal, fan_out, ReLU gain sqrt 2) from the same
    standard normal z; "zeros" is 0."""
    def unit():
        u = _Unit()
        u.convolution = nn.Conv2d(4, 8, 3, padding=1, bias=False)
        u.normalization = nn.BatchNorm2d(8)
        return u

    def draw(**cfg):
        layer = ParallelAdapterLayer(unit())
        torch.manual_seed(0)
        layer.update_layer("a", ParallelAdapterConfig(**cfg), with_adapter=True)
        return layer.padapter_conv["a"].weight.detach()

    torch.manual_seed(0)
    nn.Conv2d(4, 8, 1, bias=False)  # the adapter conv's own initialisation comes first
    z = torch.empty(8, 4, 1, 1).normal_()
    torch.testing.assert_close(draw(init="normal", init_std=0.05), 0.05 * z, rtol=1e-6, atol=0)
    torch.testing.assert_close(draw(init="he"), 0.5 * z, rtol=1e-6, atol=0)
    assert torch.equal(draw(init="zeros"), torch.zeros(8, 4, 1, 1))


@pytest.mark.parametrize("adapter_bn", [True, False])
def test_residual_merge_stays_float16(adapter_bn):
    """A float16 unit's residual fold computes in float16 (I, s and c made in the adapter's dtype, not float32):
    W' = (I + A diag(s)) W with the adapter BN at its init (s = 1 / sqrt(1 + 1e-5), c = 0) or without one (s = 1)."""
    layer = ResidualAdapterLayer(_Unit(dtype=torch.float16))
    layer.update_layer("d", ResidualAdapterConfig(dropout=0.0, adapter_bn=adapter_bn), with_adapter=True)
    layer.set_adapter("d")
    with torch.no_grad():
        layer.radapter_conv["d"].weight.copy_(A[:, :, None, None])
    layer.eval().merge("d")
    s = 1 / (1 + 1e-5) ** 0.5 if adapter_bn else 1.0
    m = torch.tensor([[1 + 0.5 * s, 1.0 * s], [0.0, 1 + 2.0 * s]], dtype=torch.float64)
    want = torch.einsum("oc,cikl->oikl", m, W.double())
    w = layer.base_layer.convolution.weight
    assert w.dtype == torch.float16 and layer.base_layer.normalization.running_mean.dtype == torch.float16
    torch.testing.assert_close(w.double(), want, rtol=2e-3, atol=0)
