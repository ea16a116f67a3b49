"""Import Flower Datasets' partitioners without paying for ``flwr_datasets.visualization`` up front.

``import flwr_datasets`` eagerly imports its plotting helpers (seaborn, scipy.stats, matplotlib.pyplot): 2-4 s per
process on a small CPU box, more than building the default federated dataset. Before the first import we register a
placeholder for ``flwr_datasets.visualization`` that imports the real module on first attribute access, so
``flwr_datasets.visualization.plot_label_distributions`` and ``from flwr_datasets.visualization import ...`` still work.
If flwr_datasets is already imported, nothing is changed.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

_NAME = "flwr_datasets.visualization"


class _LazyVisualization(types.ModuleType):
    def __getattr__(self, attr):  # only called for attributes the placeholder does not have
        if attr.startswith("__"):
            raise AttributeError(attr)
        if sys.modules.get(_NAME) is self:
            del sys.modules[_NAME]
        real = importlib.import_module(_NAME)
        parent = sys.modules.get("flwr_datasets")
        if parent is not None:
            parent.visualization = real
        return getattr(real, attr)


def partitioner_module():
    """``flwr_datasets.partitioner``, imported without eagerly importing the visualization helpers."""
    if "flwr_datasets" not in sys.modules and _NAME not in sys.modules:
        spec = importlib.util.find_spec("flwr_datasets")
        if spec is not None and spec.submodule_search_locations:
            placeholder = _LazyVisualization(_NAME, "lazy placeholder; the real module loads on first use")
            placeholder.__spec__ = None
            placeholder.__path__ = []
            sys.modules[_NAME] = placeholder
    return importlib.import_module("flwr_datasets.partitioner")
