"""What a method sees of the engine: :class:`MethodContext` (the model, the data, the training loop, seeded
generators, several processes), a client's and the server's hyperparameters, and the error a diverged run raises."""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from ..training import Metric, TensorData, channels_last_pays, conv_channels_last, default_loss, evaluate, \
    load_optimizer_state, make_optimizer, optimizer_state_tensors, train_local
from .comm import Parts, TensorDict
from .state import load_into, snapshot

if TYPE_CHECKING:
    from .engine import Simulation


class NonFiniteError(ValueError):
    """Training diverged: weights or losses became NaN/inf."""


def step_size_hint(args, config, lr=None, server: bool = False) -> str:
    """What a divergence message tells the user to change: every option that sets a step size of what was trained,
    with its value -- ``--lr`` (``lr``: the client's own where it differs), the options the method config declares
    in ``STEP_SIZES`` (``{"option": "lower" | "raise"}``: e.g. fedbasis' ``--lr_coef`` and ``--temperature``) and,
    for the server's state, ``--server_lr``."""
    lower = [f"--lr (now {args.lr if lr is None else lr})"]
    higher = []
    for name, way in (getattr(config, "STEP_SIZES", None) or {}).items():
        (higher if way == "raise" else lower).append(f"--{name} (now {getattr(config, name)})")
    if server:
        lower.append(f"--server_lr (now {args.server_lr})")

    def either(items):
        return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]
    return "lower " + either(lower) + (", or raise " + either(higher) if higher else "")


@dataclass(frozen=True)
class HParams:
    """A client's training hyperparameters for one round. Defaults come from the run arguments; a method
    (``Algorithm.client_hparams``) or a driver such as FedPop (``Simulation.step(client_hparams=...)``) can give each
    client its own."""

    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    optimizer: str = "sgd"
    local_epochs: int = 1
    local_steps: int | None = None
    batch_size: int = 32
    dropout: float | None = None   # None: the model's own dropout rates

    @classmethod
    def from_args(cls, args) -> "HParams":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})

    def replace(self, **changes) -> "HParams":
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"unknown client hyperparameter(s) {sorted(unknown)}; known: "
                             f"{[f.name for f in dataclasses.fields(self)]}")
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ServerHParams:
    """The server optimizer (FedOpt, Reddi et al. 2021): pseudo-gradient d = x - mean(uploads); m <- momentum * m + d;
    x <- x - lr_t * m with lr_t = server_lr * server_lr_decay^(round - 1). server_lr = 1, momentum = 0 is FedAvg."""

    server_lr: float = 1.0
    server_momentum: float = 0.0
    server_lr_decay: float = 1.0

    @classmethod
    def from_args(cls, args) -> "ServerHParams":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})


@contextlib.contextmanager
def dropout_rate(model: nn.Module, p: float | None):
    """Temporarily set every nn.Dropout's rate (per-client dropout, tuned by FedPop)."""
    if p is None:
        yield
        return
    mods = [m for m in model.modules() if isinstance(m, nn.modules.dropout._DropoutNd)]
    old = [m.p for m in mods]
    for m in mods:
        m.p = p
    try:
        yield
    finally:
        for m, q in zip(mods, old):
            m.p = q


@dataclass(frozen=True)
class RunSettings:
    """The run's settings a method may read (``ctx.run``): the rest of the run's options are the engine's."""

    seed: int = 0
    num_rounds: int = 1
    eval_batch_size: int = 256
    new_client_epochs: int = 0
    model: str = ""
    adapter: str = "none"
    lora_r: int = 4
    last_batch: str = "merge"

    @classmethod
    def from_args(cls, args) -> "RunSettings":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})


class MethodContext:
    """What a method may read and call. Nothing else of the engine is part of the protocol.

    Model: ``model``, ``model_state`` (the model's cached state dict, shares storage), ``keys(role)``,
    ``initial_private``, ``load(values)``, ``snapshot(keys)``, ``build_default_model()``, ``device``,
    ``cache(name)`` (a per-run dict).
    Data: ``data`` (the FederatedData), ``num_clients``, ``num_labels``, ``client(i)``, ``train_data(i)``,
    ``val_data(i)``, ``test_data(i)``.
    Training: ``run`` (:class:`RunSettings`), ``round``, ``run_hparams`` (the run's client hyperparameters),
    ``hparams(i)`` (client i's this round), ``server_hparams()``, ``train(...)``, ``evaluate(model, data)``,
    ``metric()``, ``generator(round, i, tag)``, ``seed_for(round, i, tag)``, ``backward(loss)``.
    Several processes: ``is_main_process``, ``process_index``, ``owned(clients)``, ``gather(items)``,
    ``private_state(i)``; ``output_dir`` for artefacts (grids, adapters).
    Evaluation: ``personal_models(clients, server_state, round)``, each client's personal model as the run scores it."""

    def __init__(self, sim: "Simulation"):
        self._sim = sim
        self._run = None

    @property
    def run(self) -> RunSettings:
        """The run's settings a method reads (seed, rounds, evaluation batch size, ...)."""
        if self._run is None or self._run[0] is not self._sim.args:  # a one-shot method's run is cut to 1 round
            self._run = (self._sim.args, RunSettings.from_args(self._sim.args))
        return self._run[1]

    # model ------------------------------------------------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        return self._sim.model

    @property
    def model_state(self) -> TensorDict:
        return self._sim.model_state

    def keys(self, role: str) -> list[str]:
        return self._sim.keys_by_role[role]

    @property
    def initial_private(self) -> TensorDict:
        return self._sim.initial_private

    def load(self, values: TensorDict) -> None:
        load_into(self._sim.model_state, values, getattr(self._sim, "_load_memo", None))

    def snapshot(self, keys) -> TensorDict:
        return snapshot(self._sim.model_state, keys)

    def cache(self, name: str) -> dict:
        """A per-run cache by name, for what a method derives once and reads every round (its KD pool, corrupted
        test copies): the same dict for the whole run, dropped with it."""
        return self._sim.cache(name)

    def build_default_model(self) -> nn.Module:
        return self._sim.build_default_model()

    @property
    def device(self) -> torch.device:
        return self._sim.device

    # data -------------------------------------------------------------------------------------------------
    @property
    def data(self):
        return self._sim.data

    @property
    def num_clients(self) -> int:
        return self._sim.num_clients

    @property
    def num_labels(self) -> int:
        return self._sim.data.num_labels

    def client(self, client_id: int):
        return self._sim.client(client_id)

    def train_data(self, client_id: int) -> TensorData:
        return self._sim.train_data(client_id)

    def val_data(self, client_id: int) -> TensorData:
        return self._sim.val_data(client_id)

    def test_data(self, client_id: int) -> TensorData:
        return self._sim.test_data(client_id)

    # training ---------------------------------------------------------------------------------------------
    @property
    def round(self) -> int:
        return self._sim.round

    @property
    def run_hparams(self) -> HParams:
        """The run's client hyperparameters (``--lr``, ``--optimizer``, ...), before any client's own."""
        return HParams.from_args(self._sim.args)

    def hparams(self, client_id: int) -> HParams:
        return self._sim.client_hparams(client_id)

    def server_hparams(self) -> ServerHParams:
        return self._sim.server_hparams()

    def metric(self) -> Metric:
        return self._sim.algorithm.metric()

    def _make_optimizer(self, params, hp: HParams) -> torch.optim.Optimizer:
        return make_optimizer(params, hp.optimizer, hp.lr, hp.momentum, hp.weight_decay)

    def generator(self, round_idx: int, client_id: int, tag: str = "") -> torch.Generator:
        return self._sim.generator(round_idx, client_id, tag)

    def seed_for(self, round_idx: int, client_id: int, tag: str = "") -> int:
        return self._sim.seed_for(round_idx, client_id, tag)

    def evaluate(self, model: nn.Module, data: TensorData, metric: Metric | None = None) -> dict:
        with conv_channels_last(model, self._channels_last(model)):
            return evaluate(model, data, batch_size=self.run.eval_batch_size, device=self.device,
                            metric=metric or self.metric())

    def _channels_last(self, model: nn.Module) -> bool:
        """Whether this run's ``--channels_last`` applies to ``model`` (:func:`hfpfl.training.channels_last_pays`)."""
        return channels_last_pays(model, getattr(self._sim.args, "channels_last", "off"), self.device)

    def train(self, client_id: int, round_idx: int, *, params=None, hp: HParams | None = None, epochs=None,
              steps=None, data=None, tag: str = "", optimizer_state: TensorDict | None = None,
              optimizer: Callable | None = None, schedule: Callable | None = None, **hooks) -> dict:
        """The engine's training loop on a client's data with its hyperparameters, seeded by (seed, round, client,
        tag). ``params``: parameters or parameter groups (dicts with per-group ``lr``); several optimizers: pass
        ``params=[groups_a, groups_b]`` with ``loss_fn=[fn_a, fn_b]``. ``optimizer_state``: the optimizer state this
        client kept from earlier rounds (returned as ``metrics["optimizer_state"]`` for the method to keep).
        ``optimizer``: ``fn(params, hp) -> torch.optim.Optimizer`` in place of the run's ``--optimizer`` (e.g. a
        paper's AdamW betas). ``schedule``: ``fn(optimizer) -> LRScheduler``, built on every optimizer of this call
        and stepped after every optimizer step (a per-round warm-up, as FedDAT's). ``hooks``: ``loss_fn``,
        ``regularizer``, ``before_step``, ``after_step``."""
        sim = self._sim
        hp = hp or self.hparams(client_id)
        params = sim.algorithm.trainable_parameters() if params is None else params
        several = isinstance(hooks.get("loss_fn"), (list, tuple))
        param_sets = list(params) if several else [params]
        optimizers = [(optimizer or self._make_optimizer)(ps, hp) for ps in param_sets]
        if schedule is not None:
            if "scheduler" in hooks:
                raise ValueError("pass either schedule= (built on this call's optimizers) or scheduler=, not both")
            hooks["scheduler"] = _Schedules([schedule(opt) for opt in optimizers])
        names = {id(p): n for n, p in self.model.named_parameters()} if optimizer_state is not None else None
        if optimizer_state:
            for i, opt in enumerate(optimizers):
                load_optimizer_state(opt, {k[len(f"{i}:"):]: v for k, v in optimizer_state.items()
                                           if k.startswith(f"{i}:")}, names)
        if epochs is None and steps is None:
            epochs, steps = hp.local_epochs, hp.local_steps
        with dropout_rate(self.model, hp.dropout), conv_channels_last(self.model, self._channels_last(self.model)):
            metrics = train_local(self.model, data if data is not None else self.train_data(client_id),
                                  optimizers if several else optimizers[0], batch_size=hp.batch_size,
                                  epochs=epochs or 1, max_steps=steps,
                                  generator=self.generator(round_idx, client_id, tag), device=self.device,
                                  backward=sim.accelerator.backward, last_batch=sim.args.last_batch,
                                  **{"loss_fn": default_loss, **hooks})
        if optimizer_state is not None:
            metrics["optimizer_state"] = {f"{i}:{k}": v for i, opt in enumerate(optimizers)
                                          for k, v in optimizer_state_tensors(opt, names).items()}
        return metrics

    # several processes and artefacts -------------------------------------------------------------------------
    @property
    def is_main_process(self) -> bool:
        return self._sim.accelerator.is_main_process

    def owned(self, client_ids) -> list[int]:
        """The clients of ``client_ids`` this process owns (fixed for the run; ``Simulation.ownership``)."""
        return self._sim.ownership.owned(client_ids)

    def gather(self, items: list) -> list:
        from .distributed import all_gather
        return all_gather(items, self._sim.accelerator)

    def private_state(self, client_id: int) -> Parts | None:
        return self._sim.store.get(client_id)

    def personal_models(self, client_ids, server_state: Parts, round_idx: int):
        """``(client_id, model)`` for each client, each personal model built as the run's evaluation builds it
        (seeded, the client's private state loaded: :func:`hfpfl.federated.evaluation.personal_models`)."""
        return self._sim.evaluator.personal_models(client_ids, server_state, round_idx)

    @property
    def output_dir(self):
        return self._sim.output_dir

    @property
    def process_index(self) -> int:
        return self._sim.accelerator.process_index

    def backward(self, loss) -> None:
        """``loss.backward()`` as the run's accelerator does it (mixed precision, several processes): for a method's
        own training loop."""
        self._sim.accelerator.backward(loss)


class _Schedules:
    """Steps several learning-rate schedulers as one (``train_local`` steps its ``scheduler`` once per step)."""

    def __init__(self, schedulers):
        self.schedulers = schedulers

    def step(self):
        for s in self.schedulers:
            s.step()
