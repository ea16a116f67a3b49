"""Per-client private state, swapped in and out of the one model instance of this process.

Device placement is explicit and uniform: every tensor of a state (server state, uploads, downloads, private
state) is a CPU tensor; only the model lives on the accelerator device. :func:`snapshot` copies to the CPU and
:func:`load_into` copies onto the model's device."""
from __future__ import annotations

import torch

from .comm import Parts, TensorDict


class Fresh(dict):
    """A tensor dict of fresh CPU copies that nothing else references (what :func:`snapshot` returns): the client
    store keeps it as it is instead of copying it again."""


def snapshot(model_state: TensorDict, keys) -> TensorDict:
    """Detached CPU copies of `keys` from a (cached) state dict."""
    return Fresh({k: model_state[k].detach().to("cpu", copy=True) for k in keys})


@torch.no_grad()
def load_into(model_state: TensorDict, values: TensorDict, memo: dict | None = None) -> None:
    """Copy `values` into the model's tensors in place (state dict entries share storage with the model).

    ``memo`` (a dict kept by the caller across calls) skips the copy of a key whose model tensor still holds exactly
    the value last copied into it: the same source tensor, unchanged (its version counter), and the model tensor
    unchanged since (its version counter; optimizers, ``copy_`` and BatchNorm updates all bump it)."""
    for k, v in values.items():
        if memo is not None:
            seen = memo.get(k)
            if seen is not None and seen[0] is v and seen[1] == v._version and seen[2] == model_state[k]._version:
                continue
        try:
            target = model_state[k]
        except KeyError:
            raise KeyError(f"state key {k!r} does not exist in the model; the checkpoint/adapter does not match "
                           f"this model (built from a different config?)") from None
        if target.shape != v.shape:
            raise ValueError(f"shape mismatch for {k!r}: model has {tuple(target.shape)}, got {tuple(v.shape)}; "
                             "the state comes from a different model config")
        target.copy_(v)
        if memo is not None:
            memo[k] = (v, v._version, target._version)


class ClientStateStore:
    """What each client keeps between rounds, only for the clients this process owns.

    Holds CPU tensors only, as named parts (adapters, heads, norms, embeddings, control variates, optimizer
    state ...), never a model copy.
    """

    def __init__(self):
        self._states: dict[int, Parts] = {}

    def get(self, client_id: int) -> Parts | None:
        return self._states.get(client_id)

    def put(self, client_id: int, state: Parts | None) -> None:
        """Keep CPU copies of ``state`` (parts that are :class:`Fresh` snapshots are kept as they are)."""
        if state is None:
            return
        self._states[client_id] = {p: dict(d) if isinstance(d, Fresh) else
                                   {k: v.detach().to("cpu", copy=True) for k, v in d.items()}
                                   for p, d in state.items()}

    def clear(self) -> None:
        self._states.clear()

    def __contains__(self, client_id: int) -> bool:
        return client_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def clients(self) -> list[int]:
        return sorted(self._states)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self._states.values() for d in s.values() for t in d.values())

    # flat form for safetensors checkpoints: "<client>::<part>/<key>"
    def flatten(self) -> TensorDict:
        return {f"{cid}::{p}/{k}": v.contiguous() for cid, s in self._states.items() for p, d in s.items()
                for k, v in d.items()}

    def load_flat(self, flat: TensorDict, keep=lambda cid: True) -> None:
        for name, tensor in flat.items():
            cid_s, rest = name.split("::", 1)
            part, _, key = rest.partition("/")
            cid = int(cid_s)
            if keep(cid):
                self._states.setdefault(cid, {}).setdefault(part, {})[key] = tensor
