"""FedAvg + fine-tuning: FedAvg training; each client's personal model is the global model fine-tuned locally."""
from dataclasses import dataclass, field

from ..options import at_least, validate

from .base import Algorithm, register


@dataclass
class FineTuneConfig:
    finetune_epochs: int = field(default=1, metadata={
        "help": "Local fine-tuning epochs from the global model at evaluation (0 = the global model as is).",
        "check": at_least(0)})

    def __post_init__(self):
        validate(self)


@register
class FedAvgFT(Algorithm):
    name = "fedavg_ft"
    personal_model = "own"
    Config = FineTuneConfig

    def load_personal(self, client_id, server_state, private, round_idx):
        model = super().load_personal(client_id, server_state, private, round_idx)
        if self.config.finetune_epochs > 0:
            self.local_train(client_id, round_idx, epochs=self.config.finetune_epochs, tag="finetune")
        return model
