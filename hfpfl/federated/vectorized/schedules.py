"""Every client's batches of a vectorized chunk, drawn exactly as the sequential loop draws them."""
from __future__ import annotations

import torch

from ...training import batch_bounds


def batch_schedule(n: int, batch_size: int, epochs: int, max_steps: int | None,
                   generator: torch.Generator, last: str = "merge") -> list[torch.Tensor]:
    """The index batches :func:`hfpfl.training.train_local` would draw, in order (same generator calls)."""
    out = []
    while True:
        order = torch.randperm(n, generator=generator)
        for s, e in batch_bounds(n, batch_size, last):
            out.append(order[s:e])
            if max_steps is not None and len(out) >= max_steps:
                return out
        epochs -= 1
        if max_steps is None and epochs <= 0:
            return out


def schedule_spans(n: int, batch_size: int, epochs: int, max_steps: int | None,
                   last: str = "merge") -> tuple[int, list[tuple[int, int]]]:
    """:func:`batch_schedule` without drawing: ``(draws, spans)``, where the schedule's ``randperm(n)`` draws,
    concatenated, hold batch ``j`` at ``[start, start + size)`` for ``(start, size) = spans[j]`` (the same loop,
    so the same number of draws from the generator)."""
    bounds = batch_bounds(n, batch_size, last)
    spans, draws = [], 0
    while True:
        off = draws * n
        draws += 1
        for s, e in bounds:
            spans.append((off + s, e - s))
            if max_steps is not None and len(spans) >= max_steps:
                return draws, spans
        epochs -= 1
        if max_steps is None and epochs <= 0:
            return draws, spans


class BatchSchedules:
    """Every client's batches of a vectorized chunk, drawn as the sequential loop draws them (one generator per
    client, seeded with ``seed_for(round, client, "")``, ``randperm`` per epoch), kept as one padded index matrix
    ``[clients, draws * n]``: a step's group of clients gets its batches with one indexing call instead of one
    slice per client."""

    def __init__(self, sizes: list[int], seeds: list[int], batch_size: int, epochs: int, max_steps: int | None,
                 last: str = "merge"):
        by_n: dict[int, tuple[int, list]] = {}
        gen = torch.Generator()  # re-seeded per client: the draws of a fresh generator seeded the same
        flats = []
        for n, seed in zip(sizes, seeds):
            if n not in by_n:
                by_n[n] = schedule_spans(n, batch_size, epochs, max_steps, last)
            draws = by_n[n][0]
            gen.manual_seed(seed)
            flats.append(torch.randperm(n, generator=gen) if draws == 1 else
                         torch.cat([torch.randperm(n, generator=gen) for _ in range(draws)]))
        self.spans = [by_n[n][1] for n in sizes]
        self.n_steps = [len(sp) for sp in self.spans]
        self.uniform = len(by_n) == 1  # every client has the same spans: every step is one group of everyone
        width = max(len(f) for f in flats)
        if all(len(f) == width for f in flats):
            self.index = torch.stack(flats)
        else:
            self.index = torch.zeros(len(flats), width, dtype=flats[0].dtype)
            for i, f in enumerate(flats):
                self.index[i, :len(f)] = f

    def groups(self, step: int) -> list[tuple[list[int], torch.Tensor]]:
        """``(members, idx)`` per batch size at ``step``, smallest size first: the clients that still have a batch
        and their sample indices ``[len(members), size]``."""
        if self.uniform:
            if step >= self.n_steps[0]:
                return []
            start, size = self.spans[0][step]
            return [(list(range(len(self.spans))), self.index[:, start:start + size])]
        by_size: dict[int, list[int]] = {}
        for i, sp in enumerate(self.spans):
            if step < len(sp):
                by_size.setdefault(sp[step][1], []).append(i)
        out = []
        for size, members in sorted(by_size.items()):
            starts = torch.tensor([self.spans[i][step][0] for i in members])
            rows = torch.tensor(members)
            out.append((members, self.index[rows[:, None], starts[:, None] + torch.arange(size)]))
        return out

