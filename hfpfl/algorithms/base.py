"""The method protocol lives in the engine (:mod:`hfpfl.federated.protocol` and the modules it is made of); methods
import it from here."""
from ..federated.aggregation import WeightedSums, server_optimizer_step, weighted_average  # noqa: F401
from ..federated.context import HParams, MethodContext, NonFiniteError, ServerHParams  # noqa: F401
from ..federated.protocol import Algorithm, NoConfig, Update  # noqa: F401
from ..federated.registry import REGISTRY, get_algorithm, register  # noqa: F401
from ..federated.state import FROZEN, GLOBAL, MODEL, OPTIM, PRIVATE  # noqa: F401
