"""FedProx (Li et al. 2020): local objective + mu/2 ||w - w_global||^2. mu = 0 is exactly FedAvg."""
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from ..options import non_negative, validate
from .base import Algorithm, register


@dataclass
class FedProxConfig:
    mu: float = field(default=0.01, metadata={"help": "FedProx proximal coefficient mu (0 = FedAvg).",
                                              "check": non_negative()})
    #: the options that set the step size of what this method trains (named when training diverges; --lr always is)
    STEP_SIZES: ClassVar[dict[str, str]] = {"mu": "lower"}

    def __post_init__(self):
        validate(self)


def proximal_term(params, anchor: dict, coef: float):
    """coef/2 * sum ||p - anchor[p]||^2 over the trainable parameters named in ``anchor``. ``params``: a model, or
    its trainable parameters by name (a method's local hook, on either path)."""
    if isinstance(params, nn.Module):
        params = {n: p for n, p in params.named_parameters() if p.requires_grad}
    terms = [((params[k] - a) ** 2).sum() for k, a in anchor.items() if k in params]
    return 0.5 * coef * torch.stack(terms).sum()


@register
class FedProx(Algorithm):
    name = "fedprox"
    Config = FedProxConfig

    def local_hooks(self, client_id, down, private):
        mu = self.config.mu  # the proximal pull of the client's parameters to its download (Li et al. 2020, Eq. 2)
        return {"regularizer": lambda params, anchor: proximal_term(params, anchor, mu)}
