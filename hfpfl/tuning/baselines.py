"""The paper's baselines on FedPop's driver, at the same budget R_t = N_c * R_c rounds (dissertation ch. 4, Sec. 4.1 baselines):

* RS: N_c configurations (alpha, beta^0) sampled once, each trained R_c rounds with fixed hyperparameters.
* SHA: 27 configurations, keep the best 1/3 after each of 3 stages (27 -> 9 -> 3 -> 1); each stage spends about
  R_t / 3 rounds; survivors continue training (no retraining); total rounds <= R_t.
* FedEx (Khodak et al. 2021) wrapped in RS: per member one alpha and 27 client configurations in the Delta-box of
  beta^0; each round every active client draws a configuration from a categorical distribution theta that is
  updated by exponentiated gradient on the local validation losses (weight sharing: one model per member).
* FedPop+SHA and FedEx+SHA (Tables 2-3, "Tuning Wrapper" SHA; appendix, "FedPop wrapped with SHA"): SHA's 27 starting
  configurations and eliminations, with FedPop (L every round, G every T_g rounds) or FedEx inside each stage.
"""
from __future__ import annotations

import dataclasses

from .fedpop import Tuner, TunerArguments


def _run(tuner: str, run_args, data_args, method_config, targs: TunerArguments | None = None, **kw) -> dict:
    targs = dataclasses.replace(targs or TunerArguments(), tuner=tuner)
    return Tuner(run_args, data_args, method_config, targs, **kw).run()


def random_search(run_args, data_args, method_config, targs=None, **kw) -> dict:
    return _run("rs", run_args, data_args, method_config, targs, **kw)


def successive_halving(run_args, data_args, method_config, targs=None, **kw) -> dict:
    return _run("sha", run_args, data_args, method_config, targs, **kw)


def fedex(run_args, data_args, method_config, targs=None, **kw) -> dict:
    return _run("fedex", run_args, data_args, method_config, targs, **kw)


def fedpop(run_args, data_args, method_config, targs=None, **kw) -> dict:
    return _run("fedpop", run_args, data_args, method_config, targs, **kw)


def fedpop_sha(run_args, data_args, method_config, targs=None, **kw) -> dict:
    return _run("fedpop_sha", run_args, data_args, method_config, targs, **kw)


def fedex_sha(run_args, data_args, method_config, targs=None, **kw) -> dict:
    return _run("fedex_sha", run_args, data_args, method_config, targs, **kw)
