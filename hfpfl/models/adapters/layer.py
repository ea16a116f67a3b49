"""Adapter layers (the ``layer.py`` of a peft-style tuner), plain torch.

======================  ==============  ============================================================================
layer                   key prefix      what it does on a conv unit (conv -> BN -> act)
======================  ==============  ============================================================================
``ResidualAdapterLayer``  ``radapter_``   h = conv(x); h = h + Conv1x1(Dropout(BN(h))); y = act(BN_copy(h))  (PerAda)
``ParallelAdapterLayer``  ``padapter_``   y = act(BN_copy(conv(x) + Conv1x1_s(x)))              (Elvebakken et al.)
``ModulesToSave``         ``modules_to_save``  a per-adapter trainable copy of a module (the classification head)
======================  ==============  ============================================================================

Every container is an ``nn.ModuleDict`` keyed by adapter name (peft's convention), so model keys read
``...layer.0.radapter_conv.<adapter>.weight`` and "what travels" is a key filter; several adapters (PerAda's global
``default`` and ``personal``) live side by side, exactly one is active.  A unit's trainable BN is a per-adapter copy
of the pretrained BN (``<prefix>norm.<adapter>``), like peft's LN-tuning, so ``disable_adapter()`` still gives the
untouched pretrained network.
"""
from __future__ import annotations

import copy
import warnings
from typing import Any, Optional

import torch
from torch import nn

from .config import ConvAdapterConfig, ParallelAdapterConfig, ResidualAdapterConfig

CONTAINER_NAMES = ("radapter_conv", "radapter_bn", "radapter_norm", "radapter_dropout", "padapter_conv",
                   "padapter_norm", "modules_to_save")


def is_conv_unit(module: nn.Module) -> bool:
    return isinstance(getattr(module, "convolution", None), nn.Conv2d) and isinstance(
        getattr(module, "normalization", None), nn.BatchNorm2d
    )


class AdapterLayerMixin:
    """Active-adapter bookkeeping shared by every layer (peft's ``BaseTunerLayer`` in miniature)."""

    adapter_layer_names: tuple[str, ...] = ()
    active_adapter: Optional[str] = None
    disabled: bool = False

    def adapter_names(self) -> set[str]:
        return {n for c in self.adapter_layer_names for n in getattr(self, c)}

    def set_adapter(self, name: Optional[str]) -> None:
        """Activate ``name``: its parameters require grad, every other adapter's do not."""
        self.active_adapter = name
        for c in self.adapter_layer_names:
            for n, m in getattr(self, c).items():
                m.requires_grad_(n == name)

    def delete_adapter(self, name: str) -> None:
        for c in self.adapter_layer_names:
            d = getattr(self, c)
            if name in d:
                del d[name]
        if self.active_adapter == name:
            self.active_adapter = None


class ConvUnitAdapterLayer(nn.Module, AdapterLayerMixin):
    """Wraps one conv unit (``.convolution`` Conv2d, ``.normalization`` BatchNorm2d, ``.activation``)."""

    prefix: str = ""

    def __init__(self, base_layer: nn.Module):
        super().__init__()
        if not is_conv_unit(base_layer):
            raise ValueError(f"{type(self).__name__} needs a module with .convolution (Conv2d) and .normalization "
                             f"(BatchNorm2d), got {type(base_layer).__name__}")
        self.base_layer = base_layer
        self._init_containers()
        self.merged_adapters: list[str] = []
        self._merge_cache: dict[str, Any] = {}

    @property
    def merged(self) -> bool:
        return bool(self.merged_adapters)

    def _init_containers(self):  # pragma: no cover - overridden
        raise NotImplementedError

    def _conv_dict(self) -> nn.ModuleDict:
        return getattr(self, self.prefix + "conv")

    def _norm_dict(self) -> nn.ModuleDict:
        return getattr(self, self.prefix + "norm")

    def _make_adapter(self, adapter_name: str, config: ConvAdapterConfig) -> None:  # pragma: no cover
        raise NotImplementedError

    def update_layer(self, adapter_name: str, config: ConvAdapterConfig, with_adapter: bool) -> None:
        # checked first, so that a shortcut named as a target gets this message, not the kernel-shape one; refused
        # rather than supported: ResNet26 (adapters paper section III, Rebuffi et al.) has parameter-free shortcuts
        if not isinstance(getattr(self.base_layer, "activation", None), nn.Module):  # forward ends in .activation
            raise ValueError(f"{type(self.base_layer).__name__} (a shortcut/downsample unit: conv + BN, no activation) "
                             f"cannot take a {config.kind} adapter or a trainable BN copy; remove it from "
                             f"target_modules / norm_modules")
        if with_adapter:
            self._make_adapter(adapter_name, config)
        if config.train_norms or not with_adapter:
            self._norm_dict()[adapter_name] = copy.deepcopy(self.base_layer.normalization)

    def _adapter_delta(self, name: str, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        unit = self.base_layer
        name = self.active_adapter
        if self.disabled:
            if self.merged:
                self.unmerge()
            return unit(x, *args, **kwargs)
        if self.merged or name is None:
            return unit(x, *args, **kwargs)
        convs, norms = self._conv_dict(), self._norm_dict()
        if name not in convs and name not in norms:
            return unit(x, *args, **kwargs)  # this adapter does not touch this unit
        h = unit.convolution(x)
        if name in convs:
            h = self._adapter_delta(name, h, x)
        h = norms[name](h) if name in norms else unit.normalization(h)
        return unit.activation(h)

    # merging -------------------------------------------------------------------------------------------------------
    def _swap_norm(self, name: str) -> None:
        norms = self._norm_dict()
        if name in norms:
            norms[name], self.base_layer.normalization = self.base_layer.normalization, norms[name]

    def merge(self, adapter_name: str, safe_merge: bool = False) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def unmerge(self) -> None:
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.")
            return
        name = self.merged_adapters.pop()
        weight, running_mean = self._merge_cache.pop(name)
        self._swap_norm(name)
        self.base_layer.convolution.weight.data = weight
        if running_mean is not None:
            norm = self._norm_dict()[name] if name in self._norm_dict() else self.base_layer.normalization
            norm.running_mean.data = running_mean

    def __repr__(self) -> str:
        return self.prefix.rstrip("_") + "." + super().__repr__()


class ResidualAdapterLayer(ConvUnitAdapterLayer):
    prefix = "radapter_"
    adapter_layer_names = ("radapter_conv", "radapter_bn", "radapter_norm")

    def _init_containers(self):
        self.radapter_conv = nn.ModuleDict()
        self.radapter_bn = nn.ModuleDict()
        self.radapter_dropout = nn.ModuleDict()
        self.radapter_norm = nn.ModuleDict()

    def delete_adapter(self, name: str) -> None:
        super().delete_adapter(name)
        if name in self.radapter_dropout:
            del self.radapter_dropout[name]

    def _make_adapter(self, adapter_name: str, config: ResidualAdapterConfig) -> None:
        planes = self.base_layer.convolution.out_channels
        ref = self.base_layer.convolution.weight
        conv = nn.Conv2d(planes, planes, kernel_size=1, bias=False, device=ref.device, dtype=ref.dtype)
        nn.init.normal_(conv.weight, mean=0.0, std=config.init_std)
        self.radapter_conv[adapter_name] = conv
        if config.adapter_bn:
            bn = nn.BatchNorm2d(planes, device=ref.device, dtype=ref.dtype)
            nn.init.ones_(bn.weight)
            nn.init.zeros_(bn.bias)
            self.radapter_bn[adapter_name] = bn
        self.radapter_dropout[adapter_name] = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()

    def _adapter_delta(self, name, h, x):
        z = self.radapter_bn[name](h) if name in self.radapter_bn else h
        return h + self.radapter_conv[name](self.radapter_dropout[name](z))

    def merge(self, adapter_name: str, safe_merge: bool = False) -> None:
        """Inference-only fold (uses BN running statistics; dropout is identity in eval).  With
        s = gamma/sqrt(var+eps), c = beta - mean*s, A the 1x1 weight:  h + A(s*h + c) = M h + A c, M = I + A diag(s).
        So W' = M W (channel mix of the kxk kernel) and the constant A c is absorbed into the next BN's running
        mean.  Outputs match the unmerged model in eval mode only."""
        if self.merged:
            raise ValueError("ResidualAdapterLayer can merge exactly one adapter at a time.")
        name = adapter_name
        conv = self.base_layer.convolution
        running_mean = None
        orig_weight = conv.weight.data.clone()
        if name in self.radapter_conv:
            a = self.radapter_conv[name].weight.data[:, :, 0, 0]
            planes = a.shape[0]
            if name in self.radapter_bn:
                bn = self.radapter_bn[name]
                s = bn.weight.data / torch.sqrt(bn.running_var + bn.eps)
                c = bn.bias.data - bn.running_mean * s
            else:
                s = torch.ones(planes, dtype=a.dtype, device=a.device)
                c = torch.zeros(planes, dtype=a.dtype, device=a.device)
            m = torch.eye(planes, dtype=a.dtype, device=a.device) + a * s[None, :]
            new_w = torch.einsum("oc,cikl->oikl", m, conv.weight.data)
            if safe_merge and not torch.isfinite(new_w).all():
                raise ValueError(f"NaNs detected in the merged weights; adapter {name} seems to be broken")
            b = a @ c
            target_norm = self.radapter_norm[name] if name in self.radapter_norm else self.base_layer.normalization
            running_mean = target_norm.running_mean.data.clone()
            target_norm.running_mean.data = running_mean - b
            conv.weight.data = new_w
        self._merge_cache[name] = (orig_weight, running_mean)
        self._swap_norm(name)
        self.merged_adapters.append(name)


class ParallelAdapterLayer(ConvUnitAdapterLayer):
    prefix = "padapter_"
    adapter_layer_names = ("padapter_conv", "padapter_norm")

    def _init_containers(self):
        self.padapter_conv = nn.ModuleDict()
        self.padapter_norm = nn.ModuleDict()

    def _make_adapter(self, adapter_name: str, config: ParallelAdapterConfig) -> None:
        base = self.base_layer.convolution
        k = base.kernel_size
        if (k[0] != k[1] or k[0] % 2 == 0 or k[0] == 1 or base.padding != (k[0] // 2, k[1] // 2)
                or base.dilation != (1, 1) or base.groups != 1 or base.padding_mode != "zeros"):
            raise ValueError(
                f"ParallelAdapter needs an odd square kxk conv (k>1) with padding k//2, dilation 1, groups 1 so that a "
                f"same-stride 1x1 aligns with its kernel centre; got kernel={base.kernel_size} padding={base.padding} "
                f"dilation={base.dilation} groups={base.groups}. Exclude this module from target_modules."
            )
        ref = base.weight
        conv = nn.Conv2d(base.in_channels, base.out_channels, kernel_size=1, stride=base.stride, padding=0,
                         bias=False, device=ref.device, dtype=ref.dtype)
        if config.init == "zeros":
            nn.init.zeros_(conv.weight)
        elif config.init == "normal":
            nn.init.normal_(conv.weight, 0.0, config.init_std)
        else:
            nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")
        self.padapter_conv[adapter_name] = conv

    def _adapter_delta(self, name, h, x):
        return h + self.padapter_conv[name](x)

    def delta_weight(self, name: str) -> torch.Tensor:
        """The 1x1 kernel placed at the centre of a zero kxk kernel (merging at inference, the paper's Sec. III)."""
        base = self.base_layer.convolution.weight
        k = base.shape[-1]
        delta = torch.zeros_like(base)
        delta[:, :, k // 2, k // 2] = self.padapter_conv[name].weight[:, :, 0, 0].to(base.dtype)
        return delta

    def merge(self, adapter_name: str, safe_merge: bool = False) -> None:
        """Exact fold (train and eval): W'[:, :, c, c] = W[:, :, c, c] + a[:, :, 0, 0], and the adapter's BN copy
        becomes the unit's BN."""
        if self.merged:
            raise ValueError("ParallelAdapterLayer can merge exactly one adapter at a time.")
        name = adapter_name
        conv = self.base_layer.convolution
        orig = conv.weight.data.clone()
        if name in self.padapter_conv:
            new_w = conv.weight.data + self.delta_weight(name).data
            if safe_merge and not torch.isfinite(new_w).all():
                raise ValueError(f"NaNs detected in the merged weights; adapter {name} seems to be broken")
            conv.weight.data = new_w
        self._merge_cache[name] = (orig, None)
        self._swap_norm(name)
        self.merged_adapters.append(name)


class ModulesToSave(nn.Module, AdapterLayerMixin):
    """A per-adapter trainable copy of a module (peft's ``ModulesToSaveWrapper``): ``original_module`` stays frozen,
    ``modules_to_save.<adapter>`` is used while that adapter is active."""

    adapter_layer_names = ("modules_to_save",)

    def __init__(self, module: nn.Module):
        super().__init__()
        self.original_module = module
        self.modules_to_save = nn.ModuleDict()

    def update_layer(self, adapter_name: str) -> None:
        self.modules_to_save[adapter_name] = copy.deepcopy(self.original_module)

    def forward(self, *args, **kwargs):
        if self.disabled or self.active_adapter not in self.modules_to_save:
            return self.original_module(*args, **kwargs)
        return self.modules_to_save[self.active_adapter](*args, **kwargs)


LAYER_CLASSES = {"residual": ResidualAdapterLayer, "parallel": ParallelAdapterLayer}
