import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from peft import get_peft_model
from peft.utils import PeftType
from safetensors.torch import load_file
from transformers import ResNetConfig, ResNetForImageClassification, ViTConfig, ViTForImageClassification

from hfpfl.models.adapters import (
    ConvAdapterModel,
    ParallelAdapterConfig,
    ResidualAdapterConfig,
    ResidualAdapterLayer,
    get_adapter_model,
    adapter_state_dict,
    count_parameters,
    eval_frozen_norms,
    is_adapter_key,
    is_head_key,
    load_adapter,
    load_adapter_state_dict,
    merge_parallel_adapters,
    rebuffi_resnet26_counts,
    resnet18_config,
    resnet26_like_config,
    trainable_keys,
    travel_keys,
    vit_lora_config,
)

torch.set_num_threads(1)


def tiny_resnet(seed=0, hidden_sizes=(8, 16), num_labels=3):
    torch.manual_seed(seed)
    cfg = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=list(hidden_sizes), depths=[1, 2],
                       layer_type="basic", num_labels=num_labels)
    model = ResNetForImageClassification(cfg)
    # non-trivial "pretrained" BN statistics, so that copies/merges are really tested
    g = torch.Generator().manual_seed(seed + 1)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.weight.data.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.bias.data.copy_(torch.randn(m.num_features, generator=g) * 0.1)
    return model


def pixels(n=4, seed=0):
    return torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


def train_steps(model, steps=3, lr=0.1):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for i in range(steps):
        out = model(pixel_values=pixels(8, seed=10 + i)).logits
        loss = torch.nn.functional.cross_entropy(out, torch.arange(8) % out.shape[-1])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


BLOCK_UNITS = [
    "resnet.encoder.stages.0.layers.0.layer.0", "resnet.encoder.stages.0.layers.0.layer.1",
    "resnet.encoder.stages.1.layers.0.layer.0", "resnet.encoder.stages.1.layers.0.layer.1",
    "resnet.encoder.stages.1.layers.1.layer.0", "resnet.encoder.stages.1.layers.1.layer.1",
]
STEM = "resnet.embedder.embedder"
BN_KEYS = ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"]


def test_peft_is_not_patched():
    # building both kinds leaves peft's method registry as peft ships it (no extra PeftType members)
    before = set(PeftType.__members__)
    model = get_adapter_model(tiny_resnet(), ResidualAdapterConfig())
    assert isinstance(model, ConvAdapterModel) and model.kind == "residual"
    assert get_adapter_model(tiny_resnet(), ParallelAdapterConfig()).kind == "parallel"
    assert set(PeftType.__members__) == before
    assert not {"RADAPTER", "PADAPTER"} & set(PeftType.__members__)


def test_residual_frozen_and_trainable_set():
    model = get_adapter_model(tiny_resnet(), ResidualAdapterConfig())
    inner = "base_model."
    expected = set()
    for u in BLOCK_UNITS:
        expected.add(f"{inner}{u}.radapter_conv.default.weight")
        for k in ("weight", "bias"):
            expected.add(f"{inner}{u}.radapter_bn.default.{k}")
            expected.add(f"{inner}{u}.radapter_norm.default.{k}")
    expected |= {f"{inner}{STEM}.radapter_norm.default.weight", f"{inner}{STEM}.radapter_norm.default.bias"}
    expected |= {f"{inner}classifier.modules_to_save.default.1.weight",
                 f"{inner}classifier.modules_to_save.default.1.bias"}
    assert trainable_keys(model) == expected
    # every frozen parameter is a pretrained one: convs, pretrained BNs, shortcut (downsample) conv + BN
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert all(not is_adapter_key(n) and "modules_to_save" not in n for n in frozen)
    assert any("shortcut.convolution" in n for n in frozen) and any("shortcut.normalization" in n for n in frozen)
    # the shortcut is not wrapped
    assert not isinstance(model.base_model.resnet.encoder.stages[1].layers[0].shortcut, ResidualAdapterLayer)
    # after training, the frozen weights are bit-identical and the trainable ones moved
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train_steps(model)
    for n, p in model.named_parameters():
        if n in expected:
            if "radapter_bn" not in n:  # adapter BN grads are ~1e-4-scaled at init
                assert not torch.equal(before[n], p), n
        else:
            assert torch.equal(before[n], p), n


def test_residual_adapter_is_identity_at_init():
    base = tiny_resnet()
    base.eval()
    x = pixels()
    with torch.no_grad():
        ref = base(pixel_values=x).logits
    model = get_adapter_model(tiny_resnet(), ResidualAdapterConfig())
    model.eval()
    with torch.no_grad():
        out = model(pixel_values=x).logits
        with model.disable_adapter():
            off = model(pixel_values=x).logits
    assert torch.equal(off, ref)
    assert (out - ref).norm() / ref.norm() < 1e-2
    assert not torch.equal(out, ref)  # the adapter is really in the path
    # per unit, train mode (dropout on): ||A(h) - h|| / ||h|| < 1e-2
    layer = model.base_model.resnet.encoder.stages[0].layers[0].layer[0]
    layer.train()
    h = torch.randn(4, 8, 5, 5)
    delta = layer._adapter_delta("default", h, None)
    assert 0 < ((delta - h).norm() / h.norm()).item() < 1e-2


def test_perada_parameter_counts_resnet18():
    counts = count_parameters(resnet18_config(num_labels=10), ResidualAdapterConfig())
    assert counts["base"] == 11_181_642
    assert counts["trainable"] == 1_413_258
    assert counts["communicated"] == 1_413_258
    assert counts["total"] == 12_581_962
    assert round(counts["trainable_fraction"] * 100, 1) == 12.6
    assert count_parameters(resnet18_config(num_labels=65), ResidualAdapterConfig())["trainable"] == 1_441_473
    # a plain model is not modified by counting
    base = tiny_resnet()
    n = sum(p.numel() for p in base.parameters())
    assert count_parameters(base, ResidualAdapterConfig())["base"] == n
    assert not any(is_adapter_key(k) for k in base.state_dict())


def test_parallel_resnet26_payload_ratio():
    """Rebuffi et al.'s ResNet-26 (stem 3x3 3->32; stages 64/128/256 x 4 basic blocks; parameter-free shortcuts; final
    BN + linear) with a parallel 1x1 adapter beside each of its 25 3x3 convs, counted by hand:
    3x3 convs: stem 9*3*32 = 864; stage 64: 9*32*64 + 7 * 9*64*64 = 276,480; stage 128: 9*64*128 + 7 * 9*128*128 =
    1,105,920; stage 256: 9*128*256 + 7 * 9*256*256 = 4,423,680; sum 5,806,944. Adapters: the same with 1x1 = /9 =
    645,216. BN channels 32 + 8*64 + 8*128 + 8*256 + 256 (final) = 3,872: affine 7,744, statistics 7,744. Linear 256*10
    + 10 = 2,570. Trainable with adapters 645,216 + 7,744 + 2,570 = 655,530; full model 5,806,944 + 7,744 + 2,570 =
    5,817,258; payloads with statistics 663,274 and 5,825,002 floats."""
    ref = rebuffi_resnet26_counts(num_labels=10)
    assert ref["n_adapted_convs"] == 25
    assert (ref["base_convs"], ref["adapters"], ref["bn_affine"], ref["fc"]) == (5_806_944, 645_216, 7_744, 2_570)
    assert (ref["trainable"], ref["base"]) == (655_530, 5_817_258)
    assert (ref["payload_floats"], ref["full_state_floats"]) == (663_274, 5_825_002)
    assert ref["trainable_ratio"] == 5_817_258 / 655_530 and ref["payload_ratio"] == 5_825_002 / 663_274
    assert ref["full_mib"] == 5_825_002 * 4 / 2**20 and ref["with_adapters_mib"] == (5_825_002 + 645_216) * 4 / 2**20
    # width 0.25: channels 8/16/32/64: convs 9*(3*8 + 8*16 + 7*16*16 + 16*32 + 7*32*32 + 32*64 + 7*64*64) = 363,096;
    # BN channels 8 + 128 + 256 + 512 + 64 = 968 (affine 1,936); linear 64*10 + 10 = 650
    q = rebuffi_resnet26_counts(10, width=0.25)
    assert q["base_convs"] == 363_096 and q["adapters"] == 40_344
    assert q["trainable_ratio"] == (363_096 + 1_936 + 650) / (40_344 + 1_936 + 650)
    # the same accounting on transformers' closest ResNet-26 (7x7 stride-2 stem, 1x1 conv + BN shortcuts at the start
    # of each stage, no final BN), measured by the real tuner, against the same arithmetic: 5,864,490 parameters,
    # 655,018 trainable (the stem's adapter is 3*32 as in Rebuffi's; shortcuts get none and keep their frozen BN)
    convs3 = 9 * (32 * 64 + 7 * 64 * 64 + 64 * 128 + 7 * 128 * 128 + 128 * 256 + 7 * 256 * 256)   # 24 block convs
    shortcuts = 32 * 64 + 64 * 128 + 128 * 256
    bn_ch = 32 + 8 * 64 + 8 * 128 + 8 * 256 + (64 + 128 + 256)   # stem, 24 block convs, 3 shortcuts = 4,064
    base = 49 * 3 * 32 + convs3 + shortcuts + 2 * bn_ch + 2_570
    adapters = 3 * 32 + convs3 // 9                                  # the stem (7x7) and the 24 block convs
    adapted_bn = 32 + 8 * 64 + 8 * 128 + 8 * 256                     # their BN copies (shortcuts stay frozen)
    trainable = adapters + 2 * adapted_bn + 2_570
    assert (base, trainable) == (5_864_490, 655_018)
    hf = count_parameters(resnet26_like_config(num_labels=10), ParallelAdapterConfig())
    assert (hf["base"], hf["trainable"], hf["communicated"]) == (base, trainable, trainable)
    assert hf["trainable_ratio"] == base / trainable
    assert hf["payload_ratio"] == (base + 2 * bn_ch) / (trainable + 2 * adapted_bn)


class _Unit(torch.nn.Module):
    """One conv unit as transformers' ResNet has it (.convolution, .normalization, .activation), 1 channel."""

    def __init__(self):
        super().__init__()
        self.convolution = torch.nn.Conv2d(1, 1, 3, padding=1, bias=False)
        self.normalization = torch.nn.BatchNorm2d(1)
        self.activation = torch.nn.ReLU()
        with torch.no_grad():
            self.convolution.weight.zero_()
            self.convolution.weight[0, 0, 1, 1] = 3.0    # on a 1x1 input only the centre tap sees x: conv(x) = 3x

    def forward(self, x):
        return self.activation(self.normalization(self.convolution(x)))


def _set_bn(bn, mean, var, weight, bias):
    with torch.no_grad():
        bn.running_mean.fill_(mean), bn.running_var.fill_(var), bn.weight.fill_(weight), bn.bias.fill_(bias)


def _eps(v):
    return (v + 1e-5) ** 0.5


@pytest.mark.parametrize("kind", ["residual", "parallel"])
def test_adapter_layer_forward_by_hand(kind):
    """x = 2 on a 1x1 map, conv(x) = 3x = 6, the unit's trainable BN copy (mean 1, var 4, gamma 2, beta 0.5) replacing
    the pretrained BN (mean 0, var 1, gamma 1, beta 0), ReLU, eval mode.
    Residual (PerAda): h = 6 + A * BN_a(6) with A = 0.5, BN_a (mean 2, var 1): h = 6 + 0.5 * 4 = 8 -> (8 - 1)/2 * 2 +
    0.5 = 7.5. Parallel (Rebuffi): h = 6 + a * x with a = 0.5: 7 -> (7 - 1)/2 * 2 + 0.5 = 6.5."""
    from hfpfl.models.adapters import ParallelAdapterLayer

    layer = (ResidualAdapterLayer if kind == "residual" else ParallelAdapterLayer)(_Unit())
    cfg = ResidualAdapterConfig(dropout=0.0) if kind == "residual" else ParallelAdapterConfig()
    layer.update_layer("default", cfg, with_adapter=True)
    layer.set_adapter("default")
    _set_bn(layer.base_layer.normalization, 0.0, 1.0, 1.0, 0.0)
    _set_bn(layer._norm_dict()["default"], 1.0, 4.0, 2.0, 0.5)
    with torch.no_grad():
        layer._conv_dict()["default"].weight.fill_(0.5)
    if kind == "residual":
        _set_bn(layer.radapter_bn["default"], 2.0, 1.0, 1.0, 0.0)
        h = 6 + 0.5 * (6 - 2) / _eps(1.0)
    else:
        h = 6 + 0.5 * 2
    expected = (h - 1) / _eps(4.0) * 2 + 0.5                  # 7.5 / 6.5
    assert expected == pytest.approx(7.5 if kind == "residual" else 6.5, abs=1e-4)
    layer.eval()
    with torch.no_grad():
        out = layer(torch.full((1, 1, 1, 1), 2.0))
    torch.testing.assert_close(out, torch.full((1, 1, 1, 1), expected), rtol=0, atol=1e-6)
    with torch.no_grad():
        layer.disabled = True                                 # adapter off: the pretrained unit, (6 - 0)/1 * 1 + 0
        torch.testing.assert_close(layer(torch.full((1, 1, 1, 1), 2.0)),
                                   torch.full((1, 1, 1, 1), 6 / _eps(1.0)), rtol=0, atol=1e-6)


def test_merge_parallel_equals_unmerged():
    model = get_adapter_model(tiny_resnet(), ParallelAdapterConfig(init="he"))
    train_steps(model, steps=2, lr=0.05)
    x = pixels(seed=3)
    with torch.no_grad():
        unmerged = model(pixel_values=x).logits
    n_base = sum(p.numel() for p in tiny_resnet().parameters())
    merged = merge_parallel_adapters(model)
    assert type(merged) is ResNetForImageClassification
    assert not any(is_adapter_key(k) or "modules_to_save" in k for k in merged.state_dict())
    assert sum(p.numel() for p in merged.parameters()) == n_base
    merged.eval()
    with torch.no_grad():
        out = merged(pixel_values=x).logits
    assert torch.allclose(out, unmerged, atol=1e-5)
    assert (out - tiny_resnet().eval()(pixel_values=x).logits).abs().max() > 1e-3  # merge changed the model


def test_merge_residual_equals_unmerged_in_eval():
    model = get_adapter_model(tiny_resnet(), ResidualAdapterConfig(init_std=0.1))
    train_steps(model, steps=2, lr=0.05)
    x = pixels(seed=4)
    with torch.no_grad():
        unmerged = model(pixel_values=x).logits
    merged = model.merge_and_unload().eval()
    with torch.no_grad():
        assert torch.allclose(merged(pixel_values=x).logits, unmerged, atol=1e-5)


@pytest.mark.parametrize("kind", ["residual", "parallel"])
def test_save_load_round_trip(tmp_path, kind):
    cfg = ResidualAdapterConfig() if kind == "residual" else ParallelAdapterConfig(init="normal", init_std=0.05)
    model = get_adapter_model(tiny_resnet(), cfg)
    train_steps(model)
    x = pixels(seed=5)
    with torch.no_grad():
        ref = model(pixel_values=x).logits
    model.save_pretrained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["README.md", "hfpfl_adapter_config.json", "hfpfl_adapter_model.safetensors"]
    saved = load_file(tmp_path / "hfpfl_adapter_model.safetensors")
    assert set(saved) == travel_keys(model)
    assert all(is_adapter_key(k) or is_head_key(k) for k in saved)
    assert not any(k.endswith("convolution.weight") for k in saved)
    for loader in (lambda b: ConvAdapterModel.from_pretrained(b, tmp_path), lambda b: load_adapter(b, str(tmp_path))):
        loaded = loader(tiny_resnet()).eval()
        with torch.no_grad():
            assert torch.equal(loaded(pixel_values=x).logits, ref)


def test_travel_keys_exact_and_slots_interchangeable():
    model = get_adapter_model(tiny_resnet(), ResidualAdapterConfig())
    p = "base_model."
    expected = {f"{p}{u}.radapter_conv.weight" for u in BLOCK_UNITS}
    expected |= {f"{p}{u}.{m}.{k}" for u in BLOCK_UNITS for m in ("radapter_bn", "radapter_norm") for k in BN_KEYS}
    expected |= {f"{p}{STEM}.radapter_norm.{k}" for k in BN_KEYS}
    expected |= {f"{p}classifier.1.weight", f"{p}classifier.1.bias"}
    assert travel_keys(model) == expected
    no_buf = travel_keys(model, include_buffers=False)
    assert no_buf == {k for k in expected if k.rsplit(".", 1)[1] in ("weight", "bias")}
    assert sum(v.numel() for v in adapter_state_dict(model, include_buffers=False).values()) == sum(
        p.numel() for p in model.parameters() if p.requires_grad)
    # PerAda: a global and a personal adapter on one model; a dict from one slot loads into the other
    model.add_adapter("personal", ResidualAdapterConfig())
    train_steps(model)  # trains "default"
    x = pixels(seed=6)
    with torch.no_grad():
        ref = model(pixel_values=x).logits
    model.set_adapter("personal")
    assert all(".personal." in n for n in trainable_keys(model) if is_adapter_key(n) or "modules_to_save" in n)
    with torch.no_grad():
        assert not torch.allclose(model(pixel_values=x).logits, ref)
    load_adapter_state_dict(model, adapter_state_dict(model, "default"), adapter_name="personal")
    with torch.no_grad():
        assert torch.equal(model(pixel_values=x).logits, ref)


def test_eval_frozen_norms():
    model = get_adapter_model(tiny_resnet(), ResidualAdapterConfig(frozen_norms_eval=False))
    model.train()
    sc = model.base_model.resnet.encoder.stages[1].layers[0].shortcut.normalization
    assert sc.training  # PerAda-code behaviour on request
    eval_frozen_norms(model)
    assert not sc.training
    model = get_adapter_model(tiny_resnet(), ResidualAdapterConfig())
    model.train()  # default: frozen BNs stay in eval automatically
    sc = model.base_model.resnet.encoder.stages[1].layers[0].shortcut.normalization
    unit = model.base_model.resnet.encoder.stages[1].layers[0].layer[0]
    assert not sc.training and unit.radapter_norm["default"].training and unit.radapter_bn["default"].training


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match=r"nonexistent.*Available conv units.*resnet\.embedder\.embedder"):
        get_adapter_model(tiny_resnet(), ResidualAdapterConfig(target_modules=["nonexistent"]))
    with pytest.raises(ValueError, match="not conv units"):
        get_adapter_model(tiny_resnet(), ResidualAdapterConfig(target_modules=["pooler"]))
    with pytest.raises(ValueError, match="shortcut/downsample unit"):  # refused before its 1x1 kernel is looked at
        get_adapter_model(tiny_resnet(), ParallelAdapterConfig(target_modules=["resnet.encoder.stages.1.layers.0.shortcut"]))
    bottleneck = ResNetForImageClassification(ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[16],
                                                           depths=[1], layer_type="bottleneck", num_labels=3))
    with pytest.raises(ValueError, match="odd square"):  # a bottleneck's 1x1 reduction has no kernel centre to pair
        get_adapter_model(bottleneck, ParallelAdapterConfig(target_modules=["resnet.encoder.stages.0.layers.0.layer.0"]))
    with pytest.raises(ValueError, match="dropout"):
        ResidualAdapterConfig(dropout=1.5)
    with pytest.raises(ValueError, match="init_std"):
        ResidualAdapterConfig(init_std=-1.0)
    with pytest.raises(ValueError, match="target_modules is empty"):
        ParallelAdapterConfig(target_modules=[])
    with pytest.raises(ValueError, match="init"):
        ParallelAdapterConfig(init="xavier")
    for bad in (0, -4):
        with pytest.raises(ValueError, match="rank"):
            vit_lora_config(r=bad)
    # adapter saved for one base model, loaded onto another
    model = get_adapter_model(tiny_resnet(), ResidualAdapterConfig())
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="base model"):
        ConvAdapterModel.from_pretrained(tiny_resnet(hidden_sizes=(8, 24)), tmp_path)
    with pytest.raises(ValueError, match="base model|does not fit"):
        load_adapter(tiny_resnet(num_labels=5), str(tmp_path))
    # state dict with wrong shapes / keys
    sd = adapter_state_dict(model)
    k = next(k for k in sd if k.endswith("radapter_conv.weight"))
    with pytest.raises(ValueError, match="shape mismatch"):
        load_adapter_state_dict(model, {**sd, k: torch.zeros(1, 1, 1, 1)})
    with pytest.raises(ValueError, match="missing"):
        load_adapter_state_dict(model, {kk: v for kk, v in sd.items() if kk != k})


def test_vit_lora_trains_only_lora_and_head():
    torch.manual_seed(0)
    vit = ViTForImageClassification(ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2,
                                              num_attention_heads=2, intermediate_size=37, num_labels=3))
    names = {n for n, _ in vit.named_modules()}
    assert "vit.layers.0.attention.q_proj" in names and "vit.layers.0.attention.v_proj" in names
    model = get_peft_model(vit, vit_lora_config(r=4, alpha=8))
    tk = trainable_keys(model)
    assert tk and all(("lora_" in n) or ("classifier.modules_to_save" in n) for n in tk)
    assert {n.split(".attention.")[1].split(".")[0] for n in tk if "lora_" in n} == {"q_proj", "v_proj"}
    assert "base_model.model.classifier.modules_to_save.default.weight" in tk
    out = model(pixel_values=torch.randn(2, 3, 16, 16)).logits
    out.sum().backward()
    assert all(p.grad is None for n, p in model.named_parameters() if n not in tk)


def test_parallel_default_skips_1x1_convs_of_bottleneck_resnets():
    torch.manual_seed(0)
    cfg = ResNetConfig(embedding_size=8, hidden_sizes=[16, 32], depths=[1, 1], layer_type="bottleneck", num_labels=3)
    model = get_adapter_model(ResNetForImageClassification(cfg), ParallelAdapterConfig())
    adapted = {n.split(".padapter_conv")[0] for n in trainable_keys(model) if "padapter_conv" in n}
    assert adapted == {"base_model.resnet.embedder.embedder",
                       "base_model.resnet.encoder.stages.0.layers.0.layer.1",
                       "base_model.resnet.encoder.stages.1.layers.0.layer.1"}
    x = torch.randn(2, 3, 16, 16)
    model.eval()
    with torch.no_grad():
        with model.disable_adapter():
            ref = model(pixel_values=x).logits
        assert torch.allclose(model(pixel_values=x).logits, ref)  # zero init: function == pretrained base
