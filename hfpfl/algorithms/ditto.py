"""Ditto (Li et al. 2021): FedAvg for the global model, plus a personal model v_i trained with
lambda/2 ||v_i - w||^2 toward the global model received this round. v_i (the private part ``"personal"``) never
leaves the client; the client's private model keys (e.g. its BatchNorm statistics) are swapped in by the engine."""
from dataclasses import dataclass, field
from typing import ClassVar

from ..options import at_least, non_negative, validate

from .base import MODEL, Algorithm, Update, register
from .fedprox import proximal_term

PERSONAL = "personal"


@dataclass
class DittoConfig:
    lam: float = field(default=0.1, metadata={"help": "Ditto's lambda: pull of the personal model toward the global one.",
                                              "check": non_negative()})
    personal_epochs: int = field(default=1, metadata={"help": "Local epochs for the personal model per round.",
                                                      "check": at_least(1)})
    #: the options that set the step size of what this method trains (named when training diverges; --lr always is)
    STEP_SIZES: ClassVar[dict[str, str]] = {"lam": "lower"}

    def __post_init__(self):
        validate(self)


@register
class Ditto(Algorithm):
    name = "ditto"
    local_update = "own"
    personal_model = "own"
    Config = DittoConfig

    def client_update(self, client_id, down, private, round_idx):
        private = private or {}
        # 1) the global model's local update (FedAvg)
        self.load_client(down, private)
        metrics = self.local_train(client_id, round_idx)
        upload = {MODEL: self.ctx.snapshot(self.global_keys)}
        private_model = self.ctx.snapshot(self.private_keys)
        # 2) the personal model, proximal to the received global model (starts from it the first time)
        self.ctx.load(private.get(PERSONAL) or down[MODEL])
        self.ctx.load(private.get(MODEL) or self.ctx.initial_private)
        anchor = {k: v.to(self.ctx.device, copy=True) for k, v in down[MODEL].items()}
        pm = self.local_train(client_id, round_idx, epochs=self.config.personal_epochs, tag="personal",
                              regularizer=lambda m: proximal_term(m, anchor, self.config.lam))
        new_private = {PERSONAL: self.ctx.snapshot(self.global_keys), MODEL: private_model}
        return Update(client_id, upload, len(self.ctx.train_data(client_id)), new_private,
                      {**metrics, "personal_train_loss": pm["train_loss"]})

    def load_personal(self, client_id, server_state, private, round_idx):
        private = private or {}
        self.load_client(self.download(server_state, client_id), private)
        self.ctx.load(private.get(PERSONAL, {}))  # a client never sampled keeps the global model
        return self.model
