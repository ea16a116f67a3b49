"""Model zoo: tiny configs for CPU simulation and real Hub checkpoints through one code path.

``build_classifier("tiny-resnet", ...)`` builds a transformers ``ResNetForImageClassification`` from a small
config (random init); any other name is a Hub repo id or a local directory and goes through
``AutoModelForImageClassification.from_pretrained`` -- the same path for ``microsoft/resnet-18`` and for a tiny
backbone that ``recipes/pretrain.py`` published to the local Hub cache.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from typing import Any

from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForImageClassification,
    BertTokenizer,
    BlipConfig,
    BlipForQuestionAnswering,
    PreTrainedModel,
    ResNetConfig,
    ResNetForImageClassification,
    ViltConfig,
    ViltForQuestionAnswering,
    ViTConfig,
    ViTForImageClassification,
)

from ..hub import resolve_pretrained
from .names import TINY_CLASSIFIER_NAMES, TINY_VQA_MODELS  # noqa: F401  (the names, also without this module)

__all__ = [
    "TINY_CLASSIFIERS",
    "TINY_VQA_MODELS",
    "tiny_resnet_config",
    "tiny_vit_config",
    "resnet18_config",
    "resnet26_config",
    "classifier_config",
    "build_classifier",
    "build_vqa_model",
    "build_vqa_tokenizer",
    "tiny_vqa_vocab",
    "norm_layer_names",
    "count_parameters",
]


# --------------------------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------------------------
def _labels_kwargs(num_labels: int) -> dict[str, Any]:
    """A config's labels "0".."n-1": the label maps alone (their length is ``num_labels``; passing ``num_labels``
    beside a checkpoint's longer maps only makes transformers warn that they disagree before they are replaced)."""
    return {
        "id2label": {i: str(i) for i in range(num_labels)},
        "label2id": {str(i): i for i in range(num_labels)},
    }


def _basic_resnet_config(num_labels, num_channels, embedding_size, hidden_sizes, depths, overrides) -> ResNetConfig:
    """A basic-block HF ResNet config; ``overrides`` (any ResNetConfig field) win over the shape given here."""
    kw = dict(num_channels=num_channels, embedding_size=embedding_size, hidden_sizes=hidden_sizes, depths=depths,
              layer_type="basic", hidden_act="relu", downsample_in_first_stage=False, **_labels_kwargs(num_labels))
    kw.update(overrides)
    return ResNetConfig(**kw)


def tiny_resnet_config(num_labels: int, num_channels: int = 3, **overrides) -> ResNetConfig:
    """4-stage basic-block ResNet, widths 16/32/64/128, one block per stage (~0.31M params with 10 labels).

    Measured: one forward+backward+SGD step on a 32x3x28x28 batch takes ~20 ms on one CPU core.
    """
    return _basic_resnet_config(num_labels, num_channels, 16, [16, 32, 64, 128], [1, 1, 1, 1], overrides)


def resnet18_config(num_labels: int, num_channels: int = 3, **overrides) -> ResNetConfig:
    """The real ResNet-18 shape (same as ``microsoft/resnet-18``'s config), for parameter accounting without weights."""
    return _basic_resnet_config(num_labels, num_channels, 64, [64, 128, 256, 512], [2, 2, 2, 2], overrides)


def resnet26_config(num_labels: int, num_channels: int = 3, **overrides) -> ResNetConfig:
    """ResNet-26 in the style of Rebuffi et al. (residual/parallel adapters): 3 stages x 4 basic blocks,
    widths 64/128/256, 32-channel stem (1 stem conv + 24 block convs + classifier = 26 layers).

    Note: the HF ResNet stem is a 7x7/2 conv + max-pool (ImageNet style), not Rebuffi's 3x3/1 stem, so the shape of
    the blocks matches but the stem does not.
    """
    return _basic_resnet_config(num_labels, num_channels, 32, [64, 128, 256], [4, 4, 4], overrides)


def tiny_vit_config(num_labels: int, image_size: int = 28, num_channels: int = 3, **overrides) -> ViTConfig:
    """2-layer ViT, hidden 64, 4 heads, MLP 128 (~78K params). Patch 7 when it divides ``image_size`` (16 tokens
    at 28x28: ~14 ms per 32-batch step on one core), else 4, else 8/16."""
    patch = overrides.pop("patch_size", None)
    if patch is None:
        patch = next((p for p in (7, 4, 8, 16) if image_size % p == 0), None)
        if patch is None:
            raise ValueError(f"tiny-vit: no patch size in (7, 4, 8, 16) divides image_size={image_size}; pass patch_size=")
    kw = dict(
        image_size=image_size,
        patch_size=patch,
        num_channels=num_channels,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    kw.update(_labels_kwargs(num_labels))
    kw.update(overrides)
    return ViTConfig(**kw)


TINY_CLASSIFIERS = {
    "tiny-resnet": lambda n, s, c, **o: tiny_resnet_config(n, num_channels=c, **o),
    "tiny-vit": lambda n, s, c, **o: tiny_vit_config(n, image_size=s, num_channels=c, **o),
    "resnet-18": lambda n, s, c, **o: resnet18_config(n, num_channels=c, **o),
    "resnet-26": lambda n, s, c, **o: resnet26_config(n, num_channels=c, **o),
}


def classifier_config(model_name: str, num_labels: int, image_size: int = 28, num_channels: int = 3, **overrides):
    """Config of a built-in (config-only) classifier name."""
    try:
        make = TINY_CLASSIFIERS[model_name]
    except KeyError:
        raise KeyError(f"{model_name!r} is not a built-in config; built-ins: {sorted(TINY_CLASSIFIERS)}") from None
    return make(num_labels, image_size, num_channels, **overrides)


# --------------------------------------------------------------------------------------------------------------
# classifiers
# --------------------------------------------------------------------------------------------------------------
class _NewHeadReport(logging.Filter):
    """transformers logs a LOAD REPORT table whenever ``from_pretrained(..., ignore_mismatched_sizes=True)``
    re-initialises weights whose shape changed. Here that is the new head the caller asked for (another number of
    labels), so a report whose only entries are size mismatches is dropped and one plain line says what happened; a
    report with missing, unexpected or unconverted weights still reaches the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        only_mismatches = "LOAD REPORT" in msg and "MISMATCH" in msg and not any(
            word in msg for word in ("MISSING", "UNEXPECTED", "CONVERSION"))
        return not only_mismatches


@contextlib.contextmanager
def _new_head(name: str, checkpoint_labels: int, num_labels: int):
    """Load with a new head for ``num_labels`` (the checkpoint's has ``checkpoint_labels``) without transformers'
    load-report table; one line in hfpfl's log instead."""
    if checkpoint_labels == num_labels:
        yield
        return
    report_logger, quiet = logging.getLogger("transformers.modeling_utils"), _NewHeadReport()
    report_logger.addFilter(quiet)
    try:
        yield
    finally:
        report_logger.removeFilter(quiet)
    logging.getLogger("hfpfl").info("%s: a new %d-label head replaces the checkpoint's %d-label head (randomly "
                                    "initialised; the rest of the checkpoint is loaded)", name, num_labels,
                                    checkpoint_labels)


def build_classifier(
    model_name_or_path: str,
    num_labels: int,
    image_size: int = 28,
    num_channels: int = 3,
    **overrides,
) -> PreTrainedModel:
    """Build an image classifier.

    * ``tiny-resnet`` / ``tiny-vit`` / ``resnet-18`` / ``resnet-26``: built from a config, random init
      (``overrides`` are config fields).
    * anything else: a Hub repo id (``microsoft/resnet-18``, ``hfpfl/tiny-resnet-ood``) or local directory, loaded
      with ``AutoModelForImageClassification.from_pretrained(..., num_labels=num_labels,
      ignore_mismatched_sizes=True)``; ``overrides`` are passed to ``from_pretrained`` (``revision=``, ``cache_dir=``,
      ``torch_dtype=``, config fields...). ``image_size``/``num_channels`` are properties of a checkpoint and are
      not changed; the caller's data transform must match (``model.config.image_size`` where the config has one).

    Offline (``HF_HUB_OFFLINE=1``) an uncached id raises :class:`hfpfl.hub.OfflineModelError` at once; a corrupt
    checkpoint raises :class:`hfpfl.hub.CorruptCheckpointError` naming the file.
    """
    if model_name_or_path in TINY_CLASSIFIERS:
        config = classifier_config(model_name_or_path, num_labels, image_size, num_channels, **overrides)
        cls = ViTForImageClassification if isinstance(config, ViTConfig) else ResNetForImageClassification
        return cls(config)

    revision = overrides.pop("revision", None)
    cache_dir = overrides.pop("cache_dir", None)
    with resolve_pretrained(model_name_or_path, revision=revision, cache_dir=cache_dir) as kw:
        config = AutoConfig.from_pretrained(model_name_or_path, **kw)
        # keep the checkpoint's label names when the head size already matches (e.g. ImageNet's 1000 classes)
        labels = {"num_labels": num_labels} if config.num_labels == num_labels else _labels_kwargs(num_labels)
        with _new_head(model_name_or_path, config.num_labels, num_labels):
            model = AutoModelForImageClassification.from_pretrained(
                model_name_or_path,
                **kw,
                **labels,
                ignore_mismatched_sizes=True,
                **overrides,
            )
    return model


# --------------------------------------------------------------------------------------------------------------
# VQA models (FedDAT)
# --------------------------------------------------------------------------------------------------------------
_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[DEC]"]
_DEFAULT_WORDS = (
    "what is the color of how many are there in on a an this picture image digit number shape left right top bottom "
    "yes no red green blue black white yellow gray big small one two three four five six seven eight nine zero "
    "circle square triangle object background which side does have".split()
)


def tiny_vqa_vocab(extra_words: list[str] | tuple[str, ...] = ()) -> list[str]:
    """A small WordPiece vocab: specials, a few question words, digits/letters and ``extra_words`` (lowercased)."""
    words = list(_SPECIALS)
    seen = set(words)
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789?.,!'-")
    for w in list(_DEFAULT_WORDS) + chars + ["##" + c for c in chars] + [w.lower() for w in extra_words]:
        if w not in seen:
            seen.add(w)
            words.append(w)
    return words


def build_vqa_tokenizer(
    model_name_or_path: str = "tiny-vilt",
    extra_words: list[str] | tuple[str, ...] = (),
    save_dir: str | os.PathLike | None = None,
    **kwargs,
):
    """Tokenizer/processor matching :func:`build_vqa_model`, offline.

    Tiny names return a ``BertTokenizer`` over :func:`tiny_vqa_vocab` (written to ``save_dir`` or a temp dir; slow
    ``BertTokenizer(vocab=...)`` on purpose -- ``BertTokenizerFast(vocab_file=...)`` silently builds a 5-token vocab in
    transformers 5). Hub ids/local dirs return ``AutoProcessor.from_pretrained`` (fails fast when offline+uncached).
    """
    if model_name_or_path in TINY_VQA_MODELS:
        vocab = tiny_vqa_vocab(extra_words)
        save_dir = str(save_dir) if save_dir is not None else tempfile.mkdtemp(prefix="hfpfl-vocab-")
        os.makedirs(save_dir, exist_ok=True)
        path = os.path.join(save_dir, "vocab.txt")
        with open(path, "w") as f:
            f.write("\n".join(vocab) + "\n")
        kwargs.setdefault("bos_token", "[DEC]")  # BLIP's text decoder starts from [DEC], as in BlipProcessor
        tok = BertTokenizer(vocab=path, do_lower_case=True, **kwargs)
        if len(tok) < len(vocab):  # guard against the transformers-5 silent tiny-vocab pitfall
            raise RuntimeError(f"tokenizer built {len(tok)} tokens from a {len(vocab)}-token vocab at {path}")
        return tok

    from transformers import AutoProcessor

    revision = kwargs.pop("revision", None)
    cache_dir = kwargs.pop("cache_dir", None)
    with resolve_pretrained(model_name_or_path, revision=revision, cache_dir=cache_dir) as kw:
        return AutoProcessor.from_pretrained(model_name_or_path, **kw, **kwargs)


def _tiny_vilt(num_answers: int, image_size: int, vocab_size: int, **overrides) -> ViltForQuestionAnswering:
    kw = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        image_size=image_size,
        patch_size=8 if image_size % 8 == 0 else 4,
        max_position_embeddings=40,
        max_image_length=-1,
        num_images=-1,
        pad_token_id=0,
    )
    kw.update(_labels_kwargs(num_answers))
    kw.update(overrides)
    return ViltForQuestionAnswering(ViltConfig(**kw))


def _tiny_blip(image_size: int, vocab_size: int, **overrides) -> BlipForQuestionAnswering:
    text = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        encoder_hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=40,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=0,
        bos_token_id=_SPECIALS.index("[DEC]"),
        sep_token_id=_SPECIALS.index("[SEP]"),
        eos_token_id=_SPECIALS.index("[SEP]"),
    )
    text.update(overrides.pop("text_config", {}))
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=8 if image_size % 8 == 0 else 4,
        attention_dropout=0.0,
        # BlipVisionConfig's default 1e-10 (real BLIP is always loaded from a checkpoint) leaves a tower built from
        # a config with ~0 weights: its output is one constant vector whatever the image until training revives it
        initializer_range=0.02,
    )
    vision.update(overrides.pop("vision_config", {}))
    config = BlipConfig(text_config=text, vision_config=vision, projection_dim=32, **overrides)
    return BlipForQuestionAnswering(config)




def build_vqa_model(
    model_name_or_path: str,
    num_answers: int,
    image_size: int = 32,
    vocab_size: int | None = None,
    **overrides,
) -> PreTrainedModel:
    """VQA model for FedDAT-style methods.

    * ``tiny-vilt``: tiny ``ViltForQuestionAnswering`` (classification over ``num_answers``).
    * ``tiny-blip``: tiny ``BlipForQuestionAnswering`` (generative answers; ``num_answers`` unused, kept for one
      signature). Text ids follow :func:`build_vqa_tokenizer` (``[DEC]`` is the decoder BOS).
    * anything else (``dandelin/vilt-b32-mlm``, ``Salesforce/blip-vqa-base``, local dirs):
      ``from_pretrained`` via the matching ``*ForQuestionAnswering`` class (ViLT gets ``num_labels=num_answers``).

    ``vocab_size`` defaults to the size of :func:`tiny_vqa_vocab` ()."""
    if model_name_or_path in TINY_VQA_MODELS:
        vocab_size = vocab_size or len(tiny_vqa_vocab())
        if model_name_or_path == "tiny-vilt":
            return _tiny_vilt(num_answers, image_size, vocab_size, **overrides)
        return _tiny_blip(image_size, vocab_size, **overrides)

    revision = overrides.pop("revision", None)
    cache_dir = overrides.pop("cache_dir", None)
    with resolve_pretrained(model_name_or_path, revision=revision, cache_dir=cache_dir) as kw:
        config = AutoConfig.from_pretrained(model_name_or_path, **kw)
        if config.model_type == "blip":
            return BlipForQuestionAnswering.from_pretrained(model_name_or_path, **kw, **overrides)
        if config.model_type == "vilt":
            with _new_head(model_name_or_path, config.num_labels, num_answers):
                return ViltForQuestionAnswering.from_pretrained(
                    model_name_or_path, **kw, **_labels_kwargs(num_answers), ignore_mismatched_sizes=True, **overrides
                )
    raise ValueError(f"build_vqa_model: unsupported model_type {config.model_type!r} for {model_name_or_path!r}")


# --------------------------------------------------------------------------------------------------------------
# utilities
# --------------------------------------------------------------------------------------------------------------
_NORM_TYPES = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm)


def norm_layer_names(model: nn.Module) -> set[str]:
    """Qualified names of normalization modules (BatchNorm*, LayerNorm, GroupNorm, InstanceNorm*, and any module
    whose class name ends in ``Norm``/``LayerNorm``, e.g. RMSNorm variants). FedBN keeps parameters and buffers
    under these prefixes local."""
    names = set()
    for name, module in model.named_modules():
        if not name:
            continue
        cls = type(module).__name__
        if isinstance(module, _NORM_TYPES) or cls.endswith("Norm") or cls.endswith("LayerNorm") or "BatchNorm" in cls:
            names.add(name)
    return names


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
