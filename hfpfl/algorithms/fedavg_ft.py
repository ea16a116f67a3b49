"""FedAvg + fine-tuning: FedAvg training; each client's personal model is the global model fine-tuned locally."""
from dataclasses import dataclass, field

from .base import Algorithm, register


@dataclass
class FineTuneConfig:
    finetune_epochs: int = field(default=1, metadata={"help": "Local fine-tuning epochs from the global model at evaluation."})


@register
class FedAvgFT(Algorithm):
    name = "fedavg_ft"
    Config = FineTuneConfig

    def load_personal(self, client_id, server_state, private, round_idx):
        model = super().load_personal(client_id, server_state, private, round_idx)
        if self.config.finetune_epochs > 0:
            self.local_train(client_id, round_idx, epochs=self.config.finetune_epochs, tag="finetune")
        return model
