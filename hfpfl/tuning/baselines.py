"""The paper's baselines on the tuners' one driver, at the same budget R_t = N_c * R_c rounds (dissertation ch. 4,
Sec. 4.1 baselines): one entry point per tuner, each running the tuner class registered under its name
(:mod:`.rs`, :mod:`.sha`, :mod:`.fedex`, :mod:`.fedpop`)."""
from __future__ import annotations

import dataclasses

from .arguments import TunerArguments
from .base import Tuner


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
