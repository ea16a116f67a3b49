"""When to vectorize: whether a run's local updates can be batched at all (:func:`vectorize_reason`) and, in
``--vectorize auto``, whether batching a round's clients pays (:func:`should_vectorize`, measured thresholds)."""
from __future__ import annotations

import logging

from torch import nn

logger = logging.getLogger("hfpfl")

# auto mode: vectorize models up to this many trainable parameters (measured on 2 CPU cores, 1 thread: an MLP
# 64-64-10 steps 20 clients 4-5x faster vmapped; PFLlib's CNN (0.58 M) at batch 10 is compute-bound, 0.9x)
AUTO_MAX_PARAMS = 200_000
# mid-size models (up to AUTO_MID_MAX_PARAMS) are vectorized on the CPU only where it measured faster: many clients
# that each take a single full batch. PFLlib's CNN (0.58 M), 1 thread, --last_batch keep, same-run rounds
# (scripts/bench_simulator.py --interleave): 500 iid clients x 5 training images, batch 5 (one full step each):
# vectorized 2.70 s vs sequential 3.69 s; 500 x 10 images, batch 5 (two steps each): vectorized 5.18 s vs sequential
# 4.80 s; 1000 x 2-3 images, batch 5 (one partial step each): vectorized 9.64 s vs sequential 6.32 s; 20 Dir(0.1)
# clients, batch 10 (ragged, 7.7 clients per step): vectorized 2.01 s vs sequential 1.35 s. A vmapped step costs
# about 5 ms per client here against about 3.7 ms for a sequential one (channels_last convolutions), so batching
# pays only where it saves a sequential client's fixed cost (load, optimizer, upload, about 2 ms) on one step and
# no step is padded. So, on the CPU: batch <= AUTO_MID_MAX_BATCH, at most AUTO_MID_CPU_MAX_STEPS steps per client,
# every client at least one full batch, and on average at least AUTO_MID_MIN_GROUP clients per batched step
# (training); for evaluation, padded test sets at least AUTO_MID_MIN_FILL full (padding costs forward passes).
AUTO_MID_MAX_PARAMS = 1_000_000
AUTO_MID_MAX_BATCH = 16
AUTO_MID_MIN_GROUP = 12
AUTO_MID_CPU_MAX_STEPS = 1
AUTO_MID_MIN_FILL = 0.7
# on an accelerator a step is launch-bound, not compute-bound, at these sizes: PFLlib's CNN on one H200, 20 Dir(0.1)
# clients at batch 10: vectorized 0.57-0.58 s per round vs sequential 1.16-1.25 s; 500 clients x 10 images at batch
# 5: 0.38-0.41 s vs 4.17 s. So there every mid-size model vectorizes whenever at least two clients train together.


def vectorize_reason(sim) -> str | None:
    """None when this run's local updates can be vectorized, else why not (logged once)."""
    algo = sim.algorithm
    if not algo.vectorizable():
        return f"{type(algo).__name__} trains its clients its own way (local_update = {algo.local_update!r})"
    for m in sim.model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and (m.p > 0 or sim.args.dropout):
            return "the model has dropout (random masks differ from the sequential path)"
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.momentum is None:
            return "BatchNorm with cumulative averaging (momentum=None)"
    return None


def clients_per_step(sizes: list[int], batch_size: int, local_steps: int | None = None) -> float:
    """How many clients step together on average in a vectorized round: all per-client steps / the longest
    client's steps (clients finish at different steps; each step batches the clients that still have a batch)."""
    if local_steps or not sizes:
        return float(len(sizes))
    steps = [max(1, -(-n // batch_size)) for n in sizes]
    return sum(steps) / max(steps)


def local_steps(sizes: list[int], hp) -> int:
    """The most local steps any of these clients takes in a round (``--local_steps``, else ``--local_epochs`` passes
    over its batches as :func:`~hfpfl.training.batch_bounds` cuts them)."""
    from ...training import batch_bounds  # why: the batching rule lives with the training loop
    if hp.local_steps:
        return int(hp.local_steps)
    last = getattr(hp, "last_batch", "merge")
    return max(len(batch_bounds(n, hp.batch_size, last)) for n in sizes) * max(1, int(hp.local_epochs))


def should_vectorize(sim, clients: list[int] | None = None, split: str = "train") -> bool:
    """Whether to vectorize this run's ``clients`` (``split`` "train": their local training; "test": their
    evaluation). ``--vectorize on`` whenever possible; ``auto`` for small models always, for mid-size models where
    the chunk's shape makes it pay (see :data:`AUTO_MID_MAX_PARAMS`), never without ``clients``."""
    mode = getattr(sim.args, "vectorize", "off")
    if mode == "off":
        return False
    reason = vectorize_reason(sim)
    if reason is not None:
        if mode == "on" and not getattr(sim, "_vector_warned", False):
            logger.warning("--vectorize on: falling back to sequential client training (%s)", reason)
            sim._vector_warned = True
        return False
    if mode == "on":
        return True
    n = sum(p.numel() for p in sim.algorithm.trainable_parameters())
    if n <= AUTO_MAX_PARAMS:
        return True
    if n > AUTO_MID_MAX_PARAMS or not clients or len(clients) < 2:
        return False
    if sim.device.type != "cpu":
        return True
    if split == "train":
        hp = sim.args
        if hp.batch_size > AUTO_MID_MAX_BATCH:
            return False
        sizes = [len(sim.train_data(c)) for c in clients]
        if min(sizes) < hp.batch_size or local_steps(sizes, hp) > AUTO_MID_CPU_MAX_STEPS:
            return False
        return clients_per_step(sizes, hp.batch_size, hp.local_steps) >= AUTO_MID_MIN_GROUP
    sizes = [len(sim.test_data(c)) for c in clients]
    return sum(sizes) / (len(sizes) * max(max(sizes), 1)) >= AUTO_MID_MIN_FILL


def can_vectorize_eval(sim, clients: list[int] | None = None) -> bool:
    """Personal models are the base protocol's (download + private state: ``personal_model = "loaded"``) and the
    run may vectorize."""
    return (getattr(sim.args, "vectorize", "off") != "off" and sim.algorithm.personal_model == "loaded"
            and vectorize_reason(sim) is None and should_vectorize(sim, clients, "test"))

