"""The clients' step learning-rate schedule across rounds (``--lr_milestones``, ``--lr_gamma``).

The parallel-adapters paper (Elvebakken et al., section IV-A) trains with "a learning rate of 0.1 and decrease this to
0.01 at round 30" (0.01 -> 0.001 for #M): ``--lr 0.1 --lr_milestones 30 --lr_gamma 0.1``. Round r (1-based) trains
at ``lr * gamma ** (number of milestones m <= r)``: the rounds from a milestone on run at the decayed rate. Unset
(the default) every round trains at ``--lr``.
"""
from __future__ import annotations


def milestones(value) -> tuple[int, ...]:
    """``"30"`` / ``"30,40"`` / ``None`` -> the milestone rounds."""
    if value is None or str(value).strip() == "":
        return ()
    return tuple(int(t) for t in str(value).split(",") if t.strip())


def scheduled_lr(lr: float, round_idx: int, args) -> float:
    """The client lr of round ``round_idx`` (1-based) under the run's ``lr_milestones`` / ``lr_gamma``."""
    ms = milestones(getattr(args, "lr_milestones", None))
    if not ms:
        return lr
    return lr * float(getattr(args, "lr_gamma", 0.1)) ** sum(1 for m in ms if round_idx >= m)
