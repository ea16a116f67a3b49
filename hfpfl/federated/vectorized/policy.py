"""When to vectorize: whether a run's local updates can be batched at all (:func:`vectorize_reason`) and, in
``--vectorize auto``, whether batching a round's clients pays (:func:`should_vectorize`, measured thresholds)."""
from __future__ import annotations

import logging

from torch import nn

logger = logging.getLogger("hfpfl")

# auto mode: vectorize models up to this many trainable parameters (measured on 2 CPU cores, 1 thread: an MLP
# 64-64-10 steps 20 clients 4-5x faster vmapped; PFLlib's CNN (0.58 M) at batch 10 is compute-bound, 0.9x)
AUTO_MAX_PARAMS = 200_000
# mid-size models (up to AUTO_MID_MAX_PARAMS) are vectorized only where it measured faster: small batches, and many
# clients stepping together. PFLlib's CNN (0.58 M), 20 clients stepping together, 1 thread: vmapped / sequential
# step time 0.77 at batch 5, 0.78 at 10, 0.92 at 20, 1.05 at 32, 1.11 at 64. Whole rounds: 500 iid clients x 5
# images, batch 5 (500 clients per step): vectorized 7.2 s vs sequential 10.4 s; 20 Dir(0.1) clients, batch 10
# (ragged, 7.7 clients per step): vectorized 6.6 s vs sequential 5.7 s. So: batch <= AUTO_MID_MAX_BATCH and on average
# at least AUTO_MID_MIN_GROUP clients per batched step (training); for evaluation, padded test sets at least
# AUTO_MID_MIN_FILL full (padding costs forward passes).
AUTO_MID_MAX_PARAMS = 1_000_000
AUTO_MID_MAX_BATCH = 16
AUTO_MID_MIN_GROUP = 12
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
        return clients_per_step(sizes, hp.batch_size, hp.local_steps) >= AUTO_MID_MIN_GROUP
    sizes = [len(sim.test_data(c)) for c in clients]
    return sum(sizes) / (len(sizes) * max(max(sizes), 1)) >= AUTO_MID_MIN_FILL


def can_vectorize_eval(sim, clients: list[int] | None = None) -> bool:
    """Personal models are the base protocol's (download + private state: ``personal_model = "loaded"``) and the
    run may vectorize."""
    return (getattr(sim.args, "vectorize", "off") != "off" and sim.algorithm.personal_model == "loaded"
            and vectorize_reason(sim) is None and should_vectorize(sim, clients, "test"))

