"""FedAvg + fine-tuning: FedAvg training; each client's personal model is the global model fine-tuned locally.

The fine-tuning lr is the run's ``--lr`` unless ``--finetune_lr_grid`` is given: then each client fine-tunes once per
grid lr from the same start (the same batch order and torch RNG state), scores each result on its own validation
split, and keeps the lr with the highest validation accuracy (ties: the lower validation loss, then the earlier grid
entry). The papers tune one lr for all clients on validation performance (PerAda App.: client lr by grid search "on
the local validation data"; FRAug Sec. 4.1: "the same hyperparameter search for all methods"); choosing per client
uses the same validation data, needs no pass over the other clients, and is what a client could do on its own. The
test split is never read for the choice. New clients (``--new_client_epochs``) choose theirs the same way."""
from dataclasses import dataclass, field

import torch

from ..options import at_least, number_list, validate

from .base import Algorithm, register


NO_VAL = ("--finetune_lr_grid picks each client's fine-tuning lr on its validation split, but this run has none: "
          "pass --val_fraction (e.g. 0.1)")


def parse_grid(text: str | None) -> list[float]:
    """``"0.001, 0.01"`` -> [0.001, 0.01]; None or empty -> []."""
    return [float(t) for t in text.split(",") if t.strip()] if text else []


def require_val_splits(data) -> None:
    """Refuse a fine-tuning lr grid before training when a client (or a held-out new client) has no val split."""
    if any(c.val is None or len(c.val) == 0 for c in list(data.clients) + list(data.new_clients or [])):
        raise ValueError(NO_VAL)


def choose_finetune_lr(algorithm: Algorithm, client_id: int, round_idx: int, grid: list[float],
                       **train_kwargs) -> float:
    """The grid lr whose fine-tune (``algorithm.local_train(**train_kwargs)`` from the model as loaded now) scores best
    on the client's validation split: the highest accuracy, then the lower loss, then the earlier grid entry. The model
    and torch's RNG are put back as found, so the fine-tune that follows is the chosen candidate's exactly. The test
    split is never read."""
    model, hp = algorithm.model, algorithm.ctx.hparams(client_id)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    val = algorithm.ctx.val_data(client_id)
    best = None
    for i, lr in enumerate(grid):
        algorithm.local_train(client_id, round_idx, hp=hp.replace(lr=lr), **train_kwargs)
        res = algorithm.ctx.evaluate(model, val)
        key = (-res["accuracy"], res["loss"], i)
        if best is None or key < best[0]:
            best = (key, lr)
        model.load_state_dict(start)
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    return best[1]


@dataclass
class FineTuneConfig:
    finetune_epochs: int = field(default=1, metadata={
        "help": "Local fine-tuning epochs from the global model at evaluation (0 = the global model as is).",
        "check": at_least(0)})
    finetune_lr_grid: str | None = field(default=None, metadata={
        "help": "Comma-separated fine-tuning lrs (e.g. 0.001,0.01,0.1): each client fine-tunes with each and keeps "
                "the one with the best accuracy on its validation split (needs --val_fraction; ties: lower "
                "validation loss, then the earlier entry). Default: the run's --lr.",
        "check": number_list(low=0, low_open=True)})

    def __post_init__(self):
        validate(self)

    def lr_grid(self) -> list[float]:
        return parse_grid(self.finetune_lr_grid)


@register
class FedAvgFT(Algorithm):
    name = "fedavg_ft"
    personal_model = "own"
    Config = FineTuneConfig

    def __init__(self, ctx, config):
        super().__init__(ctx, config)
        if config.lr_grid():
            require_val_splits(ctx.data)

    def choose_lr(self, client_id: int, round_idx: int, **train_kwargs) -> float:
        """The grid lr whose fine-tune scores best on the client's validation split (:func:`choose_finetune_lr`)."""
        return choose_finetune_lr(self, client_id, round_idx, self.config.lr_grid(), **train_kwargs)

    def _finetune(self, client_id: int, round_idx: int, **train_kwargs) -> None:
        if self.config.lr_grid():
            lr = self.choose_lr(client_id, round_idx, **train_kwargs)
            train_kwargs["hp"] = self.ctx.hparams(client_id).replace(lr=lr)
        self.local_train(client_id, round_idx, **train_kwargs)

    def load_personal(self, client_id, server_state, private, round_idx):
        model = super().load_personal(client_id, server_state, private, round_idx)
        if self.config.finetune_epochs > 0:
            self._finetune(client_id, round_idx, epochs=self.config.finetune_epochs, tag="finetune")
        return model

    def personalize_new_client(self, client_id, server_state, data, round_idx):
        if not self.config.lr_grid():
            return super().personalize_new_client(client_id, server_state, data, round_idx)
        self.load_client(self.download(server_state, client_id), self.init_private_state(client_id))
        epochs = self.ctx.run.new_client_epochs
        if epochs > 0:
            self._finetune(client_id, round_idx, params=self.trainable_parameters(self.new_client_keys()),
                           epochs=epochs, tag="new-client", data=data)
        return self.model
