"""Methods and baselines, each a small plug-in on the engine's protocol (:mod:`hfpfl.federated.protocol`).

The methods whose modules define or build transformers models (FedBasis, FedPCE, FRAug, FedDAT) are imported on
first use: ``get_algorithm(name)``, ``hfpfl.algorithms.fedpce`` or ``import hfpfl.algorithms.fedpce``. Importing
them eagerly pulled transformers' model code into every process (measured: 470 MB RSS after ``import
hfpfl.algorithms`` against 338 MB without them; torch alone 219 MB), also into runs that never build such a model.
``load_builtin_methods()`` registers every built-in method (``hfpfl methods`` lists them all).
"""
import importlib

from .base import (FROZEN, GLOBAL, MODEL, OPTIM, PRIVATE, REGISTRY, Algorithm, HParams, NoConfig, Update,
                   get_algorithm, register, weighted_average)
from . import ditto, fedavg, fedavg_ft, fedbn, fedper, fedprox, local, scaffold  # noqa: F401  (registration)
from . import feddf, fednova, perada  # noqa: F401  (registration)
from . import central  # noqa: F401  (registration)
from ..fedbip import method as _fedbip  # noqa: F401  (registration: FedBiP is its own package, hfpfl.fedbip)
from . import fedbabu, fedproto  # noqa: F401  (registration)
from . import dense, fedd3  # noqa: F401  (registration: one-shot baselines of FedBiP's Tables 1-2)
from ..fedbip import baselines as _fedbip_baselines  # noqa: F401  (registration: FGL, FedDEO)
from .fedavg import FedAvg

# registered name -> module, for the methods imported on first use
LAZY_METHODS = {
    "fedbasis": "fedbasis",
    "fedpce": "fedpce", "pce_fedavg": "fedpce", "pce_fedprox": "fedpce", "pce_fedbn": "fedpce", "pce_fedper": "fedpce",
    "fraug": "fraug",
    "feddat": "feddat", "vqa_adapter": "feddat", "vqa_adapter_local": "feddat", "vqa_peft": "feddat",
    "vqa_central": "vqa_central",
}


def load_builtin_methods(name: str | None = None) -> None:
    """Import (register) the lazily loaded built-in method that registers ``name``, or all of them (``None`` or a
    name no built-in module registers: the caller then lists everything there is)."""
    modules = [LAZY_METHODS[name]] if name in LAZY_METHODS else sorted(set(LAZY_METHODS.values()))
    for module in modules:
        importlib.import_module(f"{__name__}.{module}")


def __getattr__(name):  # hfpfl.algorithms.fedpce without an import statement
    if name in set(LAZY_METHODS.values()):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Algorithm", "Update", "NoConfig", "HParams", "REGISTRY", "get_algorithm", "register", "weighted_average",
           "FedAvg", "GLOBAL", "PRIVATE", "FROZEN", "MODEL", "OPTIM", "load_builtin_methods", "LAZY_METHODS"]
