"""Hyperparameter tuning over any registered method: FedPop (population-based, while training) and the RS, SHA and
FedEx baselines at the same budget, each a tuner class on one base (:mod:`hfpfl.tuning.base`) registered under its
``--tuner`` name; ``Tuner(run_args, data_args, method_config, targs)`` builds the one ``targs.tuner`` names."""
from .arguments import TUNERS, TunerArguments
from .base import REGISTRY, Member, Tuner, register, tuner_class
from .fedex import FedEx
from .fedpop import FedPop, cos_anneal, eq5_score, eq5_weights, quantile_sets
from .rs import RandomSearch
from .search_space import DEFAULT_SPACE, SearchSpace, evo, in_ball, project_ball, sample, sample_ball
from .sha import FedExSHA, FedPopSHA, SuccessiveHalving

__all__ = ["TUNERS", "REGISTRY", "Member", "Tuner", "TunerArguments", "register", "tuner_class",
           "FedPop", "RandomSearch", "SuccessiveHalving", "FedEx", "FedPopSHA", "FedExSHA",
           "cos_anneal", "eq5_score", "eq5_weights", "quantile_sets",
           "DEFAULT_SPACE", "SearchSpace", "evo", "in_ball", "project_ball", "sample", "sample_ball"]
