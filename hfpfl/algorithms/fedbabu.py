"""FedBABU (Oh et al., ICLR 2022): Body Aggregation and Body Update.

Federated training (Sec. 4, Algorithm 1): the head (the last classifier layer) keeps its random initialisation,
the same on every client; it is never trained, never sent and never averaged. Clients train only the body, and the
server takes the sample-weighted mean of the bodies. Personalization (Sec. 4.3 / 5): each client fine-tunes the
received model on its own training data for tau epochs before evaluation (``--finetune_part full``, body and head,
by default; ``head`` fine-tunes the head alone).

The head's keys have the role ``private`` here, not ``frozen``: the engine then swaps every client's copy (the one
initial head, unchanged) in before its update and before its evaluation, so a head fine-tuned for one client's
evaluation never reaches the next client or the next round.
"""
from dataclasses import dataclass

from ..options import at_least, one_of, option, positive
from .base import GLOBAL, PRIVATE, Algorithm, Update, register
from .fedper import is_head


@dataclass
class FedBABUConfig:
    finetune_epochs: int = option(5, "FedBABU: fine-tuning epochs tau on each client before its evaluation "
                                     "(authors' code: 5).", check=at_least(0))
    finetune_part: str = option("full", "FedBABU: what personalization fine-tunes: 'full' (body and head) or "
                                        "'head'.", check=one_of("full", "head"))
    finetune_lr: float | None = option(None, "FedBABU: fine-tuning learning rate (default: the run's --lr).",
                                       check=positive())


@register
class FedBABU(Algorithm):
    """FedBABU: the head stays at its random init (never trained or sent); the body is averaged; fine-tuned to evaluate."""
    name = "fedbabu"
    local_update = "own"
    personal_model = "own"
    Config = FedBABUConfig

    def key_role(self, key, default):
        return PRIVATE if default == GLOBAL and is_head(key) else default

    def client_update(self, client_id, down, private, round_idx):
        self.load_client(down, private)
        metrics = self.local_train(client_id, round_idx, params=self.trainable_parameters(self.global_keys))
        return Update(client_id, {"model": self.ctx.snapshot(self.global_keys)},
                      len(self.ctx.train_data(client_id)), {"model": self.ctx.snapshot(self.private_keys)}, metrics)

    def load_personal(self, client_id, server_state, private, round_idx):
        model = super().load_personal(client_id, server_state, private, round_idx)
        if self.config.finetune_epochs > 0:
            keys = self.private_keys if self.config.finetune_part == "head" else self.global_keys + self.private_keys
            hp = self.ctx.hparams(client_id)
            if self.config.finetune_lr is not None:
                hp = hp.replace(lr=self.config.finetune_lr)
            self.local_train(client_id, round_idx, params=self.trainable_parameters(keys), hp=hp,
                             epochs=self.config.finetune_epochs, tag="finetune")
        return model
