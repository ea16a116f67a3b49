"""Optimizers for local training: building one (parameter groups, sgd / adam / adamw), and its per-parameter
state as a flat tensor dict and back (methods that keep optimizer state across rounds)."""
from __future__ import annotations

from typing import Iterable

import torch


def make_optimizer(params: Iterable, name: str, lr: float, momentum: float = 0.0,
                   weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """An optimizer over a parameter list or over parameter groups (dicts with ``params`` and per-group options,
    e.g. FedPCE's embedding / MLP / base learning rates)."""
    params = list(params)
    if params and isinstance(params[0], dict):
        groups = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in params]
        groups = [g for g in groups if g["params"]]
    else:
        groups = [{"params": [p for p in params if p.requires_grad]}]
        groups = groups if groups[0]["params"] else []
    if not groups:
        raise ValueError("nothing to train: the parameter list is empty (are all parameters frozen?)")
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(groups, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; choose one of: sgd, adam, adamw")


def optimizer_state_tensors(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, torch.Tensor]:
    """An optimizer's per-parameter state as a flat tensor dict keyed ``<param name>.<field>`` (Adam's ``step``,
    ``exp_avg``, ...; SGD's ``momentum_buffer``): storable per client and in safetensors checkpoints.
    ``names`` maps ``id(param)`` to the parameter's name."""
    out = {}
    for p, st in optimizer.state.items():
        for field, v in st.items():
            if v is None:
                continue
            t = v if torch.is_tensor(v) else torch.tensor(v)
            # contiguous: a buffer made while the weight was channels_last (conv_channels_last) must still save
            out[f"{names[id(p)]}.{field}"] = t.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)
    return out


@torch.no_grad()
def load_optimizer_state(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor],
                         names: dict[int, str]) -> None:
    """Inverse of :func:`optimizer_state_tensors` (state for parameters it does not name stays fresh)."""
    if not tensors:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            prefix = names[id(p)] + "."
            st = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix) and "." not in k[len(prefix):]}
            if st:
                optimizer.state[p] = {f: (v.to(p.device) if f != "step" else v.clone()) for f, v in st.items()}
