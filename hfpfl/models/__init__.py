"""Model builders (tiny configs + real Hub checkpoints) and model utilities.

Adapter injection lives in :mod:`hfpfl.models.adapters` (separate owner); pretrained tiny backbones in
:mod:`hfpfl.models.pretrained`.
"""

from .builders import (
    TINY_CLASSIFIERS,
    TINY_VQA_MODELS,
    build_classifier,
    build_vqa_model,
    build_vqa_tokenizer,
    classifier_config,
    count_parameters,
    norm_layer_names,
    resnet18_config,
    resnet26_config,
    tiny_resnet_config,
    tiny_vit_config,
    tiny_vqa_vocab,
)

__all__ = [
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
]


def __getattr__(name):  # lazy: pretrained pulls in accelerate/datasets
    if name == "ensure_pretrained":
        from .pretrained import ensure_pretrained

        return ensure_pretrained
    raise AttributeError(name)
