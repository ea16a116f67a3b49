"""Adapters for hfpfl as real PEFT tuners: residual adapters (PerAda), parallel adapters (Elvebakken et al.) and a
LoRA helper for ViT.

Two custom PEFT methods are registered with ``peft`` at import time (``peft.utils.register_peft_method``), so the
whole stock PEFT API works on them: ``get_peft_model``, ``PeftModel.save_pretrained`` / ``from_pretrained``,
``add_adapter`` / ``set_adapter`` (PerAda's personal and global adapters are two adapters on one model),
``disable_adapter()``, ``merge_and_unload``.

======================  =========================  ==============  ===========================================
method (peft name)      config                     key prefix      what it does on every targeted conv unit
======================  =========================  ==============  ===========================================
``radapter``            ``ResidualAdapterConfig``  ``radapter_``   h = conv(x); h = h + Conv1x1(Dropout(BN(h)));
                                                                   y = act(BN_trainable(h))   (PerAda / Rebuffi)
``padapter``            ``ParallelAdapterConfig``  ``padapter_``   y = act(BN_trainable(conv(x) + Conv1x1_s(x)))
                                                                   (Elvebakken et al., Rebuffi parallel)
======================  =========================  ==============  ===========================================

A "conv unit" is any module with a ``convolution`` (``nn.Conv2d``) and a ``normalization`` (``nn.BatchNorm2d``)
attribute and an ``activation``; in transformers' ResNet that is ``ResNetConvLayer`` (stem
``resnet.embedder.embedder`` and the block convs ``resnet.encoder.stages.N.layers.M.layer.K``).  The shortcut
(``...layers.M.shortcut``, 1x1 conv + BN = torchvision's ``downsample``) is never targeted by default and stays frozen.

Trainable BatchNorms.  Both papers train the BN of every adapted layer (PerAda: block ``bn1``/``bn2`` and the stem
``bn1``; parallel adapters: the "domain-specific" mu_l, sigma_l).  Here each adapter owns its *own copy* of that BN
(``<prefix>norm.<adapter>``), initialised from the pretrained BN, exactly like PEFT's LN-tuning does for LayerNorms.
So BNs travel with the adapter under the adapter prefix, two adapters (PerAda's personal ``v_i`` and global ``w``)
each have their own BN set, and ``disable_adapter()`` still gives the untouched pretrained network.

BatchNorm name mapping (torchvision / PerAda code name -> transformers name):

* stem ``bn1``                -> ``resnet.embedder.embedder.normalization``           (trained copy: ``...embedder.embedder.radapter_norm``)
* block ``layerS.B.bn1``      -> ``resnet.encoder.stages.{S-1}.layers.B.layer.0.normalization`` (copy: ``...layer.0.radapter_norm``)
* block ``layerS.B.bn2``      -> ``resnet.encoder.stages.{S-1}.layers.B.layer.1.normalization`` (copy: ``...layer.1.radapter_norm``)
* ``layerS.0.downsample.1``   -> ``resnet.encoder.stages.{S-1}.layers.0.shortcut.normalization``  (frozen, never travels)
* ``fc``                      -> ``classifier.1`` (``modules_to_save``: ``classifier.modules_to_save.<adapter>.1``)

Key API (see the functions at the end of this file): ``is_adapter_key``, ``trainable_keys``, ``travel_keys``,
``adapter_state_dict``, ``load_adapter_state_dict``, ``load_adapter``, ``count_parameters``,
``merge_parallel_adapters``, ``eval_frozen_norms``, ``vit_lora_config``.
"""

from __future__ import annotations

import copy
import math
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch import nn

from peft import LoraConfig, PeftConfig, PeftModel, get_peft_model
from peft.tuners.tuners_utils import (
    BaseTuner,
    BaseTunerLayer,
    check_adapters_to_merge,
    check_target_module_exists,
)
from peft.utils import PeftType, get_peft_model_state_dict, set_peft_model_state_dict

__all__ = [
    "ResidualAdapterConfig",
    "ResidualAdapterModel",
    "ResidualAdapterLayer",
    "ParallelAdapterConfig",
    "ParallelAdapterModel",
    "ParallelAdapterLayer",
    "ADAPTER_KEY_PREFIXES",
    "is_adapter_key",
    "is_added_key",
    "is_head_key",
    "is_norm_key",
    "trainable_keys",
    "travel_keys",
    "adapter_state_dict",
    "load_adapter_state_dict",
    "load_adapter",
    "count_parameters",
    "rebuffi_resnet26_counts",
    "resnet26_like_config",
    "resnet18_config",
    "merge_parallel_adapters",
    "eval_frozen_norms",
    "vit_lora_config",
    "conv_units",
]

RADAPTER = "radapter"
PADAPTER = "padapter"
ADAPTER_KEY_PREFIXES = ("radapter_", "padapter_", "lora_")

# transformers ResNet module names (basic and bottleneck blocks: ``...stages.N.layers.M.layer.K``; stem:
# ``...embedder.embedder``).  Regexes are matched with re.fullmatch by peft.
_BLOCK_CONVS = r"(.*\.)?layers\.\d+\.layer\.\d+"
_STEM_CONV = r"(.*\.)?embedder\.embedder"
_RESIDUAL_DEFAULT_TARGETS = _BLOCK_CONVS
_RESIDUAL_DEFAULT_NORMS = _STEM_CONV
_PARALLEL_DEFAULT_TARGETS = rf"({_BLOCK_CONVS}|{_STEM_CONV})"


# --------------------------------------------------------------------------------------------------------------------
# PeftType registration
# --------------------------------------------------------------------------------------------------------------------
def _extend_peft_type(name: str) -> PeftType:
    """peft 0.21's ``register_peft_method`` requires the method to be a member of the ``PeftType`` enum, which only
    lists peft's own methods.  Python enums cannot be extended through the public API, so add the member the way
    ``aenum.extend_enum`` does (members map, value map, names list).  Idempotent."""
    key = name.upper()
    if key in PeftType.__members__:
        return PeftType[key]
    member = str.__new__(PeftType, key)
    member._name_ = key
    member._value_ = key
    member.__objclass__ = PeftType
    member.__init__(key)
    PeftType._member_map_[key] = member
    PeftType._value2member_map_[key] = member
    PeftType._member_names_.append(key)
    type.__setattr__(PeftType, key, member)
    return member


_extend_peft_type(RADAPTER)
_extend_peft_type(PADAPTER)


# --------------------------------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class _ConvAdapterConfig(PeftConfig):
    target_modules: Optional[Union[list[str], str]] = field(
        default=None,
        metadata={
            "help": "Conv units (modules with .convolution Conv2d + .normalization BatchNorm2d, e.g. transformers' "
            "ResNetConvLayer) that get an adapter. List of names/suffixes or a regex (fullmatch). None = the "
            "method's default for transformers ResNet."
        },
    )
    exclude_modules: Optional[Union[list[str], str]] = field(
        default=None, metadata={"help": "Module names (list, suffix match) or regex never to adapt."}
    )
    norm_modules: Optional[Union[list[str], str]] = field(
        default=None,
        metadata={
            "help": "Conv units whose BatchNorm is trained (per-adapter copy) but that get no adapter conv. "
            "None = the method's default; [] = none."
        },
    )
    train_norms: bool = field(
        default=True,
        metadata={"help": "Each adapted unit gets a trainable per-adapter copy of its BatchNorm (travels with it)."},
    )
    modules_to_save: Optional[list[str]] = field(
        default_factory=lambda: ["classifier"],
        metadata={"help": "Extra modules trained and saved with the adapter (the classification head)."},
    )
    init_std: float = field(default=1e-4, metadata={"help": "Std of the N(0, std^2) init of the 1x1 adapter conv."})
    frozen_norms_eval: bool = field(
        default=True,
        metadata={
            "help": "model.train() keeps every frozen BatchNorm (shortcut/downsample BN, the pretrained BNs shadowed "
            "by trainable copies) in eval mode, so pretrained running statistics never drift (PerAda spec "
            "ambiguity 12, recommended default). False replicates the PerAda code, where frozen downsample BNs "
            "update their statistics locally and never travel."
        },
    )
    base_model_signature: Optional[dict] = field(
        default=None,
        metadata={
            "help": "Filled at injection with the base model's architecture fields; loading the adapter onto a model "
            "with a different signature raises a ValueError."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.target_modules, (list, tuple, set)):
            if len(self.target_modules) == 0:
                raise ValueError(f"{type(self).__name__}: target_modules is empty; give names/regex or None.")
            self.target_modules = list(self.target_modules)
        if isinstance(self.modules_to_save, str):
            self.modules_to_save = [self.modules_to_save]
        if not (isinstance(self.init_std, (int, float)) and self.init_std >= 0 and math.isfinite(self.init_std)):
            raise ValueError(f"{type(self).__name__}: init_std must be a finite number >= 0, got {self.init_std!r}")


@dataclass
class ResidualAdapterConfig(_ConvAdapterConfig):
    """PerAda's residual adapter (Rebuffi et al. 2017 series form, as in Pillutla et al.'s FL_partial_personalization
    code that PerAda uses): after the 3x3 conv of every basic-block conv unit, ``h <- h + Conv1x1(Dropout_p(BN(h)))``,
    then the unit's (trainable copy of its) BN and activation.

    Defaults reproduce PerAda's trained/communicated set on transformers' ResNet: adapters on the block convs
    (``layer.0`` = conv1/bn1, ``layer.1`` = conv2/bn2), trainable stem BN (``norm_modules`` = stem), trainable block
    BNs, classifier head; frozen: all backbone convs and the shortcut (downsample) path.

    ``init_std``: the paper is silent on the init; spec 2.4 (from the code) says "N(0, 1e-4)".  We read 1e-4 as the
    *standard deviation* (``nn.init.normal_(w, 0, 1e-4)``, the PyTorch convention the code uses), which also makes the
    adapter ~identity at init (spec acceptance check 7.3).
    """

    dropout: float = field(default=0.3, metadata={"help": "Dropout p inside the adapter (PerAda code default 0.3)."})
    adapter_bn: bool = field(default=True, metadata={"help": "BatchNorm inside the adapter, before the dropout."})

    def __post_init__(self):
        super().__post_init__()
        self.peft_type = getattr(PeftType, RADAPTER.upper())
        if not (0.0 <= float(self.dropout) < 1.0):
            raise ValueError(f"ResidualAdapterConfig: dropout must be in [0, 1), got {self.dropout!r}")


@dataclass
class ParallelAdapterConfig(_ConvAdapterConfig):
    """Parallel adapter (Elvebakken et al., following Rebuffi et al. 2018): a 1x1 conv with the same stride as the
    kxk conv, in parallel: ``y = act(BN(W*x + a*x))``.  Trainable and communicated: adapters + BN of every adapted
    layer + head (spec A2.4).  Default targets on transformers' ResNet: the stem and every block conv (the reference
    code adapts all 25 3x3 convs of ResNet-26 including the stem, spec A7.3); shortcuts stay frozen.

    ``init``: "zeros" (default, spec A7.4: initial function == pretrained base), "normal" (N(0, init_std^2)) or
    "he" (Kaiming-normal, the reference code).
    """

    init: str = field(default="zeros", metadata={"help": "Adapter init: 'zeros', 'normal' (init_std) or 'he'."})

    def __post_init__(self):
        super().__post_init__()
        self.peft_type = getattr(PeftType, PADAPTER.upper())
        if self.norm_modules is None:
            self.norm_modules = []
        if self.init not in ("zeros", "normal", "he"):
            raise ValueError(f"ParallelAdapterConfig: init must be 'zeros', 'normal' or 'he', got {self.init!r}")


# --------------------------------------------------------------------------------------------------------------------
# layers
# --------------------------------------------------------------------------------------------------------------------
def _is_conv_unit(module: nn.Module) -> bool:
    return isinstance(getattr(module, "convolution", None), nn.Conv2d) and isinstance(
        getattr(module, "normalization", None), nn.BatchNorm2d
    )


class _ConvUnitAdapterLayer(nn.Module, BaseTunerLayer):
    """Wraps one conv unit (conv -> BN -> act).  Holds, per adapter name, an optional adapter conv (``<p>conv``) and
    an optional trainable copy of the unit's BN (``<p>norm``).  Only one adapter may be active at a time."""

    prefix: str = ""

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: _ConvAdapterConfig, with_adapter: bool):
        super().__init__()
        if not _is_conv_unit(base_layer):
            raise ValueError(f"{type(self).__name__} needs a module with .convolution (Conv2d) and .normalization "
                             f"(BatchNorm2d), got {type(base_layer).__name__}")
        self.base_layer = base_layer
        self._init_containers()
        self._active_adapter = adapter_name
        self.merged_adapters = []
        self._merge_cache: dict[str, Any] = {}
        self.update_layer(adapter_name, config, with_adapter)

    # containers are ModuleDicts keyed by adapter name; names start with the method prefix
    def _init_containers(self):  # pragma: no cover - overridden
        raise NotImplementedError

    def _conv_dict(self) -> nn.ModuleDict:
        return getattr(self, self.prefix + "conv")

    def _norm_dict(self) -> nn.ModuleDict:
        return getattr(self, self.prefix + "norm")

    def _make_adapter(self, adapter_name: str, config: _ConvAdapterConfig) -> None:  # pragma: no cover
        raise NotImplementedError

    def update_layer(self, adapter_name: str, config: _ConvAdapterConfig, with_adapter: bool) -> None:
        if with_adapter:
            self._make_adapter(adapter_name, config)
        if config.train_norms or not with_adapter:
            norm = copy.deepcopy(self.base_layer.normalization)
            self._norm_dict()[adapter_name] = norm
        self.set_adapter(self.active_adapters, inference_mode=config.inference_mode)

    def _adapter_delta(self, name: str, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        unit = self.base_layer
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return unit(x, *args, **kwargs)
        if self.merged or not self.active_adapters:
            return unit(x, *args, **kwargs)
        if len(self.active_adapters) != 1:
            raise ValueError(
                f"{type(self).__name__}: {len(self.active_adapters)} active adapters {self.active_adapters}; residual "
                "and parallel adapters own their BatchNorms, so exactly one may be active (use set_adapter(name))."
            )
        name = self.active_adapters[0]
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

    def unmerge(self) -> None:
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.")
            return
        name = self.merged_adapters.pop()
        cached = self._merge_cache.pop(name, None)
        self._swap_norm(name)
        if cached is not None:
            weight, running_mean = cached
            self.base_layer.convolution.weight.data = weight
            if running_mean is not None:
                self._norm_dict()[name].running_mean.data = running_mean

    def __repr__(self) -> str:
        return self.prefix.rstrip("_") + "." + super().__repr__()


class ResidualAdapterLayer(_ConvUnitAdapterLayer):
    prefix = "radapter_"
    adapter_layer_names = ("radapter_conv", "radapter_bn", "radapter_norm")
    other_param_names = ("radapter_dropout",)

    def _init_containers(self):
        self.radapter_conv = nn.ModuleDict()
        self.radapter_bn = nn.ModuleDict()
        self.radapter_dropout = nn.ModuleDict()
        self.radapter_norm = nn.ModuleDict()

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

    def merge(self, safe_merge: bool = False, adapter_names: Optional[list[str]] = None) -> None:
        """Inference-only fold (uses BN running statistics; dropout is identity in eval).  With
        s = gamma/sqrt(var+eps), c = beta - mean*s, A the 1x1 weight:  h + A(s*h + c) = M h + A c, M = I + A diag(s).
        So W' = M W (channel mix of the kxk kernel) and the constant A c is absorbed into the next BN's running
        mean.  Outputs match the unmerged model in eval mode only."""
        adapter_names = check_adapters_to_merge(self, adapter_names)
        if not adapter_names:
            return
        if len(adapter_names) > 1 or self.merged:
            raise ValueError("ResidualAdapterLayer can merge exactly one adapter at a time.")
        name = adapter_names[0]
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

    def unmerge(self) -> None:
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.")
            return
        name = self.merged_adapters.pop()
        weight, running_mean = self._merge_cache.pop(name)
        self._swap_norm(name)
        self.base_layer.convolution.weight.data = weight
        if running_mean is not None:
            norm = self.radapter_norm[name] if name in self.radapter_norm else self.base_layer.normalization
            norm.running_mean.data = running_mean


class ParallelAdapterLayer(_ConvUnitAdapterLayer):
    prefix = "padapter_"
    adapter_layer_names = ("padapter_conv", "padapter_norm")

    def _init_containers(self):
        self.padapter_conv = nn.ModuleDict()
        self.padapter_norm = nn.ModuleDict()

    def _make_adapter(self, adapter_name: str, config: ParallelAdapterConfig) -> None:
        base = self.base_layer.convolution
        k = base.kernel_size
        if (
            k[0] != k[1]
            or k[0] % 2 == 0
            or k[0] == 1
            or base.padding != (k[0] // 2, k[1] // 2)
            or base.dilation != (1, 1)
            or base.groups != 1
            or base.padding_mode != "zeros"
        ):
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
        """The 1x1 kernel placed at the centre of a zero kxk kernel (spec A2.7)."""
        base = self.base_layer.convolution.weight
        k = base.shape[-1]
        delta = torch.zeros_like(base)
        delta[:, :, k // 2, k // 2] = self.padapter_conv[name].weight[:, :, 0, 0].to(base.dtype)
        return delta

    def merge(self, safe_merge: bool = False, adapter_names: Optional[list[str]] = None) -> None:
        """Exact fold (train and eval): W'[:, :, c, c] = W[:, :, c, c] + a[:, :, 0, 0], and the adapter's BN copy
        becomes the unit's BN."""
        adapter_names = check_adapters_to_merge(self, adapter_names)
        if not adapter_names:
            return
        if len(adapter_names) > 1 or self.merged:
            raise ValueError("ParallelAdapterLayer can merge exactly one adapter at a time.")
        name = adapter_names[0]
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


# --------------------------------------------------------------------------------------------------------------------
# tuner models
# --------------------------------------------------------------------------------------------------------------------
_SIGNATURE_FIELDS = ("model_type", "num_channels", "embedding_size", "hidden_sizes", "depths", "layer_type",
                     "hidden_size", "num_hidden_layers", "image_size", "patch_size")


def _model_signature(model: nn.Module) -> Optional[dict]:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    sig = {}
    for f in _SIGNATURE_FIELDS:
        v = getattr(cfg, f, None)
        if v is not None:
            sig[f] = list(v) if isinstance(v, tuple) else v
    return sig or None


def _matches(spec, key: str) -> bool:
    if spec is None:
        return False
    if isinstance(spec, str):
        return re.fullmatch(spec, key) is not None
    return key in spec or any(key.endswith("." + s) for s in spec)


def _unit_of(module: nn.Module) -> nn.Module:
    return module.base_layer if isinstance(module, _ConvUnitAdapterLayer) else module


def conv_units(model: nn.Module) -> list[str]:
    """Names of all conv units (modules with .convolution Conv2d + .normalization BatchNorm2d) of a model; already
    wrapped units are listed by their wrapper's name."""
    names = []
    inner = set()
    for name, m in model.named_modules():
        if isinstance(m, _ConvUnitAdapterLayer):
            names.append(name)
            inner.add(name + ".base_layer")
        elif _is_conv_unit(m) and name not in inner:
            names.append(name)
    return names


class _ConvAdapterModel(BaseTuner):
    prefix: str = ""
    tuner_layer_cls = _ConvUnitAdapterLayer
    target_module_mapping: dict = {}
    _default_targets: str = ""
    _default_norms: Optional[str] = None

    def _resolve_and_validate(self, model: nn.Module, config: _ConvAdapterConfig) -> None:
        if config.target_modules is None:
            config.target_modules = self._default_targets
            if isinstance(self, ParallelAdapterModel):
                # bottleneck ResNets: the default regex also hits their 1x1 convs, which a parallel 1x1 cannot adapt
                hits = [n for n in conv_units(model) if re.fullmatch(config.target_modules, n)]
                kxk = [n for n in hits if _unit_of(model.get_submodule(n)).convolution.kernel_size[0] > 1]
                if hits and len(kxk) < len(hits):
                    config.target_modules = kxk
        if config.norm_modules is None:
            config.norm_modules = self._default_norms if self._default_norms is not None else []
        sig = _model_signature(model)
        if config.base_model_signature is None:
            config.base_model_signature = sig
        elif sig is not None and dict(config.base_model_signature) != sig:
            raise ValueError(
                f"{type(config).__name__} was created for a base model with {config.base_model_signature}, but this "
                f"model has {sig}. Load the adapter onto the base model it was trained on."
            )
        units = conv_units(model)
        unit_set = set(units)
        mts = config.modules_to_save or []
        targets, bad = [], []
        for name, _ in model.named_modules():
            if not name or any(re.match(rf"(^|.*\.){re.escape(m)}($|\..*)", name) for m in mts):
                continue
            hit = check_target_module_exists(config, name)
            if hit and not type(hit).__name__ == "_ExcludedModule":
                if name in unit_set:
                    targets.append(name)
                elif not name.endswith(".base_layer") and ".base_layer." not in name:
                    bad.append(name)
        if bad:
            raise ValueError(
                f"{type(config).__name__}: target_modules={config.target_modules!r} matches modules that are not conv "
                f"units (Conv2d .convolution + BatchNorm2d .normalization): {bad[:10]}. Available conv units: {units}"
            )
        if not targets:
            raise ValueError(
                f"{type(config).__name__}: target_modules={config.target_modules!r} matched no module of "
                f"{type(model).__name__}. Available conv units: {units}"
            )

    def inject_adapter(self, model: nn.Module, adapter_name: str, *args, **kwargs) -> None:
        self._resolve_and_validate(model, self.peft_config[adapter_name])
        super().inject_adapter(model, adapter_name, *args, **kwargs)

    def _prepare_adapter_config(self, peft_config, model_config):
        return peft_config

    @staticmethod
    def _check_target_module_exists(peft_config, key: str):
        hit = check_target_module_exists(peft_config, key)
        if hit:
            return hit
        if type(hit).__name__ == "_ExcludedModule":
            return hit
        return _matches(peft_config.norm_modules, key)

    def _create_and_replace(self, peft_config, adapter_name, target, target_name, parent, current_key,
                            parameter_name=None, **kwargs):
        if target_name == "base_layer":
            return
        is_target = bool(check_target_module_exists(peft_config, current_key))
        if isinstance(target, self.tuner_layer_cls):
            target.update_layer(adapter_name, peft_config, with_adapter=is_target)
            if adapter_name not in self.active_adapters:
                for layer_name in target.adapter_layer_names:
                    d = getattr(target, layer_name)
                    if adapter_name in d:
                        d[adapter_name].requires_grad_(False)
            return
        if isinstance(target, BaseTunerLayer):
            raise ValueError(f"{current_key} is already wrapped by {type(target).__name__}; "
                             f"cannot stack {type(self).__name__} on it")
        if not _is_conv_unit(target):
            return  # e.g. a child module matched by a suffix; validated beforehand
        new_module = self.tuner_layer_cls(target, adapter_name, peft_config, with_adapter=is_target)
        if adapter_name not in self.active_adapters:
            new_module.requires_grad_(False)
        self._replace_module(parent, target_name, new_module, target)

    def train(self, mode: bool = True):
        super().train(mode)
        if mode and any(getattr(c, "frozen_norms_eval", False) for c in self.peft_config.values()):
            eval_frozen_norms(self.model)
        return self

    def _replace_module(self, parent, child_name, new_module, child) -> None:
        if not isinstance(new_module, BaseTunerLayer):
            # unloading: put the (merged) conv unit back; peft's default would copy `.weight`, which a unit lacks
            setattr(parent, child_name, new_module)
            return
        super()._replace_module(parent, child_name, new_module, child)

    def _mark_only_adapters_as_trainable(self, model: nn.Module) -> None:
        super()._mark_only_adapters_as_trainable(model)
        # the base units' own BNs are frozen (the trainable copies live in <prefix>norm)
        for m in model.modules():
            if isinstance(m, self.tuner_layer_cls):
                m.base_layer.requires_grad_(False)

    def _cast_adapter_dtype(self, adapter_name: str, autocast_adapter_dtype: bool = True) -> None:
        pass


class ResidualAdapterModel(_ConvAdapterModel):
    """PEFT tuner for ``ResidualAdapterConfig`` (peft type ``RADAPTER``, prefix ``radapter_``)."""

    prefix = "radapter_"
    tuner_layer_cls = ResidualAdapterLayer
    _default_targets = _RESIDUAL_DEFAULT_TARGETS
    _default_norms = _RESIDUAL_DEFAULT_NORMS


class ParallelAdapterModel(_ConvAdapterModel):
    """PEFT tuner for ``ParallelAdapterConfig`` (peft type ``PADAPTER``, prefix ``padapter_``)."""

    prefix = "padapter_"
    tuner_layer_cls = ParallelAdapterLayer
    _default_targets = _PARALLEL_DEFAULT_TARGETS
    _default_norms = None


def _register():
    from peft.mapping import PEFT_TYPE_TO_TUNER_MAPPING
    from peft.utils import register_peft_method

    for name, cfg, mdl in ((RADAPTER, ResidualAdapterConfig, ResidualAdapterModel),
                           (PADAPTER, ParallelAdapterConfig, ParallelAdapterModel)):
        if getattr(PeftType, name.upper()) not in PEFT_TYPE_TO_TUNER_MAPPING:
            register_peft_method(name=name, config_cls=cfg, model_cls=mdl, prefix=name + "_")


_register()


# --------------------------------------------------------------------------------------------------------------------
# LoRA on ViT
# --------------------------------------------------------------------------------------------------------------------
def vit_lora_config(r: int = 8, alpha: int = 16, dropout: float = 0.0, target_modules=("q_proj", "v_proj"),
                    modules_to_save=("classifier",), **kwargs) -> LoraConfig:
    """LoRA on the query/value projections of transformers-5 ViT (``vit.layers.N.attention.{q,k,v,o}_proj``) with a
    trainable head.  (PerAda does not say how its DP-ViT adapter is placed: spec ambiguity 21; q/v LoRA is the
    standard choice.)"""
    if not isinstance(r, int) or r <= 0:
        raise ValueError(f"vit_lora_config: rank r must be a positive int, got {r!r}")
    if alpha <= 0:
        raise ValueError(f"vit_lora_config: alpha must be > 0, got {alpha!r}")
    if not (0.0 <= dropout < 1.0):
        raise ValueError(f"vit_lora_config: dropout must be in [0, 1), got {dropout!r}")
    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules),
                      modules_to_save=list(modules_to_save) if modules_to_save else None, **kwargs)


# --------------------------------------------------------------------------------------------------------------------
# key filters
# --------------------------------------------------------------------------------------------------------------------
def is_adapter_key(name: str) -> bool:
    """True for any state-dict key or parameter name that belongs to an adapter module of hfpfl's kinds (``radapter_*``,
    ``padapter_*``, ``lora_*``), including the per-adapter BN copies (``*_norm``)."""
    return any(part.startswith(ADAPTER_KEY_PREFIXES) for part in name.split("."))


def is_added_key(name: str) -> bool:
    """Adapter keys that are *new* parameters (not per-adapter copies of pretrained modules): adapter convs, adapter
    BNs, LoRA A/B.  These are what "base + adapters" adds to the parameter count."""
    return is_adapter_key(name) and not is_norm_key(name)


def is_norm_key(name: str) -> bool:
    """Per-adapter trainable copies of a pretrained BN (``radapter_norm`` / ``padapter_norm``)."""
    return any(part in ("radapter_norm", "padapter_norm") for part in name.split("."))


def is_head_key(name: str) -> bool:
    """Keys of ``modules_to_save`` copies (the classification head) -- in-model name or saved (name-free) form."""
    parts = name.split(".")
    return "modules_to_save" in parts or (not is_adapter_key(name) and "classifier" in parts)


def trainable_keys(model: nn.Module) -> set[str]:
    """Names (model keys, adapter name included) of all parameters with ``requires_grad``: for a peft model with one
    active adapter this is exactly that adapter's trainable set."""
    return {n for n, p in model.named_parameters() if p.requires_grad}


def adapter_state_dict(model: PeftModel, adapter_name: str = "default", include_buffers: bool = True,
                       clone: bool = True) -> dict[str, torch.Tensor]:
    """What travels for one adapter, as PEFT saves it: keys without the adapter name (so a dict from adapter "global"
    loads into slot "personal"), e.g. ``base_model.model.resnet...layer.0.radapter_conv.weight``,
    ``...layer.0.radapter_norm.running_mean``, ``base_model.model.classifier.1.weight``.  BN running statistics
    (``running_mean``/``running_var``/``num_batches_tracked``) are included unless ``include_buffers=False`` -- both
    papers exchange them (PerAda code, Elvebakken A2.4)."""
    sd = get_peft_model_state_dict(model, adapter_name=adapter_name)
    if not include_buffers:
        buffers = _buffer_suffixes()
        sd = {k: v for k, v in sd.items() if not k.endswith(buffers)}
    return {k: (v.detach().clone() if clone else v) for k, v in sd.items()}


def _buffer_suffixes():
    return (".running_mean", ".running_var", ".num_batches_tracked")


def travel_keys(model: PeftModel, adapter_name: str = "default", include_buffers: bool = True) -> set[str]:
    """The (name-free) keys of ``adapter_state_dict``: exactly adapter convs/BNs, per-adapter copies of the adapted
    units' BNs (+ running stats) and the head.  Nothing of the frozen backbone."""
    return set(adapter_state_dict(model, adapter_name, include_buffers=include_buffers, clone=False))


def load_adapter_state_dict(model: PeftModel, state_dict: dict[str, torch.Tensor], adapter_name: str = "default",
                            strict: bool = True) -> None:
    """Load a name-free adapter state dict (from ``adapter_state_dict`` or a saved ``adapter_model.safetensors``)
    into adapter slot ``adapter_name``.  With ``strict`` any missing/unexpected key or shape mismatch raises a
    ValueError that lists them (peft itself only warns about missing keys)."""
    expected = adapter_state_dict(model, adapter_name, clone=False)
    if strict:
        missing = sorted(set(expected) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(expected))
        shapes = sorted(
            f"{k}: checkpoint {tuple(state_dict[k].shape)} vs model {tuple(expected[k].shape)}"
            for k in set(expected) & set(state_dict)
            if tuple(state_dict[k].shape) != tuple(expected[k].shape)
        )
        if missing or unexpected or shapes:
            raise ValueError(
                f"adapter state dict does not match adapter '{adapter_name}' of this model "
                f"(different base model or adapter config?): {len(missing)} missing {missing[:5]}, "
                f"{len(unexpected)} unexpected {unexpected[:5]}, {len(shapes)} shape mismatches {shapes[:5]}"
            )
    set_peft_model_state_dict(model, state_dict, adapter_name=adapter_name)


def load_adapter(base_model: nn.Module, path: str, adapter_name: str = "default", is_trainable: bool = False,
                 **kwargs) -> PeftModel:
    """``PeftModel.from_pretrained`` plus a strict check of the saved weights against the injected adapter (clear
    ValueError on a base-model/shape mismatch instead of torch's size-mismatch RuntimeError or peft's warning)."""
    from safetensors.torch import load_file

    try:
        model = PeftModel.from_pretrained(base_model, path, adapter_name=adapter_name, is_trainable=is_trainable,
                                          **kwargs)
    except RuntimeError as e:
        if "size mismatch" in str(e):
            raise ValueError(f"adapter at {path} does not fit this base model: {e}") from e
        raise
    file = os.path.join(path, "adapter_model.safetensors")
    if os.path.exists(file):
        load_adapter_state_dict(model, load_file(file), adapter_name=adapter_name, strict=True)
    return model


def eval_frozen_norms(model: nn.Module) -> nn.Module:
    """Put every BatchNorm without trainable parameters (pretrained BNs, the frozen shortcut/downsample BNs) in eval
    mode, so its running statistics stay the pretrained ones (PerAda spec ambiguity 12: the original code lets frozen
    downsample BNs drift locally; we recommend calling this after ``model.train()``)."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            if not any(p.requires_grad for p in m.parameters(recurse=False)):
                m.eval()
    return model


# --------------------------------------------------------------------------------------------------------------------
# merging
# --------------------------------------------------------------------------------------------------------------------
def merge_parallel_adapters(model: PeftModel, adapter_name: Optional[str] = None) -> nn.Module:
    """Fold the (active or named) parallel adapter into the kxk kernel centres and its BN copies into the units,
    return the plain base-architecture model (same parameter count as the base).  Exact in train and eval mode."""
    if not isinstance(model, PeftModel) or not isinstance(model.base_model, ParallelAdapterModel):
        raise ValueError("merge_parallel_adapters needs a PeftModel with a ParallelAdapterConfig adapter")
    names = [adapter_name] if adapter_name else None
    return model.merge_and_unload(adapter_names=names)


# --------------------------------------------------------------------------------------------------------------------
# parameter accounting
# --------------------------------------------------------------------------------------------------------------------
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
    slightly from the spec's; ``rebuffi_resnet26_counts`` gives the exact reference-model numbers."""
    from transformers import ResNetConfig

    def w(c):
        return max(1, int(round(c * width)))

    return ResNetConfig(embedding_size=w(32), hidden_sizes=[w(64), w(128), w(256)], depths=[4, 4, 4],
                        layer_type="basic", downsample_in_first_stage=True, num_labels=num_labels, **kwargs)


def rebuffi_resnet26_counts(num_labels: int = 10, width: float = 1.0, in_channels: int = 3) -> dict:
    """Exact parameter/float counts of Rebuffi et al.'s ResNet-26 (``ResNet(BasicBlock, [4,4,4])``: stem
    conv_task(3->32), stages 64/128/256 x 4 blocks, parameter-free shortcuts, final BN + Linear) with one parallel
    1x1 adapter per 3x3 conv (25).  Reproduces spec A2.6 / A8 (10 classes: base convs 5,806,944, adapters 645,216,
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


def count_parameters(model_or_config, adapter_config: Optional[PeftConfig] = None,
                     adapter_name: str = "default") -> dict:
    """Parameter accounting without allocating weights (everything is built on the meta device).

    ``model_or_config``: a transformers config (built with ``AutoModelForImageClassification.from_config``), a plain
    model (its config is rebuilt on meta; the model is not touched) or a ``PeftModel`` (counted as is; then
    ``adapter_config`` must be None).  Returns

    * ``base``: parameters of the plain base model;
    * ``total``: base + parameters the adapter *adds* (adapter convs/BNs, LoRA A/B) = the paper's "base + adapters";
      per-adapter copies of pretrained modules (BN copies, head copy) replace their originals and are not added;
    * ``trainable``: parameters with ``requires_grad`` (one adapter active);
    * ``communicated``: parameters of the adapter state dict that travels (= trainable for these methods);
    * ``communicated_buffers``: float BN running statistics travelling with it;
    * ``payload_floats`` = communicated + communicated_buffers;  ``full_state_floats``: base params + base BN stats
      (what full fine-tuning sends); ``trainable_ratio`` = base/trainable; ``payload_ratio`` = full_state/payload;
      ``trainable_fraction`` = trainable/base.
    """
    from transformers import AutoModelForImageClassification, PretrainedConfig

    if isinstance(model_or_config, PeftModel):
        if adapter_config is not None:
            raise ValueError("count_parameters: pass adapter_config=None for a PeftModel")
        model = model_or_config
        base_model = None
    else:
        if isinstance(model_or_config, PretrainedConfig):
            cfg = model_or_config
        elif hasattr(model_or_config, "config"):
            cfg = model_or_config.config
        else:
            raise TypeError("count_parameters expects a transformers config, a transformers model or a PeftModel")
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
            model = get_peft_model(base_model, copy.deepcopy(adapter_config), adapter_name=adapter_name)
        inner = model.get_base_model()
        added = sum(p.numel() for n, p in inner.named_parameters() if is_added_key(n))
        base = _count_base(inner)
        base_stats = _count_base(inner, buffers=True)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        sd = get_peft_model_state_dict(model, adapter_name=adapter_name)
        buffers = _buffer_suffixes()
        communicated = sum(v.numel() for k, v in sd.items() if not k.endswith(buffers))
        comm_buffers = sum(v.numel() for k, v in sd.items() if k.endswith(buffers) and v.is_floating_point())
    payload = communicated + comm_buffers
    full_state = base + base_stats
    return dict(
        base=base, total=base + added, trainable=trainable, communicated=communicated,
        communicated_buffers=comm_buffers, payload_floats=payload, full_state_floats=full_state,
        trainable_ratio=base / trainable if trainable else float("inf"),
        payload_ratio=full_state / payload if payload else float("inf"),
        trainable_fraction=trainable / base,
    )


def _count_base(inner: nn.Module, buffers: bool = False) -> int:
    """Count the base model's own parameters (or float buffers) inside a peft-wrapped model: skip adapter containers
    and the per-adapter copies held by ModulesToSaveWrapper (keep its ``original_module``)."""
    total = 0
    seen = set()
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
