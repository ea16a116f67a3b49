"""Ditto (Li et al. 2021): FedAvg for the global model, plus a personal model v_i trained with
lambda/2 ||v_i - w||^2 toward the global model received this round. v_i never leaves the client."""
from dataclasses import dataclass, field

from ..federated.state import load_into, snapshot
from .base import Algorithm, Update, register
from .fedprox import proximal_term


@dataclass
class DittoConfig:
    lam: float = field(default=0.1, metadata={"help": "Ditto's lambda: pull of the personal model toward the global one."})
    personal_epochs: int = field(default=1, metadata={"help": "Local epochs for the personal model per round."})

    def __post_init__(self):
        if self.lam < 0:
            raise ValueError(f"lam must be >= 0, got {self.lam}")


PERSONAL = "personal::"


@register
class Ditto(Algorithm):
    name = "ditto"
    Config = DittoConfig

    def init_private_state(self, client_id):
        return {}  # the personal model starts from the first global model it receives

    def client_update(self, client_id, down, private, round_idx):
        private = private or {}
        # 1) the global model's local update (FedAvg)
        self.load_client(down, None)
        metrics = self.local_train(client_id, round_idx)
        upload = snapshot(self.sim.model_state, self.global_keys)
        # 2) the personal model, proximal to the received global model
        personal = {k[len(PERSONAL):]: v for k, v in private.items()} or dict(down)
        load_into(self.sim.model_state, personal)
        anchor = {k: v.detach().clone() for k, v in down.items()}
        pm = self.local_train(client_id, round_idx, epochs=self.config.personal_epochs, tag="personal",
                              regularizer=lambda m: proximal_term(m, anchor, self.config.lam))
        new_private = {PERSONAL + k: v for k, v in snapshot(self.sim.model_state, self.global_keys).items()}
        return Update(client_id, upload, len(self.sim.train_data(client_id)), new_private,
                      {**metrics, "personal_train_loss": pm["train_loss"]})

    def load_personal(self, client_id, server_state, private, round_idx):
        personal = {k[len(PERSONAL):]: v for k, v in (private or {}).items()}
        self.load_client(self.download(server_state, client_id), None)
        load_into(self.sim.model_state, personal)  # a client never sampled keeps the global model
        return self.model
