"""Which clients train together: clients with the same hyperparameters, in chunks whose stacked state fits a
memory budget."""
from __future__ import annotations

from ..context import HParams
from .heap import PIN_MMAP_CLIENTS, pin_mmap_threshold

# stacked client states per chunk (parameters + buffers + optimizer state), bytes, unless the run says
# (``--vector_chunk_mb``). 64 MiB: PFLlib's CNN, 500 clients, two processes, measured at the same speed as 256 MiB
# with 0.90 instead of 1.25 GB summed PSS (CHANGELOG.md); an MLP 64-64-10 (143 KB a client) fits 467 clients
# a chunk, and 500 of them measured 0.079 s/round at 64 and at 256 MiB
CHUNK_BYTES = 64 * 2**20
# the same on an accelerator: its memory is not the host's RSS, and small chunks leave a GPU idle between calls
# (PFLlib's CNN on one H100: 20 clients Dir(0.1) 0.467 s/round vectorized at 256 MiB, 0.75-1.04 s at 64 MiB; 500 x 5
# images 0.942 s at 256 MiB, 1.733 s at 64 MiB; CHANGELOG.md, two sessions, one run each)
ACCELERATOR_CHUNK_BYTES = 256 * 2**20


def chunks_of(sim, clients: list[int]) -> list[list[int]]:
    """Clients with the same hyperparameters, in chunks whose stacked state fits ``--vector_chunk_mb``
    (:data:`CHUNK_BYTES` on the CPU, :data:`ACCELERATOR_CHUNK_BYTES` on an accelerator, by default)."""
    if len(clients) >= PIN_MMAP_CLIENTS:
        pin_mmap_threshold()
    per_client = 0
    for n, p in sim.model.named_parameters():
        if p.requires_grad:
            per_client += 4 * p.numel() * p.element_size()  # parameter, gradient, two optimizer slots
    per_client += sum(b.numel() * b.element_size() for b in sim.model.buffers())
    mb = getattr(sim.args, "vector_chunk_mb", None)
    default = CHUNK_BYTES if sim.device.type == "cpu" else ACCELERATOR_CHUNK_BYTES
    size = max(1, (int(mb * 2**20) if mb else default) // max(per_client, 1))
    by_hp: dict[HParams, list[int]] = {}
    for c in clients:
        by_hp.setdefault(sim.client_hparams(c), []).append(c)
    out = []
    for members in by_hp.values():
        for i in range(0, len(members), size):
            out.append(members[i:i + size])
    return out
