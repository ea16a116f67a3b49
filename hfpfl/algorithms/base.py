"""The protocol every method plugs into.

A round, as the engine runs it (one model instance per process, client states swapped in and out):

    server_state = algo.init_server_state()                   # once
    for round r:
        for each sampled client i (sharded over processes):
            down    = algo.download(server_state, i)             # what travels server -> client (bytes counted)
            update  = algo.client_update(i, down, private_i, r)  # local work; update.upload travels client -> server
            private_i = update.private                           # stays on the client, never communicated
        server_state = algo.aggregate(server_state, updates, r)  # averaging, distillation, synthesis ...
    evaluation: algo.load_global(server_state), algo.load_personal(i, server_state, private_i)
    new clients: algo.personalize_new_client(client, server_state)

Everything that travels or is kept is a flat ``dict[str, Tensor]``: communication is measured on exactly those
tensors, and checkpoints are plain safetensors files.

State-dict keys of the model have a *role*: ``global`` (travels and is aggregated), ``private`` (kept per client)
or ``frozen`` (never trained, never sent). Methods override :meth:`Algorithm.key_role`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from ..federated.comm import TensorDict
from ..federated.state import load_into, snapshot
from ..federated.training import default_loss, train_local

if TYPE_CHECKING:
    from ..federated.engine import Simulation

GLOBAL, PRIVATE, FROZEN = "global", "private", "frozen"


@dataclass
class NoConfig:
    """This method has no hyperparameters of its own."""


@dataclass
class Update:
    """What a client's local work produced."""

    client_id: int
    upload: TensorDict                     # travels client -> server (bytes counted)
    num_samples: int
    private: TensorDict | None = None      # new private state; stays on the client
    metrics: dict = field(default_factory=dict)


class Algorithm:
    """Base class = FedAvg semantics; methods override only what differs."""

    name: ClassVar[str] = "base"
    Config: ClassVar[type] = NoConfig
    one_shot: ClassVar[bool] = False       # one-shot methods run exactly one round
    has_global_model: ClassVar[bool] = True

    def __init__(self, sim: "Simulation", config):
        self.sim = sim
        self.config = config

    # ------------------------------------------------------------------ model and key roles
    def build_model(self) -> nn.Module:
        return self.sim.build_default_model()

    def key_role(self, key: str, default: str) -> str:
        """Role of a state-dict key. `default` is derived from requires_grad (see Simulation)."""
        return default

    @property
    def model(self) -> nn.Module:
        return self.sim.model

    @property
    def global_keys(self) -> list[str]:
        return self.sim.keys_by_role[GLOBAL]

    @property
    def private_keys(self) -> list[str]:
        return self.sim.keys_by_role[PRIVATE]

    def trainable_parameters(self, keys=None) -> list[nn.Parameter]:
        """Parameters among `keys` (default: global + private) that may be trained."""
        allowed = set(keys) if keys is not None else set(self.global_keys) | set(self.private_keys)
        return [p for n, p in self.model.named_parameters() if n in allowed and p.requires_grad]

    # ------------------------------------------------------------------ server side
    def init_server_state(self) -> TensorDict:
        return snapshot(self.sim.model_state, self.global_keys)

    def init_private_state(self, client_id: int) -> TensorDict:
        """Every client starts from the same initial private values (as if the server sent the init once)."""
        return {k: v.clone() for k, v in self.sim.initial_private.items()}

    def download(self, server_state: TensorDict, client_id: int) -> TensorDict:
        return {k: server_state[k] for k in self.global_keys}

    def aggregate(self, server_state: TensorDict, updates: list[Update], round_idx: int) -> TensorDict:
        if not updates:
            return server_state
        return {**server_state, **weighted_average([u.upload for u in updates], [u.num_samples for u in updates])}

    # ------------------------------------------------------------------ client side
    def load_client(self, down: TensorDict, private: TensorDict | None) -> None:
        load_into(self.sim.model_state, down)
        if private:
            load_into(self.sim.model_state, private)

    def client_update(self, client_id: int, down: TensorDict, private: TensorDict | None, round_idx: int) -> Update:
        self.load_client(down, private)
        metrics = self.local_train(client_id, round_idx, **self.local_hooks(client_id, down, private))
        return Update(client_id, upload=snapshot(self.sim.model_state, self.global_keys),
                      num_samples=len(self.sim.train_data(client_id)),
                      private=snapshot(self.sim.model_state, self.private_keys), metrics=metrics)

    def local_hooks(self, client_id: int, down: TensorDict, private: TensorDict | None) -> dict:
        """Extra arguments for the local training loop (e.g. a proximal `regularizer`); none for FedAvg."""
        return {}

    def local_train(self, client_id: int, round_idx: int, *, params=None, epochs=None, regularizer=None,
                    before_step=None, loss_fn=default_loss, tag: str = "", data=None) -> dict:
        """The engine's training loop on this client's data, seeded by (seed, round, client, tag)."""
        args = self.sim.args
        params = self.trainable_parameters() if params is None else params
        optimizer = self.sim.make_optimizer(params)
        return train_local(self.model, data if data is not None else self.sim.train_data(client_id), optimizer,
                           batch_size=args.batch_size, epochs=args.local_epochs if epochs is None else epochs,
                           max_steps=args.local_steps if epochs is None else None,
                           generator=self.sim.generator(round_idx, client_id, tag), device=self.sim.device,
                           loss_fn=loss_fn, regularizer=regularizer, before_step=before_step,
                           backward=self.sim.accelerator.backward)

    # ------------------------------------------------------------------ evaluation
    def load_global(self, server_state: TensorDict) -> nn.Module | None:
        """Put the global model in `self.model` and return it; None if the method has no global model."""
        if not self.has_global_model:
            return None
        load_into(self.sim.model_state, {k: server_state[k] for k in self.global_keys})
        if self.sim.initial_private:
            load_into(self.sim.model_state, self.sim.initial_private)
        return self.model

    def load_personal(self, client_id: int, server_state: TensorDict, private: TensorDict | None,
                      round_idx: int) -> nn.Module:
        self.load_client(self.download(server_state, client_id), private or self.init_private_state(client_id))
        return self.model

    def extra_metrics(self, round_idx: int, server_state: TensorDict) -> dict:
        """More scalar metrics at each evaluation (e.g. PerAda's accuracy on corrupted test sets); none by default."""
        return {}

    def new_client_keys(self) -> list[str]:
        """What a new client (never seen in training) tunes; default: everything trainable."""
        return self.global_keys + self.private_keys

    def personalize_new_client(self, client_id: int, server_state: TensorDict, data, round_idx: int) -> nn.Module:
        """Default new-client protocol: start from the global state and fine-tune on the client's train split."""
        self.load_client(self.download(server_state, client_id), self.init_private_state(client_id))
        epochs = self.sim.args.new_client_epochs
        if epochs > 0:
            self.local_train(client_id, round_idx, params=self.trainable_parameters(self.new_client_keys()),
                             epochs=epochs, tag="new-client", data=data)
        return self.model


def weighted_average(states: list[TensorDict], weights: list[float]) -> TensorDict:
    """FedAvg's weighted mean of same-keyed tensor dicts. Integer buffers take the max (e.g. BN step counters)."""
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("aggregation weights sum to zero (every sampled client has no data)")
    out = {}
    for k in states[0]:
        first = states[0][k]
        if not torch.is_floating_point(first):
            out[k] = torch.stack([s[k] for s in states]).max(0).values
            continue
        acc = torch.zeros_like(first, dtype=torch.float64)
        for s, w in zip(states, weights):
            acc += s[k].double() * (w / total)
        out[k] = acc.to(first.dtype)
    return out


REGISTRY: dict[str, type[Algorithm]] = {}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    REGISTRY[cls.name] = cls
    return cls


def get_algorithm(name: str) -> type[Algorithm]:
    try:
        return REGISTRY[name]
    except KeyError:
        import difflib
        close = difflib.get_close_matches(name, REGISTRY, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown method {name!r}.{hint} Available methods: {', '.join(sorted(REGISTRY))}") from None
