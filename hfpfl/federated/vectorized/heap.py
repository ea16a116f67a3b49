"""glibc heap settings for rounds of many clients, where peak memory is the limit: a fixed mmap threshold and
giving freed heap pages back to the OS after every chunk (no-ops off glibc)."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

# glibc's mmap threshold, in bytes, once a round vectorizes PIN_MMAP_CLIENTS clients or more (see
# :func:`pin_mmap_threshold`): at that scale peak memory is the limit; below it speed is (measured: pinned, the
# 500-client CNN round took 13.4 s instead of 10.2 s, fresh pages faulted in for every large temporary)
MMAP_THRESHOLD = 1 << 20
PIN_MMAP_CLIENTS = 1000


def release_freed_heap() -> None:
    """Give the heap's free pages back to the OS (glibc ``malloc_trim``; a no-op elsewhere). Called after every
    vectorized chunk of a round of :data:`PIN_MMAP_CLIENTS` clients or more: the chunks' small temporaries leave free
    holes between long-lived allocations (stored states, client records) that glibc keeps resident, so without it the
    heap grew chunk after chunk (scripts/bench_scale_memory.py, 64 MiB chunks: peak RSS 0.88 GB at 1,000 clients,
    1.10 GB at 10,000; with it 0.86-0.87 and 1.02 GB; the 10,000-client round 56 s without, 62-66 s with)."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6") if sys.platform.startswith("linux") \
                else False
            _libc.malloc_trim  # noqa: B018 - not glibc: AttributeError
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


_libc = None


def pin_mmap_threshold() -> None:
    """Serve allocations of :data:`MMAP_THRESHOLD` bytes and more with their own memory maps (glibc ``mallopt``;
    a no-op elsewhere, or when the user set ``MALLOC_MMAP_THRESHOLD_``), once per process.

    A vectorized chunk allocates large temporaries (stacked states, batched activations) between long-lived small
    allocations (client records, stored states). By default glibc raises its mmap threshold after the first large
    frees, so later chunks' temporaries come from the heap, whose freed pages stay resident: peak RSS then grew
    with every chunk (measured with scripts/bench_scale_memory.py: +24% from 1,000 to 10,000 clients, the client
    store at its cap; ``MALLOC_MMAP_THRESHOLD_=131072`` alone took the 4,000-client peak from 1.72 GB to 1.52 GB).
    With a fixed threshold the temporaries go back to the OS when freed. Called by :func:`chunks_of` for rounds of
    :data:`PIN_MMAP_CLIENTS` clients or more."""
    global _mmap_pinned
    if _mmap_pinned:
        return
    _mmap_pinned = True
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc
        pass


_mmap_pinned = False
