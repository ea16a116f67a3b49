"""FedDAT's shared adapter A_s as a folder that loads without hfpfl, in the one call::

    AutoModelForVisualQuestionAnswering.from_pretrained(folder_or_repo_id, trust_remote_code=True)

The folder holds the adapter only (``shared_adapter.safetensors``), the backbone's ``config.json`` extended with
``shared_adapter`` (the backbone checkpoint and the commit it was at, the modules whose outputs get an adapter, their
widths, the bottleneck width) and ``auto_map``, and the few lines of modeling code that attach the adapters
(:mod:`hfpfl.models.vqa_remote_code`, copied as ``modeling_shared_adapter.py``). ``hfpfl.hub.push_folder_to_cache``
publishes such a folder under a repo id like any other.
"""
from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

import torch

REMOTE_CODE_FILE = "modeling_shared_adapter.py"


def _base_reference(backbone, base_model_name_or_path, base_revision):
    base = base_model_name_or_path or getattr(backbone, "name_or_path", "") or ""
    if not base:
        raise ValueError("the VQA backbone was built from a config, not loaded from a checkpoint, so the shared "
                         "adapter has no backbone to name: pass base_model_name_or_path (a saved backbone folder or "
                         "Hub id)")
    if base_revision is None and not os.path.isdir(base):
        from .. import hub
        try:  # the commit the cached backbone is at: a later republication of 'main' cannot change what loads
            base_revision = Path(hub.require_cached(base)).name
        except (OSError, ValueError):
            base_revision = None
    return (os.path.abspath(base) if os.path.isdir(base) else base), base_revision


def save_shared_adapter(model, folder, shared_state: dict[str, torch.Tensor] | None = None,
                        base_model_name_or_path: str | None = None, base_revision: str | None = None) -> str:
    """Write the shared adapter A_s of ``model`` (a :class:`hfpfl.models.vqa.VQAModel` with ``peft="adapter"``) to
    ``folder``; returns the folder. ``shared_state``: A_s as VQAModel state-dict entries
    (``adapters.<i>.shared.{down,up}.{weight,bias}``, e.g. the server's global part) instead of the model's own.
    The backbone is named, not copied: ``base_model_name_or_path`` (default: the checkpoint the backbone was loaded
    from) at ``base_revision`` (default: the commit of its cached snapshot)."""
    from . import vqa_remote_code
    from .vqa_model import _adapter_sites

    if getattr(model, "peft", None) != "adapter" or not len(model.adapters):
        raise ValueError("save_shared_adapter needs a VQAModel with bottleneck adapters (peft='adapter')")
    backbone = model.backbone
    kind = backbone.config.model_type
    if kind not in vqa_remote_code.MODEL_CLASSES:
        raise ValueError(f"no shared-adapter model class for backbone type {kind!r}")
    base, revision = _base_reference(backbone, base_model_name_or_path, base_revision)
    names = {id(m): n for n, m in backbone.named_modules()}
    sites = _adapter_sites(backbone)
    weights = {}
    for i, slot in enumerate(model.adapters):
        for k, v in slot.shared.state_dict().items():
            src = f"adapters.{i}.shared.{k}"
            value = shared_state[src] if shared_state is not None else v
            weights[f"{i}.{k}"] = value.detach().cpu().contiguous().clone()
    cls = vqa_remote_code.MODEL_CLASSES[kind]
    config = copy.deepcopy(backbone.config)
    config.shared_adapter = {"base_model_name_or_path": base, "base_revision": revision,
                             "sites": [names[id(m)] for m, _ in sites], "hidden_sizes": [d for _, d in sites],
                             "r": model.adapters[0].shared.down.out_features}
    config.architectures = [cls.__name__]
    config.auto_map = {"AutoModelForVisualQuestionAnswering": f"{REMOTE_CODE_FILE[:-3]}.{cls.__name__}"}
    os.makedirs(folder, exist_ok=True)
    config.save_pretrained(folder)
    shutil.copyfile(vqa_remote_code.__file__, os.path.join(folder, REMOTE_CODE_FILE))
    from safetensors.torch import save_file
    save_file(weights, os.path.join(folder, vqa_remote_code.ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(folder, "README.md"), "w") as f:
        f.write(_card(base, revision, cls.__name__))
    return str(folder)


def _card(base, revision, cls_name) -> str:
    return (
        "---\nlibrary_name: transformers\ntags: [hfpfl, feddat, adapter, visual-question-answering]\n---\n"
        "# FedDAT shared adapter\n\n"
        "The shared adapter A_s of FedDAT (Chen et al., AAAI 2024, Eq. 1: one bottleneck adapter per transformer "
        f"block) on the frozen `{base}`" + (f" (commit `{revision}`)" if revision else "") + ". The folder holds "
        "the adapter only; the backbone and its head come from that checkpoint (FedDAT's client heads are private).\n\n"
        "```python\nfrom transformers import AutoModelForVisualQuestionAnswering\n"
        "model = AutoModelForVisualQuestionAnswering.from_pretrained(\"<this folder or repo>\", "
        f"trust_remote_code=True)  # {cls_name}\n```\n"
    )
