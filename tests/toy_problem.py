"""Small models with known structure for the engine tests. The 4-number regression model the hand-computed engine tests share (``tests/algorithms/test_baseline_pins.py``
derives its steps in its docstring): ``pred = c * (w . x) + b``, optionally with a BatchNorm1d(1) on ``w . x``
(FedBN), loss ``1/2 mean (pred - y)^2``; start ``w = (1, -1), c = 2, b = 0.5``."""
import torch
from torch import nn
from transformers.modeling_outputs import ImageClassifierOutput

from hfpfl.training import Metric

W0 = {"w": [1.0, -1.0], "c": 2.0, "b": 0.5}


class Toy(nn.Module):
    """pred = c * (w . x) + b; optionally a BatchNorm1d(1) on w . x (FedBN)."""

    def __init__(self, bn=False):
        super().__init__()
        self.body = nn.Linear(2, 1, bias=False)
        self.bn = nn.BatchNorm1d(1) if bn else None
        self.classifier = nn.Linear(1, 1)
        with torch.no_grad():
            self.body.weight.copy_(torch.tensor([W0["w"]]))
            self.classifier.weight.fill_(W0["c"])
            self.classifier.bias.fill_(W0["b"])

    def forward(self, pixel_values, labels=None):
        h = self.body(pixel_values)
        pred = self.classifier(self.bn(h) if self.bn is not None else h).squeeze(-1)
        loss = 0.5 * ((pred - labels) ** 2).mean() if labels is not None else None
        return ImageClassifierOutput(loss=loss, logits=pred[:, None])


class SquaredError(Metric):
    """The toy's metric: the summed squared error per example (``loss``), no accuracy."""

    def update(self, logits, batch):
        self.loss_sum += float(((logits[:, 0] - batch["labels"]) ** 2).sum())
        self.n += len(batch["labels"])


class TinyMLP(nn.Module):
    """No convolution (the vectorized step's summed-loss backward, not vmap(grad)), with BatchNorm1d; 3x16x16
    images. Its loss is :meth:`task_loss` (cross-entropy), which a subclass may route through a declared loss."""

    def __init__(self, num_labels=10):
        super().__init__()
        self.fc = nn.Linear(3 * 16 * 16, 16)
        self.bn = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, num_labels)

    def task_loss(self, logits, labels):
        return nn.functional.cross_entropy(logits, labels)

    def forward(self, pixel_values, labels=None):
        logits = self.head(torch.relu(self.bn(self.fc(pixel_values.flatten(1)))))
        loss = self.task_loss(logits, labels) if labels is not None else None
        return ImageClassifierOutput(loss=loss, logits=logits)
