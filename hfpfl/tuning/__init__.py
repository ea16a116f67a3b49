"""Hyperparameter tuning over any registered method: FedPop (population-based, while training) and the RS, SHA and
FedEx baselines at the same budget. See :mod:`hfpfl.tuning.fedpop`."""
from .fedpop import TUNERS, Member, Tuner, TunerArguments, cos_anneal, eq5_score, eq5_weights, quantile_sets
from .search_space import DEFAULT_SPACE, SearchSpace, evo, in_ball, project_ball, sample, sample_ball

__all__ = ["TUNERS", "Member", "Tuner", "TunerArguments", "cos_anneal", "eq5_score", "eq5_weights", "quantile_sets",
           "DEFAULT_SPACE", "SearchSpace", "evo", "in_ball", "project_ball", "sample", "sample_ball"]
