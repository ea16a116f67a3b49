"""Random search (dissertation ch. 4, Sec. 4.1 baselines): N_c configurations (alpha, beta^0) sampled once, each
trained R_c rounds with fixed hyperparameters side by side; the pick is the lowest final validation loss. Every step
is the base tuner's (:mod:`hfpfl.tuning.base`)."""
from __future__ import annotations

from .base import Tuner, register


@register
class RandomSearch(Tuner):
    """RS: the population as sampled, one client vector (beta^0) per member, no step between rounds."""

    name = "rs"
