"""The adapter model (the ``model.py`` of a peft-style tuner): injects residual/parallel adapter layers into a
transformers ResNet, holds several named adapters (one active), and saves/loads them by itself -- no peft internals.

>>> model = get_adapter_model(AutoModelForImageClassification.from_pretrained("hfpfl/tiny-resnet-ood", num_labels=10,
...                                                                         ignore_mismatched_sizes=True),
...                           ResidualAdapterConfig())
>>> model.save_pretrained("out")                                    # hfpfl_adapter_config.json + safetensors
>>> ConvAdapterModel.from_pretrained(base, "out")                   # or a Hub id + revision="round-3"

The surface mirrors ``peft.PeftModel`` where PerAda and the engine need it: ``peft_config`` (dict of configs by
adapter name), ``add_adapter``, ``set_adapter``, ``active_adapter``, ``disable_adapter()``, ``load_adapter``,
``merge_and_unload``, ``get_base_model``, ``save_pretrained(selected_adapters=...)``.

BatchNorm name mapping (torchvision / PerAda code name -> transformers name):

* stem ``bn1``              -> ``resnet.embedder.embedder.normalization`` (trained copy ``...embedder.embedder.radapter_norm``)
* block ``layerS.B.bn1``    -> ``resnet.encoder.stages.{S-1}.layers.B.layer.0.normalization`` (copy ``...layer.0.radapter_norm``)
* block ``layerS.B.bn2``    -> ``resnet.encoder.stages.{S-1}.layers.B.layer.1.normalization`` (copy ``...layer.1.radapter_norm``)
* ``layerS.0.downsample.1`` -> ``resnet.encoder.stages.{S-1}.layers.0.shortcut.normalization`` (frozen, never travels)
* ``fc``                    -> ``classifier.1`` (trained copy ``classifier.modules_to_save.<adapter>.1``)
"""
from __future__ import annotations

import contextlib
import copy
import re
from typing import Iterator, Optional

from torch import nn

from .config import ConvAdapterConfig, ParallelAdapterConfig, ResidualAdapterConfig
from .layer import LAYER_CLASSES, AdapterLayerMixin, ConvUnitAdapterLayer, ModulesToSave, is_conv_unit

# transformers ResNet module names (basic and bottleneck blocks: ``...stages.N.layers.M.layer.K``; stem:
# ``...embedder.embedder``); regexes are matched with re.fullmatch.
_BLOCK_CONVS = r"(.*\.)?layers\.\d+\.layer\.\d+"
_STEM_CONV = r"(.*\.)?embedder\.embedder"
DEFAULT_TARGETS = {"residual": _BLOCK_CONVS, "parallel": rf"({_BLOCK_CONVS}|{_STEM_CONV})"}
DEFAULT_NORMS = {"residual": _STEM_CONV, "parallel": []}

_SIGNATURE_FIELDS = ("model_type", "num_channels", "embedding_size", "hidden_sizes", "depths", "layer_type",
                     "hidden_size", "num_hidden_layers", "image_size", "patch_size", "num_labels")


def model_signature(model: nn.Module) -> Optional[dict]:
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


def conv_units(model: nn.Module) -> list[str]:
    """Names of all conv units (modules with .convolution Conv2d + .normalization BatchNorm2d) of a model; already
    wrapped units are listed by their wrapper's name."""
    names, inner = [], set()
    for name, m in model.named_modules():
        if isinstance(m, ConvUnitAdapterLayer):
            names.append(name)
            inner.add(name + ".base_layer")
        elif is_conv_unit(m) and name not in inner:
            names.append(name)
    return names


def _unit_of(module: nn.Module) -> nn.Module:
    return module.base_layer if isinstance(module, ConvUnitAdapterLayer) else module


def eval_frozen_norms(model: nn.Module) -> nn.Module:
    """Put every BatchNorm without trainable parameters (pretrained BNs, the frozen shortcut/downsample BNs, inactive
    adapters' copies) in eval mode, so its running statistics stay put (PerAda spec ambiguity 12: the original code
    lets frozen downsample BNs drift locally)."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            if not any(p.requires_grad for p in m.parameters(recurse=False)):
                m.eval()
    return model


class ConvAdapterModel(nn.Module):
    """A frozen base model with named residual/parallel adapters; see the module docstring."""

    def __init__(self, base_model: nn.Module, config: ConvAdapterConfig, adapter_name: str = "default"):
        super().__init__()
        self.base_model = base_model
        self.peft_config: dict[str, ConvAdapterConfig] = {}  # peft's attribute name, so code can handle both
        self.active_adapter: Optional[str] = None
        for p in self.base_model.parameters():
            p.requires_grad_(False)
        self.add_adapter(adapter_name, config)
        self.set_adapter(adapter_name)

    # ------------------------------------------------------------------ injection
    @property
    def kind(self) -> str:
        return next(iter(self.peft_config.values())).kind

    @property
    def config(self):
        return self.base_model.config

    def get_base_model(self) -> nn.Module:
        return self.base_model

    def _resolve(self, config: ConvAdapterConfig) -> tuple[list[str], list[str]]:
        """(units that get an adapter, units that only get a trainable BN copy); fills the config's defaults."""
        model = self.base_model
        kind = config.kind
        units = conv_units(model)
        if config.target_modules is None:
            config.target_modules = DEFAULT_TARGETS[kind]
            if kind == "parallel":  # bottleneck ResNets: the default also hits their 1x1 convs, which it cannot adapt
                hits = [n for n in units if re.fullmatch(config.target_modules, n)]
                kxk = [n for n in hits if _unit_of(model.get_submodule(n)).convolution.kernel_size[0] > 1]
                if hits and len(kxk) < len(hits):
                    config.target_modules = kxk
        if config.norm_modules is None:
            config.norm_modules = DEFAULT_NORMS[kind]
        sig = model_signature(model)
        if config.base_model_signature is None:
            config.base_model_signature = sig
        elif sig is not None and dict(config.base_model_signature) != sig:
            raise ValueError(
                f"{type(config).__name__} was created for a base model with {config.base_model_signature}, but this "
                f"model has {sig}. Load the adapter onto the base model it was trained on."
            )
        if config.base_model_name_or_path is None:
            config.base_model_name_or_path = getattr(getattr(model, "config", None), "_name_or_path", None) or None
        unit_set = set(units)
        targets, norms, bad = [], [], []
        mts = config.modules_to_save or []
        for name, _ in model.named_modules():
            if not name or ".base_layer" in f".{name}" or name.endswith(".base_layer"):
                continue
            if any(re.match(rf"(^|.*\.){re.escape(m)}($|\..*)", name) for m in mts):
                continue
            if _matches(config.exclude_modules, name):
                continue
            if _matches(config.target_modules, name):
                (targets if name in unit_set else bad).append(name)
            elif _matches(config.norm_modules, name) and name in unit_set:
                norms.append(name)
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
        return targets, norms

    def add_adapter(self, adapter_name: str, config: ConvAdapterConfig) -> None:
        """Add adapter slot ``adapter_name`` (inactive unless it is the first). All adapters of one model must be of
        one kind (they wrap the same units)."""
        if adapter_name in self.peft_config:
            raise ValueError(f"adapter {adapter_name!r} already exists")
        if "." in adapter_name or not adapter_name:
            raise ValueError(f"adapter name must be a non-empty string without '.', got {adapter_name!r}")
        if not isinstance(config, ConvAdapterConfig):
            raise TypeError(f"expected a ResidualAdapterConfig or ParallelAdapterConfig, got {type(config).__name__}")
        if self.peft_config and config.kind != self.kind:
            raise ValueError(f"this model holds {self.kind} adapters; cannot add a {config.kind} adapter")
        config = copy.deepcopy(config)
        targets, norms = self._resolve(config)
        layer_cls = LAYER_CLASSES[config.kind]
        for name in targets + norms:
            module = self.base_model.get_submodule(name)
            if not isinstance(module, layer_cls):
                if isinstance(module, ConvUnitAdapterLayer):
                    raise ValueError(f"{name} is already wrapped by {type(module).__name__}")
                wrapper = layer_cls(module)
                self._replace(name, wrapper)
                module = wrapper
            module.update_layer(adapter_name, config, with_adapter=name in targets)
        for mname in config.modules_to_save or []:
            for name, module in list(self.base_model.named_modules()):
                if name == mname or name.endswith("." + mname):
                    if not isinstance(module, ModulesToSave):
                        if ".original_module" in name or ".modules_to_save" in name:
                            continue
                        module = ModulesToSave(module)
                        self._replace(name, module)
                    module.update_layer(adapter_name)
        self.peft_config[adapter_name] = config
        self.set_adapter(self.active_adapter or adapter_name)

    def _replace(self, name: str, new: nn.Module) -> None:
        parent_name, _, child = name.rpartition(".")
        parent = self.base_model.get_submodule(parent_name) if parent_name else self.base_model
        setattr(parent, child, new)

    def _layers(self) -> Iterator[AdapterLayerMixin]:
        return (m for m in self.base_model.modules() if isinstance(m, AdapterLayerMixin))

    def set_adapter(self, adapter_name: str) -> None:
        """Make ``adapter_name`` the one adapter in the forward pass; only its parameters require grad."""
        if adapter_name not in self.peft_config:
            raise ValueError(f"unknown adapter {adapter_name!r}; this model has {sorted(self.peft_config)}")
        self.active_adapter = adapter_name
        for layer in self._layers():
            layer.set_adapter(adapter_name)
            if isinstance(layer, ConvUnitAdapterLayer):
                layer.base_layer.requires_grad_(False)
            if isinstance(layer, ModulesToSave):
                layer.original_module.requires_grad_(False)
        if self.peft_config[adapter_name].inference_mode:
            for layer in self._layers():
                for c in layer.adapter_layer_names:
                    if adapter_name in getattr(layer, c):
                        getattr(layer, c)[adapter_name].requires_grad_(False)
        if self.training:
            self.train()

    @property
    def active_adapters(self) -> list[str]:
        return [self.active_adapter] if self.active_adapter else []

    def delete_adapter(self, adapter_name: str) -> None:
        if adapter_name not in self.peft_config:
            raise ValueError(f"unknown adapter {adapter_name!r}")
        for layer in self._layers():
            layer.delete_adapter(adapter_name)
        del self.peft_config[adapter_name]
        if self.active_adapter == adapter_name:
            self.active_adapter = None
            if self.peft_config:
                self.set_adapter(next(iter(self.peft_config)))

    @contextlib.contextmanager
    def disable_adapter(self):
        """The plain pretrained network inside the block."""
        layers = list(self._layers())
        for layer in layers:
            layer.disabled = True
        try:
            yield
        finally:
            for layer in layers:
                layer.disabled = False

    # ------------------------------------------------------------------ running
    def forward(self, *args, **kwargs):
        return self.base_model(*args, **kwargs)

    def train(self, mode: bool = True):
        super().train(mode)
        if mode and self.active_adapter and self.peft_config[self.active_adapter].frozen_norms_eval:
            eval_frozen_norms(self.base_model)
        return self

    # ------------------------------------------------------------------ merging
    def merge_and_unload(self, adapter_name: Optional[str] = None, safe_merge: bool = False) -> nn.Module:
        """Fold adapter ``adapter_name`` (default: the active one) into the base convs/BNs and return the plain
        base-architecture model (same parameter count as the base). Exact for parallel adapters (train and eval);
        eval-mode exact for residual adapters (their inner BN uses running statistics)."""
        name = adapter_name or self.active_adapter
        if name not in self.peft_config:
            raise ValueError(f"unknown adapter {name!r}")
        for mod_name, module in list(self.base_model.named_modules()):
            if isinstance(module, ConvUnitAdapterLayer):
                if name in module._conv_dict() or name in module._norm_dict():
                    module.merge(name, safe_merge=safe_merge)
                    module._merge_cache.clear()
                    module.merged_adapters.clear()
                self._replace(mod_name, module.base_layer)
            elif isinstance(module, ModulesToSave):
                keep = module.modules_to_save[name] if name in module.modules_to_save else module.original_module
                self._replace(mod_name, keep)
        base = self.base_model
        for p in base.parameters():
            p.requires_grad_(True)
        return base

    # ------------------------------------------------------------------ I/O (see .io)
    def save_pretrained(self, save_directory, selected_adapters: Optional[list[str]] = None, **kwargs) -> None:
        from .io import save_adapters

        save_adapters(self, save_directory, selected_adapters=selected_adapters)

    @classmethod
    def from_pretrained(cls, base_model: nn.Module, name_or_path, adapter_name: str = "default",
                        revision: Optional[str] = None, cache_dir=None, is_trainable: bool = False,
                        subfolder: Optional[str] = None) -> "ConvAdapterModel":
        """Load a saved adapter (local folder, or Hub id + ``revision`` from the local cache / Hub) onto
        ``base_model``. The one public call a user needs for residual/parallel adapters."""
        from .io import load_adapter_folder, resolve_adapter_folder

        folder = resolve_adapter_folder(name_or_path, revision=revision, cache_dir=cache_dir, subfolder=subfolder)
        config = ConvAdapterConfig.from_pretrained(folder)
        config.inference_mode = not is_trainable
        model = cls(base_model, config, adapter_name=adapter_name)
        load_adapter_folder(model, folder, adapter_name)
        if not is_trainable:
            model.eval()
        return model

    def load_adapter(self, name_or_path, adapter_name: str, revision: Optional[str] = None, cache_dir=None,
                     is_trainable: bool = False) -> None:
        from .io import load_adapter_folder, resolve_adapter_folder

        folder = resolve_adapter_folder(name_or_path, revision=revision, cache_dir=cache_dir)
        config = ConvAdapterConfig.from_pretrained(folder)
        config.inference_mode = not is_trainable
        self.add_adapter(adapter_name, config)
        load_adapter_folder(self, folder, adapter_name)


def get_adapter_model(model: nn.Module, config: ConvAdapterConfig, adapter_name: str = "default") -> ConvAdapterModel:
    """``peft.get_peft_model`` for residual/parallel adapters: freeze ``model`` and inject adapter ``adapter_name``."""
    return ConvAdapterModel(model, config, adapter_name=adapter_name)


def is_adapter_model(model) -> bool:
    """A model with named adapter slots: a :class:`ConvAdapterModel` or a ``peft.PeftModel`` (LoRA)."""
    if isinstance(model, ConvAdapterModel):
        return True
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, PeftModel)


__all__ = ["ConvAdapterModel", "get_adapter_model", "is_adapter_model", "conv_units", "eval_frozen_norms",
           "model_signature", "ResidualAdapterConfig", "ParallelAdapterConfig"]
