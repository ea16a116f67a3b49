"""Clients sharded over accelerate processes.

Client i is owned by process i % world_size for the whole run, so its private state lives in one place.
Streaming aggregation all-reduces running sums (O(model) traffic and memory); methods that need every upload get
them gathered on the main process, which aggregates once and broadcasts the new server state. Either way the
server's arithmetic is the same for any number of processes.
"""
from __future__ import annotations

from accelerate import Accelerator
from accelerate.utils import gather_object


def owner(client_id: int, world_size: int) -> int:
    return client_id % world_size


def owned(client_ids, accelerator: Accelerator) -> list[int]:
    return [c for c in client_ids if owner(c, accelerator.num_processes) == accelerator.process_index]


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
