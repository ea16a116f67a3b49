"""FedBN (Li et al. 2021): normalization layers (affine + running statistics) stay local and never travel.

``--keep_optimizer_state true`` keeps each client's optimizer state (SGD momentum buffers) across rounds, as FRAug's
authors' framework does for every method (one ``torch.optim.SGD(momentum=0.5)`` per user, created once in
``User.__init__``); the default (false) starts every round with a fresh optimizer, as FedBN's own code does
(``optim.SGD`` re-created each communication round, without momentum). Same-policy comparisons with FRAug use it.
"""
from dataclasses import dataclass, field

from .base import GLOBAL, MODEL, OPTIM, PRIVATE, Algorithm, Update, register


def norm_key_prefixes(model) -> tuple[str, ...]:
    from torch import nn
    norm_types = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm)
    return tuple(name + "." for name, m in model.named_modules() if isinstance(m, norm_types))


@dataclass
class FedBNConfig:
    keep_optimizer_state: bool = field(default=False, metadata={
        "help": "Keep each client's optimizer state (momentum) across rounds (FRAug's authors' framework); "
                "false: a fresh optimizer every round (FedBN's code)."})


@register
class FedBN(Algorithm):
    name = "fedbn"
    Config = FedBNConfig
    has_global_model = False  # there is no global normalization: evaluation is per client

    def key_role(self, key, default):
        if not hasattr(self, "_norm_prefixes"):
            self._norm_prefixes = norm_key_prefixes(self.model)
        if default == GLOBAL and key.startswith(self._norm_prefixes):
            return PRIVATE
        return default

    def vectorizable(self):  # the client_update below differs from the default only when it keeps optimizer state
        return super().vectorizable() and not self.config.keep_optimizer_state

    def client_update(self, client_id, down, private, round_idx):
        if not self.config.keep_optimizer_state:
            return super().client_update(client_id, down, private, round_idx)
        self.load_client(down, private)
        metrics = self.local_train(client_id, round_idx, optimizer_state=(private or {}).get(OPTIM, {}))
        return Update(client_id, {MODEL: self.ctx.snapshot(self.global_keys)}, len(self.ctx.train_data(client_id)),
                      {MODEL: self.ctx.snapshot(self.private_keys), OPTIM: metrics.pop("optimizer_state")}, metrics)
