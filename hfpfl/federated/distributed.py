"""Clients sharded over accelerate processes.

Each client has one owner process for the whole run (so its private state lives in one place), fixed by
:class:`Ownership` from what every process already knows: each client's number of examples. The assignment is the
greedy longest-processing-time rule (clients by cost, largest first, each to the least-loaded process), so under a
skewed split (Dir(0.1): a few clients hold most images) every process trains and evaluates about the same number of
examples, instead of ``client i -> process i % N`` leaving one process idle at the barrier.
Streaming aggregation all-reduces running sums (O(model) traffic and memory); methods that need every upload get
them gathered on the main process, which aggregates once and broadcasts the new server state (uploads sorted by
client id, the same list for any number of processes). Running sums are added per process and then across
processes: the same float64 terms in another order, which can change a float64 sum's last bits (and, rarely, a float32
weight's last bit after the cast; one process is unchanged).
"""
from __future__ import annotations

from accelerate import Accelerator
from accelerate.utils import gather_object


class Ownership:
    """Which process owns each client: computed once per run, identically on every process, never changed.

    ``costs[i]``: client ``i``'s work (the engine uses ``3 * train examples + test examples``: one local epoch's
    forward + backward is about three forward passes per image, evaluation one). Clients are split by greedy
    longest-processing-time: sorted by cost (largest first, ties by id), each goes to the process with the least
    cost so far (ties: the lowest rank). ``groups`` balance separately (ids in one group are worked on together:
    the training clients each round, the held-out new clients at the final evaluation). With one process every
    client is owned by rank 0."""

    def __init__(self, costs, world_size: int = 1, rank: int = 0, groups=None):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size} processes")
        self.world_size, self.rank = int(world_size), int(rank)
        costs = [float(c) for c in costs]
        groups = [list(g) for g in groups] if groups is not None else [list(range(len(costs)))]
        self._owner = [0] * len(costs)
        self.loads = [0.0] * self.world_size   # summed cost per process, over every group
        for ids in groups:
            load = [0.0] * self.world_size
            for c in sorted(ids, key=lambda i: (-costs[i], i)):
                p = min(range(self.world_size), key=lambda r: (load[r], r))
                self._owner[c] = p
                load[p] += costs[c]
                self.loads[p] += costs[c]

    def owner(self, client_id: int) -> int:
        return self._owner[client_id]

    def owns(self, client_id: int) -> bool:
        """Whether this process owns ``client_id``."""
        return self._owner[client_id] == self.rank

    def owned(self, client_ids) -> list[int]:
        """The ids of ``client_ids`` this process owns, in their given order."""
        if self.world_size == 1:
            return list(client_ids)
        return [c for c in client_ids if self._owner[c] == self.rank]

    def share(self, client_ids, costs) -> list[float]:
        """Each process's share of ``costs`` over ``client_ids`` (e.g. a round's training examples)."""
        out = [0.0] * self.world_size
        for c in client_ids:
            out[self._owner[c]] += float(costs[c])
        return out


def all_gather(items: list, accelerator: Accelerator) -> list:
    if accelerator.num_processes == 1:
        return list(items)
    return list(gather_object(list(items)))


def barrier(accelerator: Accelerator) -> None:
    if accelerator.num_processes > 1:
        accelerator.wait_for_everyone()


def gather_to_main(items: list, accelerator: Accelerator) -> list | None:
    """Every process's items on the main process (None elsewhere): server work that needs every upload runs once."""
    if accelerator.num_processes == 1:
        return list(items)
    import torch.distributed as dist
    out = [None] * accelerator.num_processes if accelerator.is_main_process else None
    dist.gather_object(list(items), out, dst=0)
    return [x for part in out for x in part] if accelerator.is_main_process else None


def broadcast_from_main(obj, accelerator: Accelerator):
    """The main process's object on every process."""
    if accelerator.num_processes == 1:
        return obj
    import torch.distributed as dist
    box = [obj if accelerator.is_main_process else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def batch_shard(num_rows: int, batch_size: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of ``rank``'s contiguous share of a split's whole batches (the batches one process
    forms: ``[0, b), [b, 2b), ...``), the first ``num_batches % world_size`` ranks one batch more."""
    nb = -(-num_rows // batch_size)
    per, extra = divmod(nb, world_size)
    lo = rank * per + min(rank, extra)
    hi = lo + per + (1 if rank < extra else 0)
    return min(lo * batch_size, num_rows), min(hi * batch_size, num_rows)


class _PerBatch:
    """A metric wrapper that keeps each batch's numbers (the wrapped metric's state after ``reset`` + one
    ``update``) instead of their running sum."""

    def __init__(self, metric, rows: list):
        self.metric, self.rows = metric, rows

    def reset(self) -> None:
        pass

    def update(self, logits, batch) -> None:
        self.metric.reset()
        self.metric.update(logits, batch)
        self.rows.append(dict(vars(self.metric)))

    def compute(self) -> dict:
        return {}


def evaluate_sharded(evaluate, data, metric, batch_size: int, accelerator: Accelerator) -> dict:
    """``evaluate(data, metric)`` (a split scored by one model) with the split's batches shared out: each process
    scores a contiguous run of whole batches (the same batches, so the same logits as one process), the per-batch
    sums of every process are gathered in batch order and added up from ``reset``'s zeros, as one process adds them:
    the same numbers, to the bit (integer counts and float sums alike). One process, or a metric whose state is not
    plain numbers: ``evaluate(data, metric)`` on the whole split."""
    metric.reset()
    fields = dict(vars(metric))
    if accelerator.num_processes == 1 or not fields or not all(type(v) in (int, float) for v in fields.values()):
        return evaluate(data, metric)
    start, stop = batch_shard(len(data), batch_size, accelerator.num_processes, accelerator.process_index)
    rows: list[dict] = []
    if stop > start:
        evaluate(data.rows(start, stop), _PerBatch(metric, rows))
    metric.reset()
    for row in all_gather(rows, accelerator):  # rank order = batch order
        for k in fields:
            setattr(metric, k, getattr(metric, k) + row[k])
    return metric.compute()
