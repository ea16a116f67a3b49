"""Every random stream of a run is named by (run seed, round, client, tag): the same numbers whatever the process
count, the chunking of clients or the order work is done in."""
from __future__ import annotations

import zlib

import numpy as np


def seed_for(run_seed: int, round_idx: int, client_id: int, tag: str = "") -> int:
    """The seed of one stream: numpy's SeedSequence of (run seed, round, client + 1, crc32(tag))."""
    ss = np.random.SeedSequence([run_seed, round_idx, client_id + 1, zlib.crc32(tag.encode())])
    return int(ss.generate_state(1)[0])


def seeds_for(run_seed: int, round_idx: int, client_ids, tag: str = "") -> list[int]:
    """``[seed_for(run_seed, round_idx, c, tag) for c in client_ids]``, computed for all clients at once (numpy's
    SeedSequence hash written out on arrays: ~1 us per client instead of ~40 us)."""
    ids = [int(c) for c in client_ids]
    words = [run_seed, round_idx, zlib.crc32(tag.encode())]
    if not ids or not all(0 <= w < 2**32 for w in words) or min(ids) < -1 or max(ids) + 1 >= 2**32:
        return [seed_for(run_seed, round_idx, c, tag) for c in ids]  # other word counts: numpy's own path
    entropy = np.empty((len(ids), 4), dtype=np.uint32)
    entropy[:, 0], entropy[:, 1], entropy[:, 3] = words[0], words[1], words[2]
    entropy[:, 2] = np.asarray(ids, dtype=np.int64) + 1
    return _seed_sequence_words(entropy).tolist()


# numpy's SeedSequence (numpy/random/bit_generator.pyx: pool size 4, uint32 words), for many entropy rows at once
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43b0d7e5, 0x931e8875, 0x8b51f9dd, 0x58f38ded
_MIX_MULT_L, _MIX_MULT_R, _MASK32 = 0xca01f9dd, 0x4973f715, 0xFFFFFFFF


def _seed_sequence_words(entropy: np.ndarray) -> np.ndarray:
    """``SeedSequence(list(row)).generate_state(1)[0]`` for every row of a ``[n, 4]`` uint32 array of entropy
    words (four words each: exactly the pool, so no extra mixing rounds). Tested against numpy."""
    u32 = np.uint32
    hash_const = _INIT_A

    def hashmix(value):
        nonlocal hash_const
        value = value ^ u32(hash_const)
        hash_const = (hash_const * _MULT_A) & _MASK32
        value = value * u32(hash_const)
        return value ^ (value >> u32(16))

    def mix(x, y):
        r = u32(_MIX_MULT_L) * x - u32(_MIX_MULT_R) * y
        return r ^ (r >> u32(16))

    with np.errstate(over="ignore"):
        pool = [hashmix(entropy[:, i].astype(u32)) for i in range(4)]
        for src in range(4):
            for dst in range(4):
                if src != dst:
                    pool[dst] = mix(pool[dst], hashmix(pool[src]))
        hb = _INIT_B
        v = pool[0] ^ u32(hb)
        hb = (hb * _MULT_B) & _MASK32
        v = v * u32(hb)
        return v ^ (v >> u32(16))
