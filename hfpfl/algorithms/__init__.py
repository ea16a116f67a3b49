"""Methods and baselines, each a small plug-in on the engine's protocol (:mod:`hfpfl.federated.protocol`)."""
from .base import (FROZEN, GLOBAL, MODEL, OPTIM, PRIVATE, REGISTRY, Algorithm, HParams, NoConfig, Update,
                   get_algorithm, register, weighted_average)
from . import ditto, fedavg, fedavg_ft, fedbn, fedper, fedprox, local, scaffold  # noqa: F401  (registration)
from . import feddf, fednova, perada  # noqa: F401  (registration)
from . import central, fedbip  # noqa: F401  (registration)
from . import fedbasis, fedpce, fraug  # noqa: F401  (registration)
from . import feddat  # noqa: F401  (registration)
from .fedavg import FedAvg

__all__ = ["Algorithm", "Update", "NoConfig", "HParams", "REGISTRY", "get_algorithm", "register", "weighted_average",
           "FedAvg", "GLOBAL", "PRIVATE", "FROZEN", "MODEL", "OPTIM"]
