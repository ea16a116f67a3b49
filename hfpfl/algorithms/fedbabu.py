"""FedBABU (Oh et al., ICLR 2022): Body Aggregation and Body Update.

Federated training (Sec. 4, Algorithm 1): the head (the last classifier layer) keeps its random initialisation,
the same on every client; it is never trained, never sent and never averaged. Clients train only the body, and the
server takes the sample-weighted mean of the bodies. Personalization (Sec. 4.3 / 5): each client fine-tunes the
received model on its own training data for tau epochs before evaluation (``--finetune_part full``, body and head,
by default; ``head`` fine-tunes the head alone). The fine-tuning lr is ``--finetune_lr`` (default the run's
``--lr``) or, with ``--finetune_lr_grid``, each client's pick on its own validation split
(:func:`hfpfl.algorithms.fedavg_ft.choose_finetune_lr`, as FedAvg+FT's): never on test data.

The head's keys have the role ``private`` here, not ``frozen``: the engine then swaps every client's copy (the one
initial head, unchanged) in before its update and before its evaluation, so a head fine-tuned for one client's
evaluation never reaches the next client or the next round.
"""
from dataclasses import dataclass

from ..options import at_least, number_list, one_of, option, positive, validate
from .base import GLOBAL, PRIVATE, Algorithm, Update, register
from .fedavg_ft import choose_finetune_lr, parse_grid, require_val_splits
from .fedper import is_head


@dataclass
class FedBABUConfig:
    finetune_epochs: int = option(5, "FedBABU: fine-tuning epochs tau on each client before its evaluation "
                                     "(authors' code: 5).", check=at_least(0))
    finetune_part: str = option("full", "FedBABU: what personalization fine-tunes: 'full' (body and head) or "
                                        "'head'.", check=one_of("full", "head"))
    finetune_lr: float | None = option(None, "FedBABU: fine-tuning learning rate (default: the run's --lr).",
                                       check=positive())
    finetune_lr_grid: str | None = option(None, "FedBABU: comma-separated fine-tuning lrs (e.g. 0.001,0.01,0.1): "
                                                "each client fine-tunes with each and keeps the one with the best "
                                                "accuracy on its validation split (needs --val_fraction; ties: lower "
                                                "validation loss, then the earlier entry).",
                                          check=number_list(low=0, low_open=True))

    def __post_init__(self):
        validate(self)
        if self.finetune_lr is not None and self.finetune_lr_grid:
            raise ValueError("--finetune_lr and --finetune_lr_grid both set the fine-tuning lr: pass one of them")


@register
class FedBABU(Algorithm):
    """FedBABU: the head stays at its random init (never trained or sent); the body is averaged; fine-tuned to evaluate."""
    name = "fedbabu"
    local_update = "own"
    personal_model = "own"
    Config = FedBABUConfig

    def __init__(self, ctx, config):
        super().__init__(ctx, config)
        if parse_grid(config.finetune_lr_grid):
            require_val_splits(ctx.data)

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
            hp, grid = self.ctx.hparams(client_id), parse_grid(self.config.finetune_lr_grid)
            train = dict(params=self.trainable_parameters(keys), epochs=self.config.finetune_epochs, tag="finetune")
            if grid:
                hp = hp.replace(lr=choose_finetune_lr(self, client_id, round_idx, grid, **train))
            elif self.config.finetune_lr is not None:
                hp = hp.replace(lr=self.config.finetune_lr)
            self.local_train(client_id, round_idx, hp=hp, **train)
        return model
