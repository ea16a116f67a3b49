"""Adapters on frozen pretrained backbones, laid out like a peft tuner: ``config`` (dataclasses), ``layer`` (the
modules injected into the backbone), ``model`` (injection, named adapter slots, merging), ``io`` (what travels,
state dicts, save/load folders) and ``accounting`` (parameter counts).

* **LoRA** (ViT, and convs): stock peft (``peft.LoraConfig`` / ``get_peft_model``); such adapters save and load with
  plain peft, no hfpfl needed: ``PeftModel.from_pretrained(base, repo_id, revision="round-3")``.
* **Residual adapters** (PerAda) and **parallel adapters** (Elvebakken et al.): plain-torch layers with their own
  ``save_pretrained`` / ``from_pretrained`` -- peft is not patched (no new ``PeftType`` members, no private tuner
  overrides). Load a saved one with ``ConvAdapterModel.from_pretrained(base, repo_id, revision="round-3")``.

Both kinds share one surface (``peft_config``, ``add_adapter``, ``set_adapter``, ``save_pretrained``), so PerAda's
two slots (global ``default`` and ``personal``) work on either; :func:`adapter_state_dict` / :func:`travel_keys`
give the name-free dict that travels, for either.
"""
from .accounting import count_parameters, rebuffi_resnet26_counts, resnet18_config, resnet26_like_config
from .config import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    ConvAdapterConfig,
    ParallelAdapterConfig,
    ResidualAdapterConfig,
    vit_lora_config,
)
from .auto import load_adapter
from .io import (
    ADAPTER_KEY_PREFIXES,
    adapter_state_dict,
    is_adapter_key,
    is_added_key,
    is_head_key,
    is_norm_key,
    load_adapter_state_dict,
    trainable_keys,
    travel_keys,
)
from .layer import ConvUnitAdapterLayer, ModulesToSave, ParallelAdapterLayer, ResidualAdapterLayer
from .model import ConvAdapterModel, conv_units, eval_frozen_norms, get_adapter_model, is_adapter_model


def merge_parallel_adapters(model: ConvAdapterModel, adapter_name=None):
    """Fold the (active or named) parallel adapter into the kxk kernel centres and its BN copies into the units;
    returns the plain base-architecture model (same parameter count as the base). Exact in train and eval mode."""
    if not isinstance(model, ConvAdapterModel) or model.kind != "parallel":
        raise ValueError("merge_parallel_adapters needs a ConvAdapterModel with a ParallelAdapterConfig adapter")
    return model.merge_and_unload(adapter_name)


def make_adapter_model(model, kind: str, lora_r: int = 4):
    """Freeze ``model`` and add adapter kind ``kind`` (``lora`` | ``residual`` | ``parallel``; ``none`` returns the
    model unchanged): what ``--adapter`` does in the engine."""
    if kind in (None, "none"):
        return model
    if kind == "lora":
        from ..lora import add_lora

        return add_lora(model, r=lora_r)
    if kind == "residual":
        return get_adapter_model(model, ResidualAdapterConfig())
    if kind == "parallel":
        return get_adapter_model(model, ParallelAdapterConfig())
    raise ValueError(f"unknown adapter kind {kind!r}; expected none, lora, residual or parallel")


__all__ = [
    "CONFIG_NAME", "WEIGHTS_NAME", "ADAPTER_KEY_PREFIXES",
    "ConvAdapterConfig", "ResidualAdapterConfig", "ParallelAdapterConfig", "vit_lora_config",
    "ConvUnitAdapterLayer", "ResidualAdapterLayer", "ParallelAdapterLayer", "ModulesToSave",
    "ConvAdapterModel", "get_adapter_model", "is_adapter_model", "make_adapter_model", "conv_units",
    "eval_frozen_norms", "merge_parallel_adapters",
    "is_adapter_key", "is_added_key", "is_head_key", "is_norm_key", "trainable_keys", "travel_keys",
    "adapter_state_dict", "load_adapter_state_dict", "load_adapter",
    "count_parameters", "rebuffi_resnet26_counts", "resnet18_config", "resnet26_like_config",
]
