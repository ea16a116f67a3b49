"""A split as in-memory tensors (:class:`TensorData`: images kept as their 8-bit pixels where exact) and its
batches: the one batching rule (:func:`batch_bounds`) and the model's inputs of a batch."""
from __future__ import annotations

from typing import Iterator, Sequence

import torch

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
        import pyarrow as pa  # why: only for a datasets split (`import hfpfl.training` loads torch alone)
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


LAST_BATCH = ("merge", "keep", "drop")


def batch_bounds(n: int, batch_size: int, last: str = "merge") -> list[tuple[int, int]]:
    """(start, end) of every batch over ``n`` items; ``last`` says what becomes of a trailing partial batch:
    ``"merge"``: one of fewer than ``min(MIN_TRAIN_BATCH, batch_size)`` items joins the previous batch (training:
    BatchNorm cannot learn from a handful of images); ``"keep"``: it is a step of its own (PyTorch's DataLoader,
    pfl-research; evaluation); ``"drop"``: it is left out (``drop_last=True``) unless it is the client's only batch,
    so a client smaller than a batch still trains. The single rule behind :func:`iterate_batches`, the vectorized
    engine's schedules and FedDAT's step counts."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if last not in LAST_BATCH:
        raise ValueError(f"last must be one of {LAST_BATCH}, got {last!r}")
    starts = list(range(0, n, batch_size))
    partial = len(starts) > 1 and n - starts[-1] < batch_size
    if last == "drop" and partial:
        return [(s, s + batch_size) for s in starts[:-1]]
    # a full batch never merges: with --batch_size 4 or 5 every batch keeps the size the user asked for
    if last == "merge" and len(starts) > 1 and n - starts[-1] < min(MIN_TRAIN_BATCH, batch_size):
        starts.pop()  # the last few samples join the previous batch
    return [(s, starts[i + 1] if i + 1 < len(starts) else n) for i, s in enumerate(starts)]


def iterate_batches(data: TensorData, batch_size: int, *, shuffle: bool, generator: torch.Generator | None = None,
                    last: str = "merge") -> Iterator[dict]:
    """Yield dict batches in a (seeded) random or the stored order; ``last``: the trailing partial batch, as
    :func:`batch_bounds`."""
    n = len(data)
    order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
    for s, e in batch_bounds(n, batch_size, last):
        yield data.select(order[s:e])


def model_inputs(batch: dict) -> dict:
    """The batch minus its targets: what the model's forward takes."""
    return {k: v for k, v in batch.items() if k not in LABEL_KEYS and not k.startswith("teacher_")}
