"""Which role each model key has (global, private or frozen), and the check that frozen state stays frozen."""
from __future__ import annotations

import torch
from torch import nn

from .state import FROZEN, GLOBAL, PRIVATE, snapshot


def assign_roles(model: nn.Module, model_state: dict, algorithm) -> dict[str, list[str]]:
    """Default roles: trainable params -> global, frozen params -> frozen; a buffer follows its module (buffers of
    frozen modules, e.g. BN statistics of a frozen backbone, drift locally: private); the method's ``key_role``
    decides. Frozen parameters stop requiring gradients."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    roles = {GLOBAL: [], PRIVATE: [], FROZEN: []}
    for key in model_state:
        if key in params:
            default = GLOBAL if params[key].requires_grad else FROZEN
        else:
            module = modules.get(key.rsplit(".", 1)[0] if "." in key else "")
            own = list(module.parameters(recurse=False)) if module is not None else []
            if not own:
                default = FROZEN
            else:
                default = GLOBAL if any(p.requires_grad for p in own) else PRIVATE
        role = algorithm.key_role(key, default)
        if role not in roles:
            raise ValueError(f"{type(algorithm).__name__}.key_role returned {role!r} for {key!r}")
        roles[role].append(key)
    for key in roles[FROZEN]:
        if key in params:
            params[key].requires_grad_(False)
    return roles


class FrozenCheck:
    """Frozen keys that training could still change (floating buffers such as BN running statistics), with their
    values at the start: :meth:`check` refuses a round that changed one."""

    def __init__(self, model: nn.Module, model_state: dict, frozen_keys: list[str], algorithm):
        params = dict(model.named_parameters())
        self.model_state, self.algorithm = model_state, algorithm
        self.keys = [k for k in frozen_keys if k not in params and torch.is_floating_point(model_state[k])]
        self.reference = snapshot(model_state, self.keys)

    def check(self, where: str) -> None:
        for k in self.keys:
            if not torch.equal(self.model_state[k].cpu(), self.reference[k]):
                raise ValueError(f"{where}: {k!r} has role 'frozen' but changed during training (statistics that "
                                 f"change are state): {type(self.algorithm).__name__}.key_role must make it "
                                 "'private' or 'global', or keep its module in eval mode")
