"""A chunk's client splits stacked into one padded tensor per column, and the per-run cache of those stacks."""
from __future__ import annotations

import weakref

import torch

from ...training.tensor_data import _decode_uint8

# a chunk's client splits are stacked once per round (``[clients, longest split, ...]``, images kept uint8) when
# that takes at most this many bytes; larger data is gathered client by client per step (then compute dominates)
STACK_DATA_BYTES = 64 * 2**20
# the stacks kept for the next round, all chunks of a split together (:func:`stacked_data`). 64 MiB in all took
# the 10,000-client LoRA round's peak RSS from 1.03 to 1.18 GB (scripts/bench_scale_memory.py: a one-round run
# keeps every chunk's stack and reads none again); the rounds it speeds up are of small data
STACK_CACHE_BYTES = 16 * 2**20


class StackedData:
    """A chunk's client splits as one padded tensor per stored column, ``[clients, longest split, *row]`` (images
    stay uint8 and are converted per batch, exactly as :class:`hfpfl.training.TensorData` converts them): every
    step gathers all its clients' batches with one indexing call per column instead of one select per client.
    Rows past a client's split are zeros and are never drawn (training) or never scored (evaluation)."""

    def __init__(self, columns: dict[str, torch.Tensor], encoded: set[str], lengths: list[int]):
        self.columns, self.encoded, self.lengths = columns, encoded, lengths

    @classmethod
    def build(cls, datas: list) -> "StackedData | None":
        """None when the splits do not stack (other columns, row shapes or dtypes) or would take more than
        :data:`STACK_DATA_BYTES`."""
        first = datas[0]
        keys, enc = list(first._stored), first._encoded
        n_max = max(len(d) for d in datas)
        row_bytes = 0
        for k in keys:
            v = first._stored[k]
            row_bytes += v[:1].numel() * v.element_size() if len(v) else 0
        if row_bytes * n_max * len(datas) > STACK_DATA_BYTES:
            return None
        for d in datas:
            if list(d._stored) != keys or d._encoded != enc:
                return None
            for k in keys:
                a, b = d._stored[k], first._stored[k]
                if a.dtype != b.dtype or a.shape[1:] != b.shape[1:]:
                    return None
        cols = {}
        for k in keys:
            v = first._stored[k]
            buf = v.new_zeros((len(datas), n_max, *v.shape[1:]))
            for i, d in enumerate(datas):
                buf[i, :len(d)] = d._stored[k]
            cols[k] = buf
        return cls(cols, set(enc), [len(d) for d in datas])

    def gather(self, rows: torch.Tensor | None, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        """``[len(rows), *idx.shape[1:], *row]`` per column: client ``rows[i]``'s samples ``idx[i]`` (``rows``
        None: every client, in order)."""
        out = {}
        flat_idx = None
        for k, v in self.columns.items():
            if flat_idx is None:  # one index_select on the [clients * n_max, ...] view: ~3x faster than v[rows, idx]
                r = torch.arange(len(v), device=v.device)[:, None] if rows is None else rows.to(v.device)[:, None]
                flat_idx = (r * v.shape[1] + idx.to(v.device)).flatten()
            x = v.flatten(0, 1).index_select(0, flat_idx).view(*idx.shape, *v.shape[2:])
            out[k] = _decode_uint8(x) if k in self.encoded else x
        return out


def stacked_data(sim, clients: list[int], split: str, datas: list) -> StackedData | None:
    """The chunk's stacked ``split``, kept for the next round when the same clients come again (every client
    every round, the common simulation) and rebuilt otherwise.

    Every chunk's stack is kept, up to :data:`STACK_CACHE_BYTES` per split (a split's first stack always, as when
    one stack per split was kept): a round of two chunks (the MLP bench's 500 clients: 467 + 33) rebuilt both stacks
    every round while one stack per split was kept (6.7 of a 40 ms round). A stack that does not fit is rebuilt
    each time it is needed (a round of more chunks than fit keeps its first ones, instead of evicting each stack
    just before it would be read again), and a split's stacks that its last round did not read are dropped when it
    builds a new one (other clients were sampled). The cache holds weak references to the splits, so it never keeps a split alive that the data cache
    let go (``--data_cache_mb``)."""
    cache = sim._stacked_data
    key = (split, tuple(clients))
    hit = cache.get(key)
    if hit is not None and all(ref() is d for ref, d in zip(hit["datas"], datas)):
        hit["round"] = sim.round
        return hit["stack"]
    st = StackedData.build(datas)
    if st is not None and sim.device.type != "cpu":  # on the accelerator once per chunk, not once per step
        st.columns = {k: v.to(sim.device) for k, v in st.columns.items()}
    # this split's stacks that no round read since the last one (sim.round: the last finished round) go: other
    # clients were sampled. Another split's stay (test stacks read every --eval_every rounds)
    for k in [k for k, e in cache.items() if k[0] == split and e["round"] < sim.round - 1 or k == key]:
        del cache[k]
    if st is not None:
        size = sum(v.numel() * v.element_size() for v in st.columns.values())
        held = [e["bytes"] for k, e in cache.items() if k[0] == split]
        if not held or size + sum(held) <= STACK_CACHE_BYTES:
            cache[key] = {"datas": [weakref.ref(d) for d in datas], "stack": st, "bytes": size, "round": sim.round}
    return st
