"""Adapter state dicts and files: which keys travel, name-free state dicts (one slot's dict loads into any slot),
``save_pretrained`` / ``from_pretrained`` folders for residual/parallel adapters, and the same helpers for peft LoRA.

Saved folder of a residual/parallel adapter (``ConvAdapterModel.save_pretrained``)::

    hfpfl_adapter_config.json          the config (kind, targets, base-model signature, ...)
    hfpfl_adapter_model.safetensors    name-free keys, e.g. ``base_model.resnet.encoder...layer.0.radapter_conv.weight``
    README.md                          how to load it

Loading needs hfpfl (the layers are hfpfl's): ``ConvAdapterModel.from_pretrained(base, repo_id, revision=...)``.
LoRA adapters are saved by peft itself and load with plain peft; :func:`publish_adapter` also publishes the frozen
base with the adapter's head shape beside them, so peft's ``AutoPeftModel.from_pretrained(repo_id, revision=...)``
loads one in one call (:func:`plain_base_model`).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
from torch import nn

from .config import CONFIG_NAME, WEIGHTS_NAME
from .layer import CONTAINER_NAMES

ADAPTER_KEY_PREFIXES = ("radapter_", "padapter_", "lora_")
_BUFFER_SUFFIXES = (".running_mean", ".running_var", ".num_batches_tracked")


# ---------------------------------------------------------------------------------------------------- key filters
def is_adapter_key(name: str) -> bool:
    """True for any state-dict key or parameter name that belongs to an adapter module (``radapter_*``,
    ``padapter_*``, ``lora_*``), including the per-adapter BN copies (``*_norm``)."""
    return any(part.startswith(ADAPTER_KEY_PREFIXES) for part in name.split("."))


def is_norm_key(name: str) -> bool:
    """Per-adapter trainable copies of a pretrained BN (``radapter_norm`` / ``padapter_norm``)."""
    return any(part in ("radapter_norm", "padapter_norm") for part in name.split("."))


def is_added_key(name: str) -> bool:
    """Adapter keys that are *new* parameters (not copies of pretrained modules): adapter convs, adapter BNs, LoRA
    A/B. These are what "base + adapters" adds to the parameter count."""
    return is_adapter_key(name) and not is_norm_key(name)


def is_head_key(name: str) -> bool:
    """Keys of ``modules_to_save`` copies (the classification head) -- in-model or saved (name-free) form."""
    parts = name.split(".")
    return "modules_to_save" in parts or (not is_adapter_key(name) and "classifier" in parts)


def trainable_keys(model: nn.Module) -> set[str]:
    """Names of all parameters with ``requires_grad``: with one active adapter, exactly that adapter's set."""
    return {n for n, p in model.named_parameters() if p.requires_grad}


def _is_peft(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, PeftModel)


# ---------------------------------------------------------------------------------------------------- state dicts
def _strip_name(key: str, adapter_name: str) -> Optional[str]:
    """``...radapter_conv.<adapter_name>.weight`` -> ``...radapter_conv.weight`` and
    ``classifier.modules_to_save.<adapter_name>.1.weight`` -> ``classifier.1.weight`` (peft's saved form); None if
    the key is not of that adapter (another slot, or the frozen base)."""
    parts = key.split(".")
    for i, p in enumerate(parts[:-1]):
        if p in CONTAINER_NAMES:
            if parts[i + 1] != adapter_name:
                return None
            keep = parts[:i] if p == "modules_to_save" else parts[: i + 1]
            return ".".join(keep + parts[i + 2:])
    return None


def _key_map(model, adapter_name: str) -> dict[str, str]:
    """{name-free key: model key} of one adapter of a :class:`ConvAdapterModel`."""
    out = {}
    for k in model.state_dict(keep_vars=True):
        nk = _strip_name(k, adapter_name)
        if nk is not None:
            out[nk] = k
    return out


def adapter_state_dict(model, adapter_name: str = "default", include_buffers: bool = True,
                       clone: bool = True) -> dict[str, torch.Tensor]:
    """What travels for one adapter: keys without the adapter name (a dict from slot "default" loads into slot
    "personal"). BN running statistics are included unless ``include_buffers=False`` -- both papers exchange them.
    Works for a :class:`ConvAdapterModel` and for a peft model (LoRA: ``get_peft_model_state_dict``)."""
    if _is_peft(model):
        from peft.utils import get_peft_model_state_dict

        sd = get_peft_model_state_dict(model, adapter_name=adapter_name)
    else:
        if adapter_name not in getattr(model, "peft_config", {}):
            raise ValueError(f"unknown adapter {adapter_name!r}")
        own = model.state_dict()
        sd = {nk: own[k] for nk, k in _key_map(model, adapter_name).items()}
    if not include_buffers:
        sd = {k: v for k, v in sd.items() if not k.endswith(_BUFFER_SUFFIXES)}
    return {k: (v.detach().clone() if clone else v) for k, v in sd.items()}


def travel_keys(model, adapter_name: str = "default", include_buffers: bool = True) -> set[str]:
    """The (name-free) keys of :func:`adapter_state_dict`: adapter convs/BNs, per-adapter BN copies (+ running
    stats) and the head. Nothing of the frozen backbone."""
    return set(adapter_state_dict(model, adapter_name, include_buffers=include_buffers, clone=False))


def load_adapter_state_dict(model, state_dict: dict[str, torch.Tensor], adapter_name: str = "default",
                            strict: bool = True) -> None:
    """Load a name-free adapter state dict into slot ``adapter_name``. With ``strict`` any missing/unexpected key or
    shape mismatch raises a ValueError that lists them."""
    expected = adapter_state_dict(model, adapter_name, clone=False)
    if strict:
        missing = sorted(set(expected) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(expected))
        shapes = sorted(
            f"{k}: checkpoint {tuple(state_dict[k].shape)} vs model {tuple(expected[k].shape)}"
            for k in set(expected) & set(state_dict) if tuple(state_dict[k].shape) != tuple(expected[k].shape)
        )
        if missing or unexpected or shapes:
            raise ValueError(
                f"adapter state dict does not match adapter '{adapter_name}' of this model "
                f"(different base model or adapter config?): {len(missing)} missing {missing[:5]}, "
                f"{len(unexpected)} unexpected {unexpected[:5]}, {len(shapes)} shape mismatches {shapes[:5]}"
            )
    if _is_peft(model):
        from peft.utils import set_peft_model_state_dict

        set_peft_model_state_dict(model, state_dict, adapter_name=adapter_name)
        return
    own = model.state_dict()
    keys = _key_map(model, adapter_name)
    with torch.no_grad():
        for k, v in state_dict.items():
            if k in keys:
                own[keys[k]].copy_(v)


# ---------------------------------------------------------------------------------------------------- folders
def _card(model, names: list[str]) -> str:
    cfg = model.peft_config[names[0]]
    base = cfg.base_model_name_or_path or "<the base model>"
    return (
        f"---\nlibrary_name: hfpfl\ntags: [hfpfl, {cfg.kind}-adapter]\n---\n# {cfg.kind} adapter\n\n"
        f"A {cfg.kind} adapter (hfpfl) for `{base}`: adapter convs, per-adapter BatchNorm copies and the head.\n\n"
        "Load it (hfpfl's layers; `peft.PeftModel.from_pretrained` does not know this kind):\n\n```python\n"
        "from transformers import AutoModelForImageClassification\n"
        "from hfpfl.models.adapters import ConvAdapterModel\n"
        f"base = AutoModelForImageClassification.from_pretrained(\"{base}\", num_labels=N, "
        "ignore_mismatched_sizes=True)\n"
        "model = ConvAdapterModel.from_pretrained(base, \"<this repo or folder>\", revision=\"main\")\n```\n"
    )


def save_adapters(model, save_directory, selected_adapters: Optional[list[str]] = None) -> None:
    """Save adapters of a :class:`ConvAdapterModel`: the first (or only) selected one at the top of the folder,
    any other one in a subfolder named after it (peft's layout)."""
    from safetensors.torch import save_file

    names = list(selected_adapters) if selected_adapters else list(model.peft_config)
    unknown = [n for n in names if n not in model.peft_config]
    if unknown:
        raise ValueError(f"unknown adapters {unknown}; this model has {sorted(model.peft_config)}")
    for i, name in enumerate(names):
        folder = str(save_directory) if i == 0 else os.path.join(save_directory, name)
        os.makedirs(folder, exist_ok=True)
        cfg = model.peft_config[name]
        cfg.save_pretrained(folder)
        sd = {k: v.contiguous() for k, v in adapter_state_dict(model, name).items()}
        save_file(sd, os.path.join(folder, WEIGHTS_NAME), metadata={"format": "pt", "library": "hfpfl",
                                                                   "adapter_kind": cfg.kind})
        with open(os.path.join(folder, "README.md"), "w") as f:
            f.write(_card(model, [name]))


def resolve_adapter_folder(name_or_path, revision: Optional[str] = None, cache_dir=None,
                           subfolder: Optional[str] = None) -> str:
    """A local folder, or a Hub repo id (+ revision) resolved through the local cache (offline: fail fast if not
    cached) or downloaded (online)."""
    path = str(name_or_path)
    if os.path.isdir(path):
        folder = path
    else:
        from ... import hub

        hub.validate_repo_id(path)
        if hub.is_offline():
            folder = str(hub.require_cached(path, "model", revision or "main", cache_dir))
        else:  # pragma: no cover - needs a Hub endpoint
            from huggingface_hub import snapshot_download

            folder = snapshot_download(path, revision=revision, cache_dir=cache_dir,
                                       allow_patterns=[CONFIG_NAME, WEIGHTS_NAME, "*/" + CONFIG_NAME,
                                                       "*/" + WEIGHTS_NAME])
    if subfolder:
        folder = os.path.join(folder, subfolder)
    return folder


def load_adapter_folder(model, folder: str, adapter_name: str) -> None:
    from safetensors.torch import load_file

    file = os.path.join(folder, WEIGHTS_NAME)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no {WEIGHTS_NAME} in {folder}")
    load_adapter_state_dict(model, load_file(file), adapter_name=adapter_name, strict=True)


# ---------------------------------------------------------------------------------------------------- publishing
#: the branch of an adapter repo that holds the frozen base the repo's peft adapters were trained on
BASE_REVISION = "base"


def plain_base_model(peft_model):
    """The frozen base of a peft model as the plain transformers model it was before the adapters: LoRA-wrapped
    layers unwrapped (``.base_layer``), ``modules_to_save`` wrappers replaced by their original module (the head as
    it was before training: the adapter carries its trained copy) -- with the head shape the adapter was trained on,
    which the checkpoint the base came from may not have (the stand-ins' 93-class pretraining head). Built without
    drawing from the random streams (a publication mid-run must not shift the run), loaded strictly."""
    import copy

    base = peft_model.get_base_model()
    state = {}
    for key, value in base.state_dict().items():
        parts = key.split(".")
        if any(p.startswith("lora_") for p in parts) or "modules_to_save" in parts:
            continue
        state[".".join(p for p in parts if p not in ("base_layer", "original_module"))] = value.detach().cpu()
    with torch.random.fork_rng(devices=[]):
        plain = type(base)(copy.deepcopy(base.config))
    plain.load_state_dict(state, strict=True)
    return plain.eval()


def publish_adapter(model, repo_id: str, revisions, adapter_name: str = "default", cache_dir=None) -> str:
    """Save adapter ``adapter_name`` of ``model`` and publish it as each of ``revisions`` of ``repo_id`` in the local
    Hub cache; returns the snapshot of the first revision.

    A peft (LoRA) adapter is made loadable with peft's one generic call, no hfpfl import::

        AutoPeftModel.from_pretrained(repo_id, revision="round-3")

    ``AutoPeftModel`` builds the base from the adapter config's ``base_model_name_or_path`` at its ``revision`` with
    the class in ``auto_mapping`` (peft writes it: e.g. ``ResNetForImageClassification`` of ``transformers``). The
    backbone's own checkpoint has its pretraining head (the stand-ins: 93 classes), so the config points instead at
    :func:`plain_base_model` -- the same frozen backbone with the head shape the adapter was trained on -- published
    on this repo's ``base`` branch and referenced by its commit (content addressed: a later base published to the
    branch never changes what an earlier revision loads). peft's model card keeps the backbone's id
    (``base_model:``). A residual/parallel adapter (hfpfl's layers) is saved as it is:
    ``ConvAdapterModel.from_pretrained(base, repo_id, revision=...)``."""
    import json
    import tempfile

    from ... import hub

    revisions = [revisions] if isinstance(revisions, str) else list(revisions)
    if not revisions:
        raise ValueError("publish_adapter needs at least one revision")
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "adapter")
        model.save_pretrained(folder, selected_adapters=[adapter_name])
        if _is_peft(model):
            if adapter_name != "default":  # peft saves a named adapter in a subfolder of that name
                folder = os.path.join(folder, adapter_name)
            base_dir = os.path.join(tmp, "base")
            plain_base_model(model).save_pretrained(base_dir)
            base_snapshot = hub.push_folder_to_cache(base_dir, repo_id, BASE_REVISION, cache_dir=cache_dir)
            config_file = os.path.join(folder, "adapter_config.json")
            with open(config_file) as f:
                config = json.load(f)
            if not config.get("auto_mapping") or config.get("task_type") is not None:
                raise ValueError(f"adapter {adapter_name!r} has no peft auto_mapping (task_type "
                                 f"{config.get('task_type')!r}); AutoPeftModel could not build its base")
            config.update(base_model_name_or_path=repo_id, revision=os.path.basename(base_snapshot))
            with open(config_file, "w") as f:
                json.dump(config, f, indent=2, sort_keys=True)
        snapshots = [hub.push_folder_to_cache(folder, repo_id, r, cache_dir=cache_dir) for r in revisions]
    return snapshots[0]
