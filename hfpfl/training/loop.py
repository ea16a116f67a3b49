"""The one local training loop (:func:`train_local`) with its hooks, and the channels_last setting of its
convolutions."""
from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch
from torch import nn

from .tensor_data import TensorData, iterate_batches, model_inputs


def default_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """The HF model's own loss (cross-entropy for classifiers; BCE on soft targets for ViLT VQA)."""
    return model(**model_inputs(batch), labels=batch["labels"]).loss


def declared_loss(model: nn.Module):
    """The loss ``model`` declares as a function of its outputs, ``fn(logits, labels) -> the mean of the examples'
    losses``, or None. Transformers' convention: a ``PreTrainedModel`` whose ``loss_type`` names a loss of
    ``transformers.loss.loss_utils.LOSS_MAPPING`` computes its loss as ``self.loss_function(labels, logits,
    self.config)``; any other ``nn.Module`` may declare ``loss_function(logits, labels)`` itself. The vectorized
    engine computes such a loss once over every client's logits, outside ``vmap`` (one flat cross-entropy instead of
    one per client); a model without one keeps its own ``loss`` inside ``vmap``."""
    fn = getattr(model, "loss_function", None)
    config = getattr(model, "config", None)
    if config is not None and hasattr(model, "loss_type"):  # a transformers model: its loss_type picks the function
        from transformers.loss.loss_utils import LOSS_MAPPING  # why: transformers only when the model is one

        if getattr(model, "loss_type", None) not in ("ForImageClassification", "ForSequenceClassification") or \
                model.loss_type not in LOSS_MAPPING or getattr(config, "problem_type", None) not in \
                (None, "single_label_classification") or getattr(config, "num_labels", 0) < 2:
            return None  # regression, multi-label and the other heads keep their own loss
        loss = LOSS_MAPPING[model.loss_type]
        return lambda logits, labels: loss(labels, logits, config)
    return fn if callable(fn) else None


def _onednn_unsafe(conv: nn.Conv2d) -> bool:
    """A 1x1 convolution with stride > 1 and fewer than 16 input channels corrupted the heap in oneDNN's
    channels_last backward here (a oneDNN bug, #6035 in its tracker): such a weight stays contiguous."""
    return conv.kernel_size == (1, 1) and max(conv.stride) > 1 and conv.in_channels < 16


def channels_last_pays(model: nn.Module, setting: str, device) -> bool:
    """Whether ``--channels_last`` (auto | on | off) applies to ``model`` on ``device``: only on the CPU (oneDNN).
    ``auto``: only models whose convolutions all have stride 1 (PFLlib's CNN: a training step 0.75x the time). Strided
    models (the tiny ResNet, 0.85x a step, 0.5x an evaluation batch here) gain too, but the README's and docs' tables
    were run with their contiguous weights and reproduce bit for bit only so: ``on`` opts them in. Gradients agree
    to float precision either way (1e-6 relative on 32 px inputs; 1e-4 on 16 px ones, where the sums are large)."""
    if setting == "off" or torch.device(device).type != "cpu":
        return False
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    if setting == "on":
        return bool(convs)
    return bool(convs) and all(max(m.stride) == 1 for m in convs)


@contextlib.contextmanager
def conv_channels_last(model: nn.Module, enabled: bool = True):
    """Train with every ``nn.Conv2d`` weight in channels_last memory format, and put the values back into the
    original (contiguous) tensors afterwards, so that everything outside the block (the engine's cached state dict,
    checkpoints, uploads) sees the same tensors as before. On the CPU, oneDNN's channels_last convolutions are
    faster for small convolutional models: PFLlib's CNN, batch 10, 1 thread: a training step took 0.75x the time
    (CHANGELOG.md). The arithmetic order differs, so results differ in their last float bits (1.5e-8 after
    60 SGD steps, measured). Which models get it: :func:`channels_last_pays`."""
    swapped = []
    if enabled:
        for m in model.modules():
            if isinstance(m, nn.Conv2d) and m.weight.dim() == 4 and not _onednn_unsafe(m):
                orig = m.weight.data   # (empty_like: channels_last strides even where C == 1 makes both formats fit)
                m.weight.data = torch.empty_like(orig, memory_format=torch.channels_last).copy_(orig)
                swapped.append((m.weight, orig))
    try:
        yield
    finally:
        with torch.no_grad():
            for p, orig in swapped:
                orig.copy_(p.data)
                p.data = orig
                if p.grad is not None:
                    p.grad = p.grad.contiguous()


def train_local(model: nn.Module, data: TensorData, optimizer, *, batch_size: int,
                epochs: int = 1, max_steps: int | None = None, generator: torch.Generator | None = None,
                device: torch.device | str = "cpu",
                loss_fn: Callable[[nn.Module, dict], torch.Tensor] | Sequence[Callable] = default_loss,
                regularizer: Callable[[nn.Module], torch.Tensor] | None = None,
                before_step: Callable[[nn.Module], None] | None = None,
                backward: Callable[[torch.Tensor], None] | None = None,
                scheduler=None, after_step: Callable[[int], None] | None = None, last_batch: str = "merge") -> dict:
    """Run local steps; `epochs` passes over the data, or exactly `max_steps` steps if given.

    With several optimizers (a list, with one loss function each), every step runs the stages in order on the
    same batch; ``train_loss`` is the last stage's loss. ``regularizer`` and ``before_step`` act on every stage.
    ``last_batch``: what becomes of a trailing partial batch (:func:`~hfpfl.training.batch_bounds`)."""
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    loss_fns = list(loss_fn) if isinstance(loss_fn, (list, tuple)) else [loss_fn]
    if len(optimizers) != len(loss_fns):
        raise ValueError(f"{len(optimizers)} optimizers need as many loss functions, got {len(loss_fns)}")
    model.train()
    steps, examples, loss_sum = 0, 0, 0.0
    # on an accelerator the loss is summed where it is (float64, the same adds as Python's float): reading it every
    # step would wait for the device every step
    on_device = torch.device(device).type != "cpu"
    while True:
        for batch in iterate_batches(data, batch_size, shuffle=True, generator=generator, last=last_batch):
            batch = {k: v.to(device) for k, v in batch.items()}
            for opt, fn in zip(optimizers, loss_fns):
                opt.zero_grad(set_to_none=True)
                loss = fn(model, batch)
                task_loss = loss.detach()
                if regularizer is not None:
                    loss = loss + regularizer(model)
                (backward or torch.Tensor.backward)(loss)
                if before_step is not None:
                    before_step(model)
                opt.step()
            if scheduler is not None:
                scheduler.step()
            steps += 1
            examples += len(next(iter(batch.values())))  # every column of a batch has one row per example
            loss_sum = loss_sum + task_loss.double() if on_device else loss_sum + float(task_loss)
            if after_step is not None:
                after_step(steps)
            if max_steps is not None and steps >= max_steps:
                return {"train_loss": float(loss_sum) / steps, "steps": steps, "examples": examples}
        epochs -= 1
        if max_steps is None and epochs <= 0:
            return {"train_loss": float(loss_sum) / max(steps, 1), "steps": steps, "examples": examples}
