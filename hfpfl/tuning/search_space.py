"""FedPop's search space (the dissertation's appendix, ch. 4's search space) as a YAML file, plus the operations
that act on hyperparameter vectors: sampling, Evo (Eq. 3), the Delta-box around beta^0 and its projection.

A vector is a dict ``{name: coordinate}`` in *sampling space*: a continuous coordinate is the number the uniform
distribution draws (``log10 lr``, ``log10(1 - gamma)``, ``momentum``), a discrete one is an index into ``values``.
``to_hparams`` maps a vector to the engine's ``HParams``/``ServerHParams`` fields.

YAML format (unknown keys are errors)::

    server:
      server_lr:       {type: log10, low: -1, high: 1}
      server_momentum: {type: uniform, low: 0.0, high: 0.9}
      server_lr_decay: {type: log10_one_minus, low: -4, high: -2}   # gamma = 1 - 10^u
    client:
      lr:           {type: log10, low: -4, high: 0}
      local_epochs: {type: choice, values: [1, 2, 3, 4, 5]}
      ...
    method:                  # fields of the method's Config (FedProx mu, Ditto lam, ...), one value per member
      mu:           {type: log10, low: -3, high: 0}

A method declares the server and client hyperparameters its update reads (``Algorithm.uses_server_hparams`` /
``uses_client_hparams``); :meth:`SearchSpace.fit_method` drops the others from the default space and refuses a
file that names one.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from ..federated.context import HParams, ServerHParams

logger = logging.getLogger("hfpfl")

KINDS = ("uniform", "log10", "log10_one_minus", "choice")
_PARAM_KEYS = {"type", "low", "high", "values"}
SERVER_FIELDS = {f.name for f in dataclasses.fields(ServerHParams)}
CLIENT_FIELDS = {"lr", "momentum", "weight_decay", "local_epochs", "batch_size", "dropout"}

# the dissertation's appendix (ch. 4). Client momentum U[0, 1.0] as printed; log2(batch) U{3..7} -> 8..128.
DEFAULT_SPACE = {
    "server": {
        "server_lr": {"type": "log10", "low": -1.0, "high": 1.0},
        "server_momentum": {"type": "uniform", "low": 0.0, "high": 0.9},
        "server_lr_decay": {"type": "log10_one_minus", "low": -4.0, "high": -2.0},
    },
    "client": {
        "lr": {"type": "log10", "low": -4.0, "high": 0.0},
        "momentum": {"type": "uniform", "low": 0.0, "high": 1.0},
        "weight_decay": {"type": "log10", "low": -5.0, "high": -1.0},
        "local_epochs": {"type": "choice", "values": [1, 2, 3, 4, 5]},
        "batch_size": {"type": "choice", "values": [8, 16, 32, 64, 128]},
        "dropout": {"type": "uniform", "low": 0.0, "high": 0.5},
    },
}


@dataclass(frozen=True)
class Param:
    name: str
    kind: str
    low: float = 0.0
    high: float = 0.0
    values: tuple = ()

    @property
    def continuous(self) -> bool:
        return self.kind != "choice"

    @property
    def width(self) -> float:
        return self.high - self.low

    def sample(self, rng: np.random.Generator):
        if self.continuous:
            return float(rng.uniform(self.low, self.high))
        return int(rng.integers(len(self.values)))

    def clip(self, u):
        if self.continuous:
            return float(min(self.high, max(self.low, u)))
        return int(min(len(self.values) - 1, max(0, u)))

    def value(self, u):
        """Sampling-space coordinate -> the hyperparameter's value."""
        if self.kind == "uniform":
            return float(u)
        if self.kind == "log10":
            return float(10.0 ** u)
        if self.kind == "log10_one_minus":
            return float(1.0 - 10.0 ** u)
        return self.values[int(u)]

    def coordinate(self, v):
        """The value -> its sampling-space coordinate (inverse of ``value``)."""
        if self.kind == "uniform":
            return float(v)
        if self.kind == "log10":
            return float(math.log10(v))
        if self.kind == "log10_one_minus":
            return float(math.log10(1.0 - v))
        return list(self.values).index(v)


def _param(name: str, spec: dict, where: str) -> Param:
    if not isinstance(spec, dict):
        raise ValueError(f"search space {where}.{name}: expected a mapping with 'type', got {spec!r}")
    unknown = set(spec) - _PARAM_KEYS
    if unknown:
        raise ValueError(f"search space {where}.{name}: unknown key(s) {sorted(unknown)}; known: {sorted(_PARAM_KEYS)}")
    kind = spec.get("type")
    if kind not in KINDS:
        raise ValueError(f"search space {where}.{name}: type {kind!r} is not one of {KINDS}")
    if kind == "choice":
        values = tuple(spec.get("values") or ())
        if not values or "low" in spec or "high" in spec:
            raise ValueError(f"search space {where}.{name}: a choice takes a non-empty 'values' list only")
        return Param(name, kind, values=values)
    if "values" in spec or "low" not in spec or "high" not in spec:
        raise ValueError(f"search space {where}.{name}: {kind} takes 'low' and 'high' only")
    lo, hi = float(spec["low"]), float(spec["high"])
    if not lo <= hi:
        raise ValueError(f"search space {where}.{name}: low {lo} > high {hi}")
    return Param(name, kind, lo, hi)


class SearchSpace:
    """Server (alpha) and client (beta) hyperparameters with their sampling distributions."""

    def __init__(self, spec: dict | None = None):
        self.is_default = spec is None   # the paper's space: fit_method may drop what a method ignores
        spec = copy.deepcopy(DEFAULT_SPACE if spec is None else spec)
        unknown = set(spec) - {"server", "client", "method"}
        if unknown:
            raise ValueError(f"search space: unknown top-level key(s) {sorted(unknown)}; known: ['client', 'method', "
                             "'server']")
        self.server: dict[str, Param] = {}
        self.client: dict[str, Param] = {}
        # method hyperparameters (fields of the method's Config), checked against the method by fit_method
        self.method: dict[str, Param] = {n: _param(n, p, "method") for n, p in (spec.get("method") or {}).items()}
        for where, known, out in (("server", SERVER_FIELDS, self.server), ("client", CLIENT_FIELDS, self.client)):
            for name, p in (spec.get(where) or {}).items():
                if name not in known:
                    raise ValueError(f"search space: {where} hyperparameter {name!r} is unknown; known: "
                                     f"{sorted(known)} (a method's own option, e.g. FedProx mu, goes in a method: "
                                     "section)")
                out[name] = _param(name, p, where)

    def fit_method(self, algo_cls, method_config, *, optimizer: str = "sgd", has_dropout: bool = True,
                   name: str | None = None) -> list[str]:
        """Check the space against what the method reads; returns the names dropped from the default space.

        A hyperparameter the method ignores (not in its ``uses_server_hparams`` / ``uses_client_hparams``; client
        momentum under an Adam optimizer; dropout on a model without dropout layers) is dropped from the default
        space and refused in a user's file, where it would be tuned while changing nothing. ``method:`` names must
        be fields of the method's Config."""
        name = name or algo_cls.name
        client_used = set(algo_cls.uses_client_hparams)
        why = {}
        if optimizer != "sgd" and "momentum" in client_used:
            client_used.discard("momentum")
            why["momentum"] = f"--optimizer {optimizer} has no momentum"
        if has_dropout is False and "dropout" in client_used:
            client_used.discard("dropout")
            why["dropout"] = "the model has no dropout layer"
        dropped = []
        for where, used, params in (("server", set(algo_cls.uses_server_hparams), self.server),
                                    ("client", client_used, self.client)):
            for hp in [n for n in params if n not in used]:
                if self.is_default:
                    del params[hp]
                    dropped.append(hp)
                    continue
                reason = why.get(hp, f"{name}'s update does not read it")
                keep = sorted(used) or "none"
                raise ValueError(f"search space: {where} hyperparameter {hp!r} has no effect on method {name!r} "
                                 f"({reason}); remove it from the {where}: section (the {where} hyperparameters "
                                 f"{name} uses: {keep})")
        fields = {f.name: f for f in dataclasses.fields(method_config)} if dataclasses.is_dataclass(method_config) \
            else {}
        for hp, p in self.method.items():
            if hp not in fields:
                close = difflib.get_close_matches(hp, list(fields), n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ValueError(f"search space: method hyperparameter {hp!r} is not an option of method {name!r}; "
                                 f"{hint}known: {sorted(fields) or 'none (the method has no options)'}")
            current = getattr(method_config, hp)
            if isinstance(current, bool) or not isinstance(current, (int, float)):
                if p.continuous:
                    raise ValueError(f"search space: method hyperparameter {hp!r} of {name!r} is not a number "
                                     f"({current!r}); give it as {{type: choice, values: [...]}}")
            elif isinstance(current, int) and p.continuous:
                raise ValueError(f"search space: method hyperparameter {hp!r} of {name!r} is an integer; give it as "
                                 "{type: choice, values: [...]}")
        for where, params in (("server", self.server), ("client", self.client)):
            for hp in params:
                if hp in fields:   # cannot happen with today's names; guards a Config field named like an HParam
                    raise ValueError(f"search space: {hp!r} is both a {where} hyperparameter and an option of "
                                     f"{name!r}; rename the option")
        if dropped:
            logger.warning("search space: method %s ignores %s; dropped them from the default search space", name,
                           ", ".join(dropped))
        return dropped

    def method_values(self, h: dict, method_config):
        """The method config with the member's method hyperparameters ``h`` applied (a new object; the Config's own
        checks run on it)."""
        if not self.method:
            return method_config
        from ..options import validate
        cfg = dataclasses.replace(method_config, **to_values(h, self.method))
        validate(cfg)
        return cfg

    @classmethod
    def from_yaml(cls, path: str | Path | None) -> "SearchSpace":
        if path is None:
            return cls()
        return cls(yaml.safe_load(Path(path).read_text()) or {})

    def to_dict(self) -> dict:
        def one(p: Param) -> dict:
            return {"type": p.kind, "values": list(p.values)} if not p.continuous else \
                {"type": p.kind, "low": p.low, "high": p.high}
        out = {"server": {n: one(p) for n, p in self.server.items()},
               "client": {n: one(p) for n, p in self.client.items()}}
        if self.method:
            out["method"] = {n: one(p) for n, p in self.method.items()}
        return out

    def params(self, which: str) -> dict[str, Param]:
        return {"server": self.server, "client": self.client, "method": self.method}[which]


# ---------------------------------------------------------------------------------------------- vector operations
def sample(params: dict[str, Param], rng: np.random.Generator) -> dict:
    return {n: p.sample(rng) for n, p in params.items()}


def evo(h: dict, params: dict[str, Param], eps: float, p_re: float, rng: np.random.Generator) -> dict:
    """Eq. 3. Continuous: U(h - delta, h + delta), delta = eps (b - a), clipped to [a, b] (A7.5). Discrete: one index
    step in {-s, 0, +s} with s = floor(eps * (n - 1)), at least 1 when eps > 0 (A7.3: the literal floor(delta) is 0 for
    the small sets and would freeze epochs/batch size; the authors' code steps one index). With probability p_re the
    coordinate is resampled from its distribution instead. eps = 0 and p_re = 0 is the identity."""
    out = {}
    for n, p in params.items():
        if p_re > 0 and rng.random() < p_re:
            out[n] = p.sample(rng)
            continue
        if eps <= 0:
            out[n] = h[n]
        elif p.continuous:
            d = p.width * eps
            out[n] = p.clip(rng.uniform(h[n] - d, h[n] + d))
        else:
            step = max(1, math.floor(eps * (len(p.values) - 1)))
            out[n] = p.clip(h[n] + int(rng.choice([-step, 0, step])))
    return out


def ball_bounds(p: Param, center, delta: float = 0.2):
    """The Delta-box of one coordinate (appendix l.1946-1948): continuous +-delta (b - a), discrete +-1 index."""
    if p.continuous:
        d = delta * p.width
        return max(p.low, center - d), min(p.high, center + d)
    return max(0, center - 1), min(len(p.values) - 1, center + 1)


def sample_ball(beta0: dict, k: int, params: dict[str, Param], rng: np.random.Generator, delta: float = 0.2) -> list:
    out = []
    for _ in range(k):
        v = {}
        for n, p in params.items():
            lo, hi = ball_bounds(p, beta0[n], delta)
            v[n] = float(rng.uniform(lo, hi)) if p.continuous else int(rng.integers(lo, hi + 1))
        out.append(v)
    return out


def project_ball(beta: dict, beta0: dict, params: dict[str, Param], delta: float = 0.2) -> dict:
    out = {}
    for n, p in params.items():
        lo, hi = ball_bounds(p, beta0[n], delta)
        out[n] = type(beta[n])(min(hi, max(lo, beta[n])))
    return out


def in_ball(beta: dict, beta0: dict, params: dict[str, Param], delta: float = 0.2) -> bool:
    for n, p in params.items():
        lo, hi = ball_bounds(p, beta0[n], delta)
        if not lo - 1e-12 <= beta[n] <= hi + 1e-12:
            return False
    return True


def to_values(h: dict, params: dict[str, Param]) -> dict:
    return {n: p.value(h[n]) for n, p in params.items()}


def key(h: dict) -> tuple:
    """A hashable identity of a vector (for counting distinct vectors tried)."""
    return tuple(sorted((n, round(float(v), 12)) for n, v in h.items()))


__all__ = ["DEFAULT_SPACE", "Param", "SearchSpace", "sample", "evo", "sample_ball", "project_ball", "in_ball",
           "ball_bounds", "to_values", "key", "HParams", "ServerHParams"]
