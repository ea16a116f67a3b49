"""Centralized real-data oracle: every client sends its raw train split once (bytes counted), the server trains the
classifier on their union with the engine's training loop. An upper bound, not a federated method."""
from dataclasses import dataclass, field

import torch

from ..options import at_least, validate
from ..training import TensorData
from .base import MODEL, Algorithm, Update, register


@dataclass
class CentralConfig:
    epochs: int = field(default=50, metadata={"help": "Epochs over the union of the clients' train splits.",
                                              "check": at_least(1)})
    steps: int | None = field(default=None, metadata={
        "help": "Exact optimizer steps over the union (overrides --epochs): to match another row's budget step for "
                "step.", "check": at_least(1)})

    def __post_init__(self):
        validate(self)


@register
class Central(Algorithm):
    """Centralized oracle: the classifier trained on the union of all clients' real train data."""

    name = "central"
    aggregation = "gather"
    local_update = "own"
    personal_model = "own"
    Config = CentralConfig
    one_shot = True
    # clients only upload their data; the server trains with the run's own settings and config.epochs
    uses_server_hparams = frozenset()
    uses_client_hparams = frozenset()

    def download(self, server_state, client_id):
        return {}

    def init_private_state(self, client_id):
        return {}

    def client_update(self, client_id, down, private, round_idx):
        d = self.ctx.train_data(client_id)
        return Update(client_id, {"data": {"pixel_values": d.pixel_values.clone(), "labels": d.labels.clone()}}, len(d))

    def aggregate(self, server_state, updates, round_idx):
        if not updates:
            return server_state
        data = TensorData(torch.cat([u.upload["data"]["pixel_values"] for u in updates]),
                          torch.cat([u.upload["data"]["labels"] for u in updates]))
        self.ctx.load({k: server_state[MODEL][k] for k in self.global_keys})
        self.server_training = self.local_train(-1, round_idx, epochs=self.config.epochs, steps=self.config.steps,
                                                data=data, tag="central")
        return {**server_state, MODEL: self.ctx.snapshot(self.global_keys)}

    def load_personal(self, client_id, server_state, private, round_idx):
        return self.load_global(server_state)
