"""Communication accounting: exact bytes of the tensors that travel."""
from __future__ import annotations

import torch

TensorDict = dict[str, torch.Tensor]
Parts = dict[str, TensorDict]   # named parts of a state or payload: {"model": {...}, "control": {...}}


def _leaves(tensors):
    for v in (tensors or {}).values():
        if isinstance(v, dict):
            yield from _leaves(v)
        else:
            yield v


def tensor_bytes(tensors: TensorDict | Parts | None) -> int:
    """Bytes on the wire for a payload of tensors or of named parts (numel x element size, no compression)."""
    return sum(t.numel() * t.element_size() for t in _leaves(tensors))


def bytes_by_part(parts: Parts | None) -> dict[str, int]:
    return {name: tensor_bytes(p) for name, p in (parts or {}).items()}


def num_elements(tensors: TensorDict | Parts | None) -> int:
    return sum(t.numel() for t in _leaves(tensors))


def flatten_parts(parts: Parts) -> TensorDict:
    """``{"model": {"w": t}}`` -> ``{"model/w": t}`` (safetensors files hold flat names)."""
    return {f"{p}/{k}": v for p, d in parts.items() for k, v in d.items()}


def unflatten_parts(flat: TensorDict) -> Parts:
    out: Parts = {}
    for name, v in flat.items():
        p, _, k = name.partition("/")
        out.setdefault(p, {})[k] = v
    return out


class CommLedger:
    """Bytes down (server->client) and up (client->server) per client per round."""

    def __init__(self):
        self.rounds: dict[int, dict[int, tuple[int, int]]] = {}
        self.by_part: dict[str, list[int]] = {}   # part -> [bytes down, bytes up] over the run

    def record(self, round_idx: int, client_id: int, down: int, up: int, parts_down: dict | None = None,
               parts_up: dict | None = None) -> None:
        self.rounds.setdefault(round_idx, {})[client_id] = (int(down), int(up))
        for i, per in enumerate((parts_down or {}, parts_up or {})):
            for p, b in per.items():
                self.by_part.setdefault(p, [0, 0])[i] += int(b)

    def round_totals(self, round_idx: int) -> tuple[int, int]:
        per = self.rounds.get(round_idx, {})
        return sum(d for d, _ in per.values()), sum(u for _, u in per.values())

    def totals(self) -> dict:
        down = sum(self.round_totals(r)[0] for r in self.rounds)
        up = sum(self.round_totals(r)[1] for r in self.rounds)
        per_client: dict[int, list[int]] = {}
        for per in self.rounds.values():
            for cid, (d, u) in per.items():
                acc = per_client.setdefault(cid, [0, 0])
                acc[0] += d
                acc[1] += u
        return {
            "bytes_down": down,
            "bytes_up": up,
            "per_client": {str(c): {"bytes_down": d, "bytes_up": u} for c, (d, u) in sorted(per_client.items())},
            "by_part": {p: {"bytes_down": d, "bytes_up": u} for p, (d, u) in sorted(self.by_part.items())},
        }

    def to_json(self) -> dict:
        return {"rounds": {str(r): {str(c): list(v) for c, v in per.items()} for r, per in self.rounds.items()},
                "by_part": self.by_part}

    @classmethod
    def from_json(cls, data: dict) -> "CommLedger":
        ledger = cls()
        for r, per in data.get("rounds", {}).items():
            for c, (d, u) in per.items():
                ledger.record(int(r), int(c), d, u)
        ledger.by_part = {p: list(v) for p, v in data.get("by_part", {}).items()}
        return ledger
