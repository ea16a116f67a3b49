"""FedDAT's shared adapter A_s on its frozen VQA backbone, as transformers remote code.

Chen et al., "FedDAT: An Approach for Foundation Model Finetuning in Multi-Modal Heterogeneous Federated Learning"
(AAAI 2024), Eq. 1: one Houlsby bottleneck adapter per transformer block, ``h' = h + ReLU(h W_down + b_down) W_up +
b_up``, added to the output of the block's FFN. hfpfl copies this file, unchanged, into every shared-adapter folder
it writes (as ``modeling_shared_adapter.py``, named in ``config.json``'s ``auto_map``), so that::

    AutoModelForVisualQuestionAnswering.from_pretrained(folder_or_repo_id, trust_remote_code=True)

loads the adapter onto its frozen backbone with nothing but torch and transformers. The folder holds the adapter
only (``shared_adapter.safetensors``); ``config.json`` is the backbone's config plus ``shared_adapter``: the
backbone's checkpoint (``base_model_name_or_path`` at ``base_revision``), the modules whose outputs get an adapter
(``sites``), their widths and the bottleneck width ``r``. The head is the backbone checkpoint's: FedDAT's client
heads are private and never leave their clients.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import BlipForQuestionAnswering, ViltForQuestionAnswering

ADAPTER_WEIGHTS = "shared_adapter.safetensors"
_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "proxies")


class BottleneckAdapter(nn.Module):
    """``delta(h) = ReLU(h W_down + b_down) W_up + b_up`` (the residual is added by the hook)."""

    def __init__(self, d: int, r: int):
        super().__init__()
        self.down = nn.Linear(d, r)
        self.up = nn.Linear(r, d)

    def forward(self, h):
        return self.up(torch.relu(self.down(h)))


def _add_to_output(adapter: BottleneckAdapter):
    def hook(module, args, output):
        if isinstance(output, tuple):
            return (output[0] + adapter(output[0]),) + output[1:]
        return output + adapter(output)
    return hook


class _SharedAdapterMixin:
    """Builds the adapters from ``config.shared_adapter`` and loads backbone + adapter in ``from_pretrained``."""

    def _attach_shared_adapter(self) -> None:
        spec = self.config.shared_adapter
        self.shared_adapter = nn.ModuleList(BottleneckAdapter(d, spec["r"]) for d in spec["hidden_sizes"])
        for site, adapter in zip(spec["sites"], self.shared_adapter):
            self.get_submodule(site).register_forward_hook(_add_to_output(adapter))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, config=None, **kwargs):
        from safetensors.torch import load_file
        from transformers import AutoConfig
        from transformers.utils import cached_file

        hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
        if config is None:
            config = AutoConfig.from_pretrained(pretrained_model_name_or_path, **hub)
        spec = config.shared_adapter
        base_hub = {k: v for k, v in hub.items() if k not in ("revision", "subfolder")}
        backbone = cls.backbone_class.from_pretrained(spec["base_model_name_or_path"],
                                                      revision=spec.get("base_revision"), **base_hub)
        with torch.device("meta"):  # every tensor comes from the two checkpoints below
            model = cls(config)
        missing, unexpected = model.load_state_dict(backbone.state_dict(), strict=False, assign=True)
        if unexpected or any(not k.startswith("shared_adapter.") for k in missing):
            raise ValueError(f"the backbone {spec['base_model_name_or_path']!r} does not fit this adapter's config: "
                             f"missing {missing[:5]}, unexpected {unexpected[:5]}")
        weights = load_file(cached_file(pretrained_model_name_or_path, ADAPTER_WEIGHTS, **hub))
        model.shared_adapter.load_state_dict(weights, strict=True, assign=True)
        for name, buffer in backbone.named_buffers():  # non-persistent buffers are not in the state dict
            if model.get_buffer(name).is_meta:
                parent, _, leaf = name.rpartition(".")
                model.get_submodule(parent).register_buffer(leaf, buffer, persistent=False)
        return model.eval()


class ViltWithSharedAdapter(_SharedAdapterMixin, ViltForQuestionAnswering):
    backbone_class = ViltForQuestionAnswering

    def __init__(self, config):
        super().__init__(config)
        self._attach_shared_adapter()


class BlipWithSharedAdapter(_SharedAdapterMixin, BlipForQuestionAnswering):
    backbone_class = BlipForQuestionAnswering

    def __init__(self, config):
        super().__init__(config)
        self._attach_shared_adapter()


MODEL_CLASSES = {"vilt": ViltWithSharedAdapter, "blip": BlipWithSharedAdapter}
