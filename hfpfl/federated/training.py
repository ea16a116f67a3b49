"""Moved to :mod:`hfpfl.training` (the loop sits below the engine and the models); kept so old imports work."""
from ..training import (Metric, SoftTargetAccuracy, TensorData, default_loss, evaluate, iterate_batches,  # noqa: F401
                        make_optimizer, train_local)
