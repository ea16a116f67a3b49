"""Central fine-tuning of a VQA foundation stand-in on the union of the clients' training splits: the benchmark check
of FedDAT's VQA tables (how much of a centrally fine-tuned model's score the image explains), not a federated method.

Every client sends its raw training split once (one round); the server fine-tunes one model -- the PEFT module chosen
by ``--peft`` (``adapter``: the adapters + one answer head, what the federated methods train; ``full``: every weight)
-- with the same AdamW (betas 0.9 / 0.98) and warm-up + linear-decay schedule as FedDAT's baselines, over
``--epochs`` passes of the union, and every client is scored with that model on its own test split."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..options import at_least
from ..training import TensorData
from .base import GLOBAL, MODEL, Update, register
from .feddat import VQAPeft, VQAPeftConfig, steps_per_epoch, warmup_linear


@dataclass
class VQACentralConfig(VQAPeftConfig):
    epochs: int = field(default=10, metadata={"help": "Epochs over the union of the clients' train splits.",
                                              "check": at_least(1)})


@register
class VQACentral(VQAPeft):
    """One model fine-tuned on the pooled clients' VQA data (the answer head included)."""

    name = "vqa_central"
    Config = VQACentralConfig
    aggregation = "gather"
    one_shot = True
    has_global_model = True
    uses_server_hparams = frozenset()

    def key_role(self, key, default):
        if key.startswith("backbone.classifier."):
            return GLOBAL                                   # one head for the pooled data, not one per client
        return super().key_role(key, default)

    def client_update(self, client_id, down, private, round_idx):
        d = self.ctx.train_data(client_id)
        return Update(client_id, {"data": {k: v.clone() for k, v in d.columns.items()}}, len(d))

    def aggregate(self, server_state, updates, round_idx):
        if not updates:
            return server_state
        cols = {k: torch.cat([u.upload["data"][k] for u in updates]) for k in updates[0].upload["data"]}
        data = TensorData.of(**cols)
        self.ctx.load({k: server_state[MODEL][k] for k in self.global_keys})
        self.set_mode("shared")
        hp = self.ctx.run_hparams
        total = self.config.epochs * steps_per_epoch(len(data), hp.batch_size, self.ctx.run.last_batch)
        schedule = warmup_linear(total, self.config.warmup)
        self.server_training = self.ctx.train(-1, round_idx, params=self.trainable_parameters(), hp=hp,
                                              epochs=self.config.epochs, data=data, tag="central",
                                              optimizer=self.optimizer, loss_fn=lambda m, b: m(**b).loss,
                                              schedule=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule))
        return {**server_state, MODEL: self.ctx.snapshot(self.global_keys)}

    def load_personal(self, client_id, server_state, private, round_idx):
        model = self.load_global(server_state)
        self.set_mode("shared")
        return model
