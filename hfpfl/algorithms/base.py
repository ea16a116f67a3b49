"""The method protocol lives in the engine (:mod:`hfpfl.federated.protocol`); methods import it from here."""
from ..federated.protocol import (FROZEN, GLOBAL, MODEL, OPTIM, PRIVATE, REGISTRY, Algorithm, HParams,  # noqa: F401
                                  MethodContext, NoConfig, NonFiniteError, ServerHParams, Update, WeightedSums,
                                  get_algorithm, register, server_optimizer_step, weighted_average)
