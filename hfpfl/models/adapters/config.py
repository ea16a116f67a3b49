"""Adapter configs (the ``config.py`` of a peft-style tuner): plain dataclasses that round-trip through JSON.

Residual and parallel adapters are *not* peft methods: peft has no public way to register a new method type (its
``register_peft_method`` needs a member of the closed ``PeftType`` enum), and its documented custom-module support
(``LoraConfig._register_custom_module``) only swaps the layer of a LoRA-family method, whose state-dict and load
path stay LoRA's.  A residual adapter (Rebuffi 2017 series form, with a trainable copy of the BN behind it) and a
parallel 1x1 adapter are not LoRA layers, so they are plain-torch modules with their own ``save_pretrained`` /
``from_pretrained`` (:mod:`.io`), following peft's layout and key conventions.  LoRA (ViT) stays real peft:
:func:`vit_lora_config` returns a stock ``peft.LoraConfig``, and such adapters load with plain peft.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Optional, Union

CONFIG_NAME = "hfpfl_adapter_config.json"
WEIGHTS_NAME = "hfpfl_adapter_model.safetensors"
FORMAT_VERSION = 1


@dataclass
class ConvAdapterConfig:
    """Fields shared by the conv-unit adapters (see :class:`ResidualAdapterConfig`, :class:`ParallelAdapterConfig`)."""

    target_modules: Optional[Union[list[str], str]] = field(
        default=None,
        metadata={"help": "Conv units (modules with .convolution Conv2d + .normalization BatchNorm2d, e.g. "
                          "transformers' ResNetConvLayer) that get an adapter. List of names/suffixes or a regex "
                          "(fullmatch). None = the kind's default for transformers ResNet."},
    )
    exclude_modules: Optional[Union[list[str], str]] = field(
        default=None, metadata={"help": "Module names (list, suffix match) or regex never to adapt."}
    )
    norm_modules: Optional[Union[list[str], str]] = field(
        default=None,
        metadata={"help": "Conv units whose BatchNorm is trained (per-adapter copy) but that get no adapter conv. "
                          "None = the kind's default; [] = none."},
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
        metadata={"help": "model.train() keeps every frozen BatchNorm (shortcut/downsample BN, the pretrained BNs "
                          "shadowed by trainable copies) in eval mode, so pretrained running statistics never drift "
                          "(PerAda spec ambiguity 12). False replicates the PerAda code."},
    )
    base_model_signature: Optional[dict] = field(
        default=None,
        metadata={"help": "Filled at injection with the base model's architecture fields; loading the adapter onto a "
                          "model with a different signature raises a ValueError."},
    )
    base_model_name_or_path: Optional[str] = field(
        default=None, metadata={"help": "Where the base model came from (filled at injection when known)."}
    )
    inference_mode: bool = field(default=False, metadata={"help": "Loaded for inference only (frozen adapter)."})

    kind = ""  # class attribute: "residual" | "parallel"

    def __post_init__(self):
        if isinstance(self.target_modules, (list, tuple, set)):
            if len(self.target_modules) == 0:
                raise ValueError(f"{type(self).__name__}: target_modules is empty; give names/regex or None.")
            self.target_modules = list(self.target_modules)
        if isinstance(self.modules_to_save, str):
            self.modules_to_save = [self.modules_to_save]
        if not (isinstance(self.init_std, (int, float)) and self.init_std >= 0 and math.isfinite(self.init_std)):
            raise ValueError(f"{type(self).__name__}: init_std must be a finite number >= 0, got {self.init_std!r}")

    # ------------------------------------------------------------------ JSON round trip
    def to_dict(self) -> dict:
        return {"adapter_kind": self.kind, "format_version": FORMAT_VERSION, "library": "hfpfl",
                **dataclasses.asdict(self)}

    @staticmethod
    def from_dict(d: dict) -> "ConvAdapterConfig":
        d = dict(d)
        kind = d.pop("adapter_kind", None)
        d.pop("format_version", None)
        d.pop("library", None)
        cls = CONFIG_CLASSES.get(kind)
        if cls is None:
            raise ValueError(f"unknown adapter kind {kind!r} in adapter config; expected one of {sorted(CONFIG_CLASSES)}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown fields {unknown} in a {cls.__name__}")
        return cls(**d)

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        os.makedirs(save_directory, exist_ok=True)
        with open(os.path.join(save_directory, CONFIG_NAME), "w") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)

    @staticmethod
    def from_pretrained(directory: str | os.PathLike) -> "ConvAdapterConfig":
        path = os.path.join(directory, CONFIG_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no {CONFIG_NAME} in {directory!s}: not an hfpfl conv adapter folder "
                                    "(a peft adapter has adapter_config.json: load it with PeftModel.from_pretrained)")
        with open(path) as f:
            return ConvAdapterConfig.from_dict(json.load(f))


@dataclass
class ResidualAdapterConfig(ConvAdapterConfig):
    """PerAda's residual adapter (Rebuffi et al. 2017 series form, as in Pillutla et al.'s FL_partial_personalization
    code that PerAda uses): after the 3x3 conv of every basic-block conv unit, ``h <- h + Conv1x1(Dropout_p(BN(h)))``,
    then the unit's (trainable copy of its) BN and activation.

    Defaults reproduce PerAda's trained/communicated set on transformers' ResNet: adapters on the block convs
    (``layer.0`` = conv1/bn1, ``layer.1`` = conv2/bn2), trainable stem BN (``norm_modules`` = stem), trainable block
    BNs, classifier head; frozen: all backbone convs and the shortcut (downsample) path.

    ``init_std``: the paper is silent on the init; the authors' code uses "N(0, 1e-4)", read as the standard
    deviation (``nn.init.normal_(w, 0, 1e-4)``), which makes the adapter ~identity at init (spec check 7.3).
    """

    dropout: float = field(default=0.3, metadata={"help": "Dropout p inside the adapter (PerAda code default 0.3)."})
    adapter_bn: bool = field(default=True, metadata={"help": "BatchNorm inside the adapter, before the dropout."})

    kind = "residual"

    def __post_init__(self):
        super().__post_init__()
        if not (0.0 <= float(self.dropout) < 1.0):
            raise ValueError(f"ResidualAdapterConfig: dropout must be in [0, 1), got {self.dropout!r}")


@dataclass
class ParallelAdapterConfig(ConvAdapterConfig):
    """Parallel adapter (Elvebakken et al., following Rebuffi et al. 2018): a 1x1 conv with the same stride as the
    kxk conv, in parallel: ``y = act(BN(W*x + a*x))``.  Trainable and communicated: adapters + BN of every adapted
    layer + head (the paper, Sec. III).  Default targets on transformers' ResNet: the stem and every block conv (the reference
    code adapts all 25 3x3 convs of ResNet-26 including the stem); shortcuts stay frozen.

    ``init``: "zeros" (default: the initial function is the pretrained base's), "normal" (N(0, init_std^2)) or
    "he" (Kaiming-normal, the reference code).
    """

    init: str = field(default="zeros", metadata={"help": "Adapter init: 'zeros', 'normal' (init_std) or 'he'."})

    kind = "parallel"

    def __post_init__(self):
        super().__post_init__()
        if self.norm_modules is None:
            self.norm_modules = []
        if self.init not in ("zeros", "normal", "he"):
            raise ValueError(f"ParallelAdapterConfig: init must be 'zeros', 'normal' or 'he', got {self.init!r}")


CONFIG_CLASSES = {"residual": ResidualAdapterConfig, "parallel": ParallelAdapterConfig}


def vit_lora_config(r: int = 8, alpha: int = 16, dropout: float = 0.0, target_modules=("q_proj", "v_proj"),
                    modules_to_save=("classifier",), **kwargs):
    """A stock ``peft.LoraConfig``: LoRA on the query/value projections of transformers-5 ViT
    (``vit.layers.N.attention.{q,k,v,o}_proj``) with a trainable head.  (PerAda does not say how its DP-ViT adapter is
    placed: spec ambiguity 21; q/v LoRA is the standard choice.)  Adapters made from it load with plain peft."""
    from peft import LoraConfig

    if not isinstance(r, int) or r <= 0:
        raise ValueError(f"vit_lora_config: rank r must be a positive int, got {r!r}")
    if alpha <= 0:
        raise ValueError(f"vit_lora_config: alpha must be > 0, got {alpha!r}")
    if not (0.0 <= dropout < 1.0):
        raise ValueError(f"vit_lora_config: dropout must be in [0, 1), got {dropout!r}")
    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules),
                      modules_to_save=list(modules_to_save) if modules_to_save else None, **kwargs)
