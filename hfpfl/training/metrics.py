"""How a task scores a model on a split (:class:`Metric`, the default accuracy and cross-entropy; VQA's soft-target
accuracy) and :func:`evaluate`."""
from __future__ import annotations

import torch
from torch import nn

from .tensor_data import TensorData, iterate_batches, model_inputs


class Metric:
    """How a task scores a model on a split: ``update(logits, batch)`` per batch, ``compute()`` at the end.
    The default is classification accuracy and mean cross-entropy (``accuracy``, ``loss``). State that ``reset``
    sets to numbers is a running sum over batches (``update`` adds each batch's share): several processes then
    score a split's batches between them and add the per-batch numbers in batch order (the same result as one
    process). A metric with other state (lists, tensors) is computed whole on every process."""

    def reset(self) -> None:
        self.correct, self.loss_sum, self.n = 0.0, 0.0, 0

    def update(self, logits: torch.Tensor, batch: dict) -> None:
        labels = batch["labels"]
        self.loss_sum += float(nn.functional.cross_entropy(logits, labels, reduction="sum"))
        self.correct += float((logits.argmax(-1) == labels).sum())
        self.n += len(labels)

    def compute(self) -> dict:
        return {"accuracy": self.correct / max(self.n, 1), "loss": self.loss_sum / max(self.n, 1), "num_samples": self.n}


class SoftTargetAccuracy(Metric):
    """VQA accuracy: the soft target score (min(#annotators / 3, 1)) of the predicted answer; loss is BCE with
    logits summed over answers (ViLT's training loss)."""

    def update(self, logits, batch):
        targets = batch["labels"].float()
        pred = logits.argmax(-1)
        self.correct += float(targets.gather(1, pred[:, None]).sum())
        self.loss_sum += float(nn.functional.binary_cross_entropy_with_logits(logits, targets, reduction="none")
                               .sum(-1).sum())
        self.n += len(targets)


@torch.no_grad()
def evaluate(model: nn.Module, data: TensorData, *, batch_size: int = 256, device="cpu",
             metric: Metric | None = None) -> dict:
    """Score a model on a split with ``metric`` (default: accuracy and mean cross-entropy)."""
    was_training = model.training
    if was_training:  # (walking the module tree costs as much as a small model's forward)
        model.eval()
    metric = metric or Metric()
    metric.reset()
    for batch in iterate_batches(data, batch_size, shuffle=False, last="keep"):
        batch = {k: v.to(device) for k, v in batch.items()}
        metric.update(model(**model_inputs(batch)).logits, batch)
    if was_training:
        model.train()
    return metric.compute()
