"""Parameter accounting for adapters (no weights allocated: everything on the meta device), and the reference
architectures the papers count on (ResNet-18 for PerAda, Rebuffi's ResNet-26 for parallel adapters)."""
from __future__ import annotations

import copy

import torch
from torch import nn

from .config import ConvAdapterConfig
from .io import _BUFFER_SUFFIXES, adapter_state_dict, is_adapter_key, is_added_key


def resnet18_config(num_labels: int = 10, **kwargs):
    """transformers' ResNet-18 (= torchvision resnet18: same stem, blocks, 1x1-conv+BN downsample, Linear head)."""
    from transformers import ResNetConfig

    return ResNetConfig(embedding_size=64, hidden_sizes=[64, 128, 256, 512], depths=[2, 2, 2, 2],
                        layer_type="basic", num_labels=num_labels, **kwargs)


def resnet26_like_config(num_labels: int = 10, width: float = 1.0, **kwargs):
    """Closest transformers ResNet to Rebuffi's ResNet-26 (3 stages x 4 basic blocks, 64/128/256 channels, stem 32,
    first block of every stage strided).  transformers' ResNet cannot express three details of the reference model:
    its stem is a 7x7 stride-2 conv + max-pool (Rebuffi: 3x3 stride 1), its shortcuts are 1x1 conv + BN (Rebuffi:
    parameter-free avg-pool + zero padding) and it has no final BN before the pooling.  Counts therefore differ
    slightly from the paper's; ``rebuffi_resnet26_counts`` gives the exact reference-model numbers."""
    from transformers import ResNetConfig

    def w(c):
        return max(1, int(round(c * width)))

    return ResNetConfig(embedding_size=w(32), hidden_sizes=[w(64), w(128), w(256)], depths=[4, 4, 4],
                        layer_type="basic", downsample_in_first_stage=True, num_labels=num_labels, **kwargs)


def rebuffi_resnet26_counts(num_labels: int = 10, width: float = 1.0, in_channels: int = 3) -> dict:
    """Exact parameter/float counts of Rebuffi et al.'s ResNet-26 (``ResNet(BasicBlock, [4,4,4])``: stem
    conv_task(3->32), stages 64/128/256 x 4 blocks, parameter-free shortcuts, final BN + Linear) with one parallel
    1x1 adapter per 3x3 conv (25).  Reproduces the paper's counts (Sec. III) (10 classes: base convs 5,806,944, adapters 645,216,
    trainable 655,530, ratios 8.874 / 8.782)."""

    def w(c):
        return max(1, int(round(c * width)))

    convs = [(in_channels, w(32))]  # stem
    cin = w(32)
    for planes in (w(64), w(128), w(256)):
        for _ in range(4):
            convs += [(cin, planes), (planes, planes)]
            cin = planes
    base_convs = sum(9 * i * o for i, o in convs)
    adapters = sum(i * o for i, o in convs)
    bn_channels = sum(o for _, o in convs) + w(256)  # conv_task BNs + final BN
    bn_affine = 2 * bn_channels
    bn_stats = 2 * bn_channels
    fc = w(256) * num_labels + num_labels
    full_trainable = base_convs + bn_affine + fc
    adapter_trainable = adapters + bn_affine + fc
    full_state = full_trainable + bn_stats
    payload = adapter_trainable + bn_stats
    return dict(
        n_adapted_convs=len(convs), base_convs=base_convs, adapters=adapters, bn_affine=bn_affine,
        bn_running_stats=bn_stats, fc=fc, base=full_trainable, total=full_trainable + adapters,
        trainable=adapter_trainable, communicated=adapter_trainable, payload_floats=payload,
        full_state_floats=full_state, state_with_adapters_floats=full_state + adapters,
        trainable_ratio=full_trainable / adapter_trainable, payload_ratio=full_state / payload,
        full_mib=full_state * 4 / 2**20, with_adapters_mib=(full_state + adapters) * 4 / 2**20,
        payload_mb=payload * 4 / 1e6,
    )


def _numel_floats(buffers) -> int:
    return sum(b.numel() for b in buffers if b.is_floating_point())


def _count_base(inner: nn.Module, buffers: bool = False) -> int:
    """The base model's own parameters (or float buffers) inside an adapter model: skip adapter containers and the
    per-adapter head copies (keep ``original_module``)."""
    total, seen = 0, set()
    items = inner.named_buffers() if buffers else inner.named_parameters()
    for n, t in items:
        if id(t) in seen:
            continue
        seen.add(id(t))
        if is_adapter_key(n) or ".modules_to_save." in f".{n}.":
            continue
        if buffers and not t.is_floating_point():
            continue
        total += t.numel()
    return total


def count_parameters(model_or_config, adapter_config=None, adapter_name: str = "default") -> dict:
    """Parameter accounting without allocating weights.

    ``model_or_config``: a transformers config, a plain model (its config is rebuilt on meta; the model is not
    touched) or an adapter model (counted as is; ``adapter_config`` must then be None). ``adapter_config``: a
    residual/parallel config or a peft config (LoRA). Returns

    * ``base``: parameters of the plain base model;
    * ``total``: base + parameters the adapter *adds* (adapter convs/BNs, LoRA A/B) = the paper's "base + adapters";
    * ``trainable``: parameters with ``requires_grad`` (one adapter active);
    * ``communicated``: parameters of the adapter state dict that travels (= trainable for these methods);
    * ``communicated_buffers``: float BN running statistics travelling with it;
    * ``payload_floats`` = communicated + communicated_buffers;  ``full_state_floats``: base params + base BN stats
      (what full fine-tuning sends); ``trainable_ratio`` = base/trainable; ``payload_ratio`` = full_state/payload;
      ``trainable_fraction`` = trainable/base.
    """
    from transformers import AutoModelForImageClassification, PretrainedConfig

    from .model import get_adapter_model, is_adapter_model

    if is_adapter_model(model_or_config):
        if adapter_config is not None:
            raise ValueError("count_parameters: pass adapter_config=None for an adapter model")
        model, base_model = model_or_config, None
    else:
        if isinstance(model_or_config, PretrainedConfig):
            cfg = model_or_config
        elif hasattr(model_or_config, "config"):
            cfg = model_or_config.config
        else:
            raise TypeError("count_parameters expects a transformers config, a transformers model or an adapter model")
        with torch.device("meta"):
            base_model = AutoModelForImageClassification.from_config(cfg)
        model = None
    with torch.device("meta"):
        if base_model is not None:
            base = sum(p.numel() for p in base_model.parameters())
            base_stats = _numel_floats(base_model.buffers())
            if adapter_config is None:
                return dict(base=base, total=base, trainable=base, communicated=base, communicated_buffers=base_stats,
                            payload_floats=base + base_stats, full_state_floats=base + base_stats,
                            trainable_ratio=1.0, payload_ratio=1.0, trainable_fraction=1.0)
            if isinstance(adapter_config, ConvAdapterConfig):
                model = get_adapter_model(base_model, copy.deepcopy(adapter_config), adapter_name=adapter_name)
            else:
                from peft import get_peft_model

                model = get_peft_model(base_model, copy.deepcopy(adapter_config), adapter_name=adapter_name)
        inner = model.get_base_model()
        added = sum(p.numel() for n, p in inner.named_parameters() if is_added_key(n))
        base = _count_base(inner)
        base_stats = _count_base(inner, buffers=True)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        sd = adapter_state_dict(model, adapter_name, clone=False)
        communicated = sum(v.numel() for k, v in sd.items() if not k.endswith(_BUFFER_SUFFIXES))
        comm_buffers = sum(v.numel() for k, v in sd.items() if k.endswith(_BUFFER_SUFFIXES) and v.is_floating_point())
    payload = communicated + comm_buffers
    full_state = base + base_stats
    return dict(
        base=base, total=base + added, trainable=trainable, communicated=communicated,
        communicated_buffers=comm_buffers, payload_floats=payload, full_state_floats=full_state,
        trainable_ratio=base / trainable if trainable else float("inf"),
        payload_ratio=full_state / payload if payload else float("inf"),
        trainable_fraction=trainable / base,
    )


__all__ = ["count_parameters", "rebuffi_resnet26_counts", "resnet18_config", "resnet26_like_config"]
