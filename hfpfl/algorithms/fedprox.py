"""FedProx (Li et al. 2020): local objective + mu/2 ||w - w_global||^2. mu = 0 is exactly FedAvg."""
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..options import non_negative, validate
from .base import MODEL, Algorithm, register


@dataclass
class FedProxConfig:
    mu: float = field(default=0.01, metadata={"help": "FedProx proximal coefficient mu (0 = FedAvg).",
                                              "check": non_negative()})
    #: the options that set the step size of what this method trains (named when training diverges; --lr always is)
    STEP_SIZES: ClassVar[dict[str, str]] = {"mu": "lower"}

    def __post_init__(self):
        validate(self)


def proximal_term(model, anchor: dict, coef: float):
    """coef/2 * sum ||p - anchor[p]||^2 over the parameters named in `anchor`."""
    params = dict(model.named_parameters())
    terms = [((params[k] - a) ** 2).sum() for k, a in anchor.items() if k in params and params[k].requires_grad]
    return 0.5 * coef * torch.stack(terms).sum()


@register
class FedProx(Algorithm):
    name = "fedprox"
    Config = FedProxConfig

    def local_hooks(self, client_id, down, private):
        anchor = {k: v.detach().to(self.ctx.device, copy=True) for k, v in down[MODEL].items()}
        return {"regularizer": lambda model: proximal_term(model, anchor, self.config.mu)}

    def functional_hooks(self, client_id, down, private):
        mu = self.config.mu  # the same proximal term on one client's parameters and its download (vectorized)
        return {"regularizer": lambda params, anchor: 0.5 * mu * torch.stack(
            [((params[k] - a) ** 2).sum() for k, a in anchor.items() if k in params]).sum()}
