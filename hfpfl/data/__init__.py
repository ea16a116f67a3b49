"""hfpfl.data: image sources (offline built-ins, Hub, local), partitioners, model inputs, the federated dataset.

>>> from hfpfl.data import DataArguments, build_federated_dataset
>>> fed = build_federated_dataset(DataArguments(), seed=0)   # digits, feature_shift, 8 clients
>>> print(fed.summary())
"""

from .arguments import DataArguments
from .build import build_federated_dataset
from .builtin_sources import SOURCES
from .federated import ClientData, FederatedData
from .hub_sources import SourceUnavailableError
from .partition import PARTITIONS, concept_drift_permutations, partition_dataset
from .source_splits import SPLIT_FRACTIONS
from .sources import load_source
from .transforms import DEGRADATIONS, degrade, to_model_inputs

__all__ = [
    "ClientData",
    "DataArguments",
    "FederatedData",
    "build_federated_dataset",
    "PARTITIONS",
    "partition_dataset",
    "concept_drift_permutations",
    "SOURCES",
    "SPLIT_FRACTIONS",
    "SourceUnavailableError",
    "load_source",
    "DEGRADATIONS",
    "degrade",
    "to_model_inputs",
]
