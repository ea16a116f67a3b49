"""Model builders (tiny configs + real Hub checkpoints) and model utilities.

Adapters live in :mod:`hfpfl.models.adapters`; pretrained tiny stand-in backbones in :mod:`hfpfl.models.pretrained`.
"""

import importlib

from .names import TINY_CLASSIFIER_NAMES, TINY_VQA_MODELS

# the builders (and transformers' model code they import, ~130 MB RSS per process) load on first use: a run with its
# own model (``Algorithm.build_model``) never imports them
_BUILDERS = ("TINY_CLASSIFIERS", "build_classifier", "build_vqa_model", "build_vqa_tokenizer", "classifier_config",
             "count_parameters", "norm_layer_names", "resnet18_config", "resnet26_config", "tiny_resnet_config",
             "tiny_vit_config", "tiny_vqa_vocab")

__all__ = [
    "TINY_CLASSIFIER_NAMES",
    "TINY_CLASSIFIERS",
    "TINY_VQA_MODELS",
    "build_classifier",
    "build_vqa_model",
    "build_vqa_tokenizer",
    "classifier_config",
    "count_parameters",
    "norm_layer_names",
    "resnet18_config",
    "resnet26_config",
    "tiny_resnet_config",
    "tiny_vit_config",
    "tiny_vqa_vocab",
    "ensure_pretrained",
    "build_run_model",
]


def build_run_model(model: str, adapter: str = "none", num_labels: int = 10, image_size: int = 28,
                    num_channels: int = 3, lora_r: int = 4):
    """The model a run trains: ``build_classifier(model, ...)`` -- a stand-in backbone id
    (``hfpfl/tiny-resnet-ood``, ``hfpfl/tiny-vit-ood``) is pretrained and published on first use -- then
    ``--adapter`` (none | lora | residual | parallel) freezes it and adds the adapter."""
    from .adapters import make_adapter_model
    from .builders import build_classifier
    from .pretrained import STANDINS, ensure_standin

    if model in STANDINS:
        ensure_standin(model)
    base = build_classifier(model, num_labels=num_labels, image_size=image_size, num_channels=num_channels)
    return make_adapter_model(base, adapter, lora_r=lora_r)


def __getattr__(name):  # lazy: the builders pull in transformers' models, pretrained accelerate/datasets
    if name in _BUILDERS:
        return getattr(importlib.import_module(f"{__name__}.builders"), name)
    if name == "ensure_pretrained":
        from .pretrained import ensure_pretrained

        return ensure_pretrained
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
