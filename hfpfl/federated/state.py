"""Per-client private state, swapped in and out of the one model instance of this process."""
from __future__ import annotations

import torch

from .comm import TensorDict


def snapshot(model_state: TensorDict, keys) -> TensorDict:
    """Detached copies of `keys` from a (cached) state dict."""
    return {k: model_state[k].detach().clone() for k in keys}


@torch.no_grad()
def load_into(model_state: TensorDict, values: TensorDict) -> None:
    """Copy `values` into the model's tensors in place (state dict entries share storage with the model)."""
    for k, v in values.items():
        try:
            target = model_state[k]
        except KeyError:
            raise KeyError(f"state key {k!r} does not exist in the model; the checkpoint/adapter does not match "
                           f"this model (built from a different config?)") from None
        if target.shape != v.shape:
            raise ValueError(f"shape mismatch for {k!r}: model has {tuple(target.shape)}, got {tuple(v.shape)}; "
                             "the state comes from a different model config")
        target.copy_(v)


class ClientStateStore:
    """What each client keeps between rounds, only for the clients this process owns.

    Holds CPU tensors only (adapters, heads, norms, embeddings, control variates ...), never a model copy.
    """

    def __init__(self):
        self._states: dict[int, TensorDict] = {}

    def get(self, client_id: int) -> TensorDict | None:
        return self._states.get(client_id)

    def put(self, client_id: int, state: TensorDict | None) -> None:
        if state is None:
            return
        self._states[client_id] = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}

    def __contains__(self, client_id: int) -> bool:
        return client_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def clients(self) -> list[int]:
        return sorted(self._states)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self._states.values() for t in s.values())

    # flat form for safetensors checkpoints: "<client>::<key>"
    def flatten(self) -> TensorDict:
        return {f"{cid}::{k}": v.contiguous() for cid, s in self._states.items() for k, v in s.items()}

    def load_flat(self, flat: TensorDict, keep=lambda cid: True) -> None:
        for name, tensor in flat.items():
            cid_s, key = name.split("::", 1)
            cid = int(cid_s)
            if keep(cid):
                self._states.setdefault(cid, {})[key] = tensor
