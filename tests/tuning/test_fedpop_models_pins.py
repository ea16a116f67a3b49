"""FedPop's tiny MLP (``--model tiny-mlp``, the CPU stand-in with dropout layers that FedPop tunes) pinned by hand:
its layers, a forward pass and loss on known weights, and the ``<method>+tiny-mlp`` registration."""
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hfpfl.federated import registry
from hfpfl.tuning import models
from hfpfl.tuning.models import TINY_MLP, TinyMLP, method_with_model


def test_tiny_mlp_layers_default_width_and_dropout():
    """Flatten, Linear(in, 64), ReLU, Dropout(p), Linear(64, 64), ReLU, Dropout(p), Linear(64, labels); p = 0 unless
    given; hidden width given."""
    m = TinyMLP(12, 5)
    kinds = [type(x) for x in m.net]
    assert kinds == [nn.Flatten, nn.Linear, nn.ReLU, nn.Dropout, nn.Linear, nn.ReLU, nn.Dropout, nn.Linear]
    shapes = [(x.in_features, x.out_features) for x in m.net if isinstance(x, nn.Linear)]
    assert shapes == [(12, 64), (64, 64), (64, 5)]
    assert [x.p for x in m.net if isinstance(x, nn.Dropout)] == [0.0, 0.0]
    m = TinyMLP(3, 2, hidden=7, dropout=0.25)
    assert [(x.in_features, x.out_features) for x in m.net if isinstance(x, nn.Linear)] == [(3, 7), (7, 7), (7, 2)]
    assert [x.p for x in m.net if isinstance(x, nn.Dropout)] == [0.25, 0.25]
    assert TINY_MLP == "tiny-mlp"


def test_tiny_mlp_forward_and_loss_on_known_weights():
    """in 2 -> hidden 2 -> 2 labels, every weight 0.5 and bias 0.1 except the last layer (rows [1, 0] and [0, -1]):
    integer pixels (1, 3) become floats; h1 = relu(0.5 (1 + 3) + 0.1) = 2.1 per unit, h2 = relu(0.5 * 4.2 + 0.1)
    = 2.2, logits (2.2 + 0.1, -2.2 + 0.1) = (2.3, -2.1); the loss is cross-entropy against label 1; no labels, no
    loss."""
    m = TinyMLP(2, 2, hidden=2, dropout=0.5).eval()
    lin = [x for x in m.net if isinstance(x, nn.Linear)]
    with torch.no_grad():
        for x in lin:
            nn.init.constant_(x.weight, 0.5)
            nn.init.constant_(x.bias, 0.1)
        lin[2].weight.copy_(torch.tensor([[1.0, 0.0], [0.0, -1.0]]))
    px = torch.tensor([[[1, 3]]], dtype=torch.uint8)          # (batch 1, 1, 2): flattened to 2 features
    out = m(px, labels=torch.tensor([1]))
    assert out.logits.tolist() == [pytest.approx([2.3, -2.1])]
    want = -(-2.1 - math.log(math.exp(2.3) + math.exp(-2.1)))
    assert out.loss.item() == pytest.approx(want, rel=1e-6)
    assert m(px).loss is None and m(px).logits.tolist() == [pytest.approx([2.3, -2.1])]


def test_method_with_model_registers_the_method_with_the_tiny_mlp_once(monkeypatch):
    """Another model: the method's own name, nothing registered. tiny-mlp: ``<method>+tiny-mlp``, a subclass of the
    method named ``<Class>TinyMLP`` in this module, whose build_model makes a TinyMLP over channels * size^2 inputs
    and the data's labels; a second call reuses the registered class."""
    base = registry.get_algorithm("fedprox")   # registered (imported) before the registry is swapped for a copy
    reg = dict(registry.REGISTRY)
    monkeypatch.setattr(registry, "REGISTRY", reg)
    monkeypatch.setattr(models, "REGISTRY", reg)
    reg.pop("fedprox+tiny-mlp", None)
    before = dict(reg)
    assert method_with_model("fedprox", "resnet8") == "fedprox" and reg == before
    assert method_with_model("fedprox", TINY_MLP) == "fedprox+tiny-mlp"
    cls = reg["fedprox+tiny-mlp"]
    assert issubclass(cls, base) and cls is not base and cls.name == "fedprox+tiny-mlp"
    assert cls.__name__ == base.__name__ + "TinyMLP" and cls.__module__ == "hfpfl.tuning.models"
    assert set(reg) - set(before) == {"fedprox+tiny-mlp"}
    fake = SimpleNamespace(ctx=SimpleNamespace(data=SimpleNamespace(num_channels=3, image_size=4, num_labels=6)))
    net = cls.build_model(fake)
    assert isinstance(net, TinyMLP)
    lin = [x for x in net.net if isinstance(x, nn.Linear)]
    assert (lin[0].in_features, lin[-1].out_features) == (3 * 4 * 4, 6)
    assert method_with_model("fedprox", TINY_MLP) == "fedprox+tiny-mlp" and reg["fedprox+tiny-mlp"] is cls
