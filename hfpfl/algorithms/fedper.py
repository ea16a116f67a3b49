"""FedPer (Arivazhagan et al. 2019) and FedRep (Collins et al. 2021): the classifier head is personal,
the body is shared. FedPer trains both jointly; FedRep trains the head first (body frozen), then the body."""
from dataclasses import dataclass, field

from ..options import at_least, validate

from .base import GLOBAL, MODEL, PRIVATE, Algorithm, Update, register

HEAD_PREFIXES = ("classifier.", "head.", "fc.")


def is_head(key: str) -> bool:
    return key.startswith(HEAD_PREFIXES) or ".classifier." in key


@register
class FedPer(Algorithm):
    name = "fedper"
    has_global_model = False  # the head is personal; there is no global classifier

    def key_role(self, key, default):
        return PRIVATE if default == GLOBAL and is_head(key) else default


@dataclass
class FedRepConfig:
    head_epochs: int = field(default=2, metadata={"help": "FedRep: local epochs on the head with the body frozen.",
                                                  "check": at_least(1)})
    body_epochs: int = field(default=1, metadata={"help": "FedRep: local epochs on the body with the head frozen.",
                                                  "check": at_least(1)})

    def __post_init__(self):
        validate(self)


@register
class FedRep(FedPer):
    name = "fedrep"
    local_update = "own"
    Config = FedRepConfig
    uses_client_hparams = Algorithm.uses_client_hparams - {"local_epochs"}  # head_epochs / body_epochs instead

    def client_update(self, client_id, down, private, round_idx):
        self.load_client(down, private)
        head = self.local_train(client_id, round_idx, params=self.trainable_parameters(self.private_keys),
                                epochs=self.config.head_epochs, tag="head")
        body = self.local_train(client_id, round_idx, params=self.trainable_parameters(self.global_keys),
                                epochs=self.config.body_epochs, tag="body")
        return Update(client_id, {MODEL: self.ctx.snapshot(self.global_keys)}, len(self.ctx.train_data(client_id)),
                      {MODEL: self.ctx.snapshot(self.private_keys)},
                      {"train_loss": body["train_loss"], "head_train_loss": head["train_loss"]})
