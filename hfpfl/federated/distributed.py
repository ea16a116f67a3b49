"""Clients sharded over accelerate processes; every process sees every upload and aggregates identically.

Client i is owned by process i % world_size for the whole run, so its private state lives in one place.
Uploads are exchanged with `gather_object` and sorted by client id, so the server's arithmetic (and hence
every metric) is identical for any number of processes.
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
