"""A tiny MLP with a dropout layer (a CPU-scale stand-in, MLP 64-64-10): FedPop tunes the dropout rate, and the
library's tiny ResNet/ViT have no ``nn.Dropout``. ``--model tiny-mlp`` selects it for any method: the tuner registers
``<method>+tiny-mlp``, the method with only ``build_model`` replaced (the engine builds models through the method;
no engine change)."""
from __future__ import annotations

from torch import nn
from transformers.modeling_outputs import ImageClassifierOutput

from ..federated.registry import REGISTRY, get_algorithm, register

TINY_MLP = "tiny-mlp"


class TinyMLP(nn.Module):
    def __init__(self, in_features: int, num_labels: int, hidden: int = 64, dropout: float = 0.0):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(), nn.Dropout(dropout),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, num_labels))

    def forward(self, pixel_values, labels=None):
        logits = self.net(pixel_values.float())
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return ImageClassifierOutput(loss=loss, logits=logits)


def method_with_model(method: str, model: str) -> str:
    """The registered method name to run ``model`` with (``method`` itself unless ``model`` is tiny-mlp)."""
    if model != TINY_MLP:
        return method
    name = f"{method}+{TINY_MLP}"
    if name not in REGISTRY:
        base = get_algorithm(method)

        def build_model(self):
            d = self.ctx.data
            return TinyMLP(d.num_channels * d.image_size * d.image_size, d.num_labels)

        register(type(base.__name__ + "TinyMLP", (base,), {"name": name, "build_model": build_model,
                                                             "__module__": __name__}))
    return name
