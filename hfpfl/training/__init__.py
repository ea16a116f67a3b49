"""The one training loop every method (and the model zoo's pretraining) uses, evaluation, and optimizer helpers.

This module sits below both the FL engine (:mod:`hfpfl.federated`) and the models (:mod:`hfpfl.models`): it knows
nothing about clients or rounds. Methods customise the loop through small hooks instead of copying it:

- ``loss_fn(model, batch) -> loss``        (default: the HF model's own loss from the batch's ``labels``)
- ``regularizer(model) -> loss``           (FedProx / Ditto / PerAda proximal terms, ...)
- ``before_step(model) -> None``           (gradient corrections, e.g. SCAFFOLD's control variates)
- ``scheduler`` / ``after_step(step)``      (learning-rate schedules; checkpoint selection, e.g. server-side KD)
- several optimizers: ``optimizer=[opt_a, opt_b]`` with ``loss_fn=[fn_a, fn_b]`` runs the stages one after the
  other inside every local step (FRAug's generator stage, then its classifier stage).

Batches are dicts of tensors (``pixel_values`` + ``labels`` for image classification; ``input_ids``,
``attention_mask``, ``pixel_values`` and soft answer targets for VQA); a :class:`Metric` says how to score them.

Layout: :mod:`.tensor_data` (a split as tensors, and its batches), :mod:`.loop` (:func:`train_local`),
:mod:`.optimizers` (building one, and its state as tensors), :mod:`.metrics` (:class:`Metric`, :func:`evaluate`).
"""
from .loop import channels_last_pays, conv_channels_last, declared_loss, default_loss, train_local
from .metrics import Metric, SoftTargetAccuracy, evaluate
from .optimizers import load_optimizer_state, make_optimizer, optimizer_state_tensors
from .tensor_data import (LABEL_KEYS, MIN_TRAIN_BATCH, TensorData, batch_bounds, encode_uint8, iterate_batches,
                          model_inputs)

__all__ = [
    "LABEL_KEYS", "MIN_TRAIN_BATCH", "Metric", "SoftTargetAccuracy", "TensorData", "batch_bounds", "channels_last_pays",
    "conv_channels_last", "declared_loss", "default_loss", "encode_uint8", "evaluate", "iterate_batches", "load_optimizer_state",
    "make_optimizer", "model_inputs", "optimizer_state_tensors", "train_local",
]
