"""The tensors of the clients' splits, converted once and kept under a memory cap (least recently used first)."""
from __future__ import annotations

from collections import OrderedDict

from ..training import TensorData


class SplitCache:
    """A split's tensors (images as uint8), cached under an LRU cap of ``--data_cache_mb``, once per split object:
    ``TensorData.from_dataset`` depends on the split alone, so clients built on the same Dataset (10,000 clients
    over 1,000 distinct splits) read one copy instead of one each (scripts/bench_scale_memory.py). Each entry keeps
    its split alive, so its id cannot be reused while the entry exists."""

    def __init__(self, cap_mb: float = 0):
        self.cap = cap_mb * 2**20
        self.entries: OrderedDict[int, tuple[object, TensorData]] = OrderedDict()
        self.bytes = 0

    def tensors(self, ds) -> TensorData:
        hit = self.entries.get(id(ds))
        if hit is not None:
            self.entries.move_to_end(id(ds))
            return hit[1]
        t = TensorData.from_dataset(ds)
        self.entries[id(ds)] = (ds, t)
        self.bytes += t.nbytes()
        while self.cap and self.bytes > self.cap and len(self.entries) > 1:
            _, (_, old) = self.entries.popitem(last=False)
            self.bytes -= old.nbytes()
        return t
