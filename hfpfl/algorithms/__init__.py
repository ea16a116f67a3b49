"""Methods and baselines, each a small plug-in on the engine's protocol (see :mod:`hfpfl.algorithms.base`)."""
from .base import FROZEN, GLOBAL, PRIVATE, REGISTRY, Algorithm, NoConfig, Update, get_algorithm, register, weighted_average
from . import ditto, fedavg, fedavg_ft, fedbn, fedper, fedprox, local, scaffold  # noqa: F401  (registration)
from . import feddf, fednova, perada  # noqa: F401  (registration)
from . import central, fedbip  # noqa: F401  (registration)

__all__ = ["Algorithm", "Update", "NoConfig", "REGISTRY", "get_algorithm", "register", "weighted_average",
           "GLOBAL", "PRIVATE", "FROZEN"]
