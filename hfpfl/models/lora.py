"""Generic LoRA (peft) on a classifier backbone: attention projections on ViT, 3x3 convolutions on ResNet.
The classifier head stays trainable (modules_to_save); everything else is frozen."""
from __future__ import annotations

from torch import nn


def lora_targets(model: nn.Module) -> list[str]:
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    if {"q_proj", "v_proj"} <= names:
        return ["q_proj", "v_proj"]          # transformers 5 ViT
    if {"query", "value"} <= names:
        return ["query", "value"]            # ViLT / BERT-style attention
    if "convolution" in names:
        return ["convolution"]               # transformers ResNet conv layers
    raise ValueError(f"don't know where to put LoRA in {type(model).__name__}: no q_proj/v_proj, query/value or "
                     "convolution modules; pass a peft LoraConfig with target_modules yourself")


def add_lora(model: nn.Module, r: int = 4, alpha: int | None = None, dropout: float = 0.0, targets=None):
    from peft import LoraConfig, get_peft_model

    if r <= 0:
        raise ValueError(f"LoRA rank must be > 0, got {r}")
    head = [n for n in ("classifier", "fc", "head") if hasattr(model, n)]
    config = LoraConfig(r=r, lora_alpha=alpha or 2 * r, lora_dropout=dropout,
                        target_modules=targets or lora_targets(model), modules_to_save=head)
    return get_peft_model(model, config)
