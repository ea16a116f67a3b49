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
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

LABEL_KEYS = ("labels",)


# images in [-1, 1] that came from 8-bit pixels: x = u * (2/255) - 1 exactly (transforms.to_model_inputs)
def _decode_uint8(u: torch.Tensor) -> torch.Tensor:
    return u.float() * (2.0 / 255.0) - 1.0


def encode_uint8(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` as the 8-bit pixels it was made from (``x = u * 2/255 - 1``), or None when that is not exact: a
    client's images take a quarter of the memory and are converted per batch, bit for bit the same floats."""
    if x.dtype != torch.float32 or x.numel() == 0:
        return None
    u = ((x + 1.0) * 127.5).round_()
    if not bool(((u >= 0) & (u <= 255)).all()):
        return None
    u = u.to(torch.uint8)
    return u if torch.equal(_decode_uint8(u), x) else None


class TensorData:
    """A split as in-memory tensors, one per column, batched together (fast batching, no per-row Arrow decoding).

    ``TensorData(pixel_values, labels)`` for the classic image-classification split; ``TensorData.of(**columns)``
    for any dict of same-length tensors (VQA: input_ids, attention_mask, pixel_values, labels). ``extras`` are more
    per-sample columns (e.g. teacher logits for distillation). ``TensorData.from_dataset`` stores images that came
    from 8-bit pixels as uint8 and converts them per batch (exactly the same floats), which keeps 10,000 clients'
    data small; ``columns`` / ``pixel_values`` always give the model-input floats."""

    def __init__(self, pixel_values: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                 extras: dict[str, torch.Tensor] | None = None):
        cols = {}
        if pixel_values is not None:
            cols["pixel_values"] = pixel_values
        if labels is not None:
            cols["labels"] = labels
        cols.update(extras or {})
        if not cols:
            raise ValueError("TensorData needs at least one column")
        n = {len(v) for v in cols.values()}
        if len(n) != 1:
            raise ValueError(f"TensorData columns differ in length: { {k: len(v) for k, v in cols.items()} }")
        self._stored: dict[str, torch.Tensor] = cols
        self._encoded: set[str] = set()      # columns stored as uint8 pixels
        self._len = n.pop()                  # asked hundreds of times a round by the engine's bookkeeping

    @classmethod
    def of(cls, **columns: torch.Tensor) -> "TensorData":
        return cls(extras=columns)

    def compress(self) -> "TensorData":
        """Store float image columns that came from 8-bit pixels as uint8 (in place; returns self)."""
        for k, v in list(self._stored.items()):
            if k not in self._encoded and k == "pixel_values":
                u = encode_uint8(v)
                if u is not None:
                    self._stored[k] = u
                    self._encoded.add(k)
        return self

    def _col(self, k: str, idx=None) -> torch.Tensor:
        v = self._stored[k] if idx is None else self._stored[k][idx]
        return _decode_uint8(v) if k in self._encoded else v

    @property
    def columns(self) -> dict[str, torch.Tensor]:
        return {k: self._col(k) for k in self._stored}

    @property
    def pixel_values(self) -> torch.Tensor:
        return self._col("pixel_values")

    @property
    def labels(self) -> torch.Tensor:
        return self._col("labels")

    @property
    def extras(self) -> dict[str, torch.Tensor]:
        return {k: self._col(k) for k in self._stored if k not in ("pixel_values", "labels")}

    def __len__(self) -> int:
        return self._len

    def rows(self, start: int, stop: int) -> "TensorData":
        """Rows ``[start, stop)`` as a TensorData sharing this one's storage (views; uint8 images stay uint8)."""
        out = TensorData(extras={k: v[start:stop] for k, v in self._stored.items()})
        out._encoded = set(self._encoded)
        return out

    def select(self, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        return {k: self._col(k, idx) for k in self._stored}

    def nbytes(self) -> int:
        """Bytes held (uint8 images count one byte per pixel)."""
        return sum(v.numel() * v.element_size() for v in self._stored.values())

    @classmethod
    def from_dataset(cls, ds, columns: Sequence[str] | None = None, compress: bool = True) -> "TensorData":
        """All (or the named) tensor columns of a ``datasets.Dataset`` in model-input format (images from 8-bit
        pixels stored as uint8 unless ``compress=False``)."""
        if len(ds) == 0:
            raise ValueError("a client split is empty; use fewer clients, a larger alpha or min_partition_size")
        columns = list(columns) if columns is not None else [c for c in ("pixel_values", "labels")
                                                               if c in ds.column_names] or list(ds.column_names)
        cols = _arrow_columns(ds, columns)
        if cols is None:
            cols = ds.with_format("torch", columns=columns)[:]
        out = {}
        for k in columns:
            v = cols[k]
            if k == "pixel_values":
                v = v.float()
            elif k == "labels" and not torch.is_floating_point(v):
                v = v.long()
            out[k] = v.contiguous()
        data = cls(extras=out)
        return data.compress() if compress else data


def _arrow_columns(ds, columns) -> dict | None:
    """Numeric and fixed-shape array columns straight from the Arrow table (one numpy view per column, instead of
    the torch formatter's per-row conversion, which costs ~1 ms per image); None if a column is anything else."""
    try:
        import pyarrow as pa
        table = ds.with_format("arrow")[:]
        out = {}
        for k in columns:
            col = table.column(k).combine_chunks()
            shape = getattr(col.type, "shape", None)
            arr = col.storage if isinstance(col, pa.ExtensionArray) else col
            while pa.types.is_list(arr.type) or pa.types.is_fixed_size_list(arr.type) or pa.types.is_large_list(arr.type):
                if arr.null_count:
                    return None
                arr = arr.flatten()
            if not (pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type)) or arr.null_count:
                return None
            x = arr.to_numpy(zero_copy_only=False)
            n = len(table)
            if shape is not None:
                x = x.reshape(n, *shape)
            elif len(x) != n:
                return None
            out[k] = torch.from_numpy(x.copy())
        return out
    except Exception:  # noqa: BLE001 - any other layout: the datasets formatter
        return None


# A trailing batch smaller than this joins the previous batch during training. BatchNorm normalises each channel over
# batch x height x width; at a 1x1 stage (the tiny ResNet's last stage on 32x32 images) a batch of k images gives k
# values per channel, so k = 2 maps every channel to exactly +-1 and k = 1 crashes. One such step per epoch was enough
# to keep the label-skew FedBiP comparison's Central oracle at chance: 290 pooled images = 9 x 32 + 2 (measured,
# seed 0: trailing 2 -> 0.15, 3 -> 0.49, 4 -> 0.66, 6..16 and 0 -> 0.69-0.77 mean accuracy).
MIN_TRAIN_BATCH = 8


def batch_bounds(n: int, batch_size: int, merge_small_last: bool = True) -> list[tuple[int, int]]:
    """(start, end) of every batch over ``n`` items. With ``merge_small_last`` a trailing batch of fewer than
    ``min(MIN_TRAIN_BATCH, batch_size)`` items joins the previous one (training: BatchNorm cannot learn from a handful of
    images); evaluation keeps every batch as it is. The single rule behind :func:`iterate_batches`, the vectorized
    engine's schedules and FedDAT's step counts."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    starts = list(range(0, n, batch_size))
    # a full batch never merges: with --batch_size 4 or 5 every batch keeps the size the user asked for
    if merge_small_last and len(starts) > 1 and n - starts[-1] < min(MIN_TRAIN_BATCH, batch_size):
        starts.pop()  # the last few samples join the previous batch
    return [(s, starts[i + 1] if i + 1 < len(starts) else n) for i, s in enumerate(starts)]


def iterate_batches(data: TensorData, batch_size: int, *, shuffle: bool, generator: torch.Generator | None = None,
                    merge_small_last: bool = True, drop_singleton: bool | None = None) -> Iterator[dict]:
    """Yield dict batches. A trailing batch of fewer than ``min(MIN_TRAIN_BATCH, batch_size)`` samples is merged
    into the previous one (``merge_small_last``; ``drop_singleton`` is its old name, kept for callers that pass it)."""
    if drop_singleton is not None:
        merge_small_last = drop_singleton
    n = len(data)
    order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
    for s, e in batch_bounds(n, batch_size, merge_small_last):
        yield data.select(order[s:e])


def model_inputs(batch: dict) -> dict:
    """The batch minus its targets: what the model's forward takes."""
    return {k: v for k, v in batch.items() if k not in LABEL_KEYS and not k.startswith("teacher_")}


def default_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """The HF model's own loss (cross-entropy for classifiers; BCE on soft targets for ViLT VQA)."""
    return model(**model_inputs(batch), labels=batch["labels"]).loss


# ---------------------------------------------------------------------------------------------- optimizers
def make_optimizer(params: Iterable, name: str, lr: float, momentum: float = 0.0,
                   weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """An optimizer over a parameter list or over parameter groups (dicts with ``params`` and per-group options,
    e.g. FedPCE's embedding / MLP / base learning rates)."""
    params = list(params)
    if params and isinstance(params[0], dict):
        groups = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in params]
        groups = [g for g in groups if g["params"]]
    else:
        groups = [{"params": [p for p in params if p.requires_grad]}]
        groups = groups if groups[0]["params"] else []
    if not groups:
        raise ValueError("nothing to train: the parameter list is empty (are all parameters frozen?)")
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(groups, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; choose one of: sgd, adam, adamw")


def optimizer_state_tensors(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, torch.Tensor]:
    """An optimizer's per-parameter state as a flat tensor dict keyed ``<param name>.<field>`` (Adam's ``step``,
    ``exp_avg``, ...; SGD's ``momentum_buffer``): storable per client and in safetensors checkpoints.
    ``names`` maps ``id(param)`` to the parameter's name."""
    out = {}
    for p, st in optimizer.state.items():
        for field, v in st.items():
            if v is None:
                continue
            t = v if torch.is_tensor(v) else torch.tensor(v)
            # contiguous: a buffer made while the weight was channels_last (conv_channels_last) must still save
            out[f"{names[id(p)]}.{field}"] = t.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)
    return out


@torch.no_grad()
def load_optimizer_state(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor],
                         names: dict[int, str]) -> None:
    """Inverse of :func:`optimizer_state_tensors` (state for parameters it does not name stays fresh)."""
    if not tensors:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            prefix = names[id(p)] + "."
            st = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix) and "." not in k[len(prefix):]}
            if st:
                optimizer.state[p] = {f: (v.to(p.device) if f != "step" else v.clone()) for f, v in st.items()}


# ---------------------------------------------------------------------------------------------- the loop
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
                scheduler=None, after_step: Callable[[int], None] | None = None) -> dict:
    """Run local steps; `epochs` passes over the data, or exactly `max_steps` steps if given.

    With several optimizers (a list, with one loss function each), every step runs the stages in order on the
    same batch; ``train_loss`` is the last stage's loss. ``regularizer`` and ``before_step`` act on every stage."""
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
        for batch in iterate_batches(data, batch_size, shuffle=True, generator=generator):
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


# ---------------------------------------------------------------------------------------------- metrics
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
    for batch in iterate_batches(data, batch_size, shuffle=False, merge_small_last=False):
        batch = {k: v.to(device) for k, v in batch.items()}
        metric.update(model(**model_inputs(batch)).logits, batch)
    if was_training:
        model.train()
    return metric.compute()
