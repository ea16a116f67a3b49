"""The one local-training loop every method uses, and evaluation.

Methods customise it through small hooks instead of copying it:
- ``loss_fn(model, batch) -> loss``           (default: the HF model's own loss from ``labels``)
- ``regularizer(model) -> loss``              (FedProx / Ditto / PerAda proximal terms, ...)
- ``before_step(model) -> None``              (gradient corrections, e.g. SCAFFOLD's control variates)
- ``scheduler`` / ``after_step(step)``         (learning-rate schedules; checkpoint selection, e.g. server-side KD)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch
from torch import nn


@dataclass
class TensorData:
    """A client's split as in-memory tensors (fast batching on CPU, no per-row Arrow decoding).

    ``extras`` are more per-sample tensors batched alongside (e.g. teacher logits for distillation)."""

    pixel_values: torch.Tensor
    labels: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.labels)

    @classmethod
    def from_dataset(cls, ds) -> "TensorData":
        if len(ds) == 0:
            raise ValueError("a client split is empty; use fewer clients, a larger alpha or min_partition_size")
        cols = ds.with_format("torch", columns=["pixel_values", "labels"])[:]
        return cls(cols["pixel_values"].float().contiguous(), cols["labels"].long().contiguous())


def iterate_batches(data: TensorData, batch_size: int, *, shuffle: bool, generator: torch.Generator | None = None,
                    drop_singleton: bool = True) -> Iterator[dict]:
    """Yield {pixel_values, labels} batches. A trailing batch of one is merged away: BatchNorm cannot train on it."""
    n = len(data)
    order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
    starts = list(range(0, n, batch_size))
    if drop_singleton and len(starts) > 1 and n - starts[-1] == 1:
        starts.pop()  # the last sample joins the previous batch
    for i, s in enumerate(starts):
        e = starts[i + 1] if i + 1 < len(starts) else n
        idx = order[s:e]
        yield {"pixel_values": data.pixel_values[idx], "labels": data.labels[idx],
               **{k: v[idx] for k, v in data.extras.items()}}


def default_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(pixel_values=batch["pixel_values"], labels=batch["labels"]).loss


def make_optimizer(params: Iterable[torch.nn.Parameter], name: str, lr: float, momentum: float = 0.0,
                   weight_decay: float = 0.0) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("nothing to train: the parameter list is empty (are all parameters frozen?)")
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; choose one of: sgd, adam, adamw")


def train_local(model: nn.Module, data: TensorData, optimizer: torch.optim.Optimizer, *, batch_size: int,
                epochs: int = 1, max_steps: int | None = None, generator: torch.Generator | None = None,
                device: torch.device | str = "cpu",
                loss_fn: Callable[[nn.Module, dict], torch.Tensor] = default_loss,
                regularizer: Callable[[nn.Module], torch.Tensor] | None = None,
                before_step: Callable[[nn.Module], None] | None = None,
                backward: Callable[[torch.Tensor], None] | None = None,
                scheduler=None, after_step: Callable[[int], None] | None = None) -> dict:
    """Run local SGD steps; `epochs` passes over the data, or exactly `max_steps` steps if given."""
    model.train()
    steps, loss_sum = 0, 0.0
    while True:
        for batch in iterate_batches(data, batch_size, shuffle=True, generator=generator):
            batch = {k: v.to(device) for k, v in batch.items()}
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model, batch)
            task_loss = loss.detach()
            if regularizer is not None:
                loss = loss + regularizer(model)
            (backward or torch.Tensor.backward)(loss)
            if before_step is not None:
                before_step(model)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            steps += 1
            loss_sum += float(task_loss)
            if after_step is not None:
                after_step(steps)
            if max_steps is not None and steps >= max_steps:
                return {"train_loss": loss_sum / steps, "steps": steps}
        epochs -= 1
        if max_steps is None and epochs <= 0:
            return {"train_loss": loss_sum / max(steps, 1), "steps": steps}


@torch.no_grad()
def evaluate(model: nn.Module, data: TensorData, *, batch_size: int = 256, device="cpu") -> dict:
    """Accuracy and mean cross-entropy of a classifier on a split."""
    was_training = model.training
    model.eval()
    correct, loss_sum, n = 0, 0.0, 0
    for batch in iterate_batches(data, batch_size, shuffle=False, drop_singleton=False):
        logits = model(pixel_values=batch["pixel_values"].to(device)).logits
        labels = batch["labels"].to(device)
        loss_sum += float(nn.functional.cross_entropy(logits, labels, reduction="sum"))
        correct += int((logits.argmax(-1) == labels).sum())
        n += len(labels)
    model.train(was_training)
    return {"accuracy": correct / max(n, 1), "loss": loss_sum / max(n, 1), "num_samples": n}
