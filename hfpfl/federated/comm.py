"""Communication accounting: exact bytes of the tensors that travel."""
from __future__ import annotations

import torch

TensorDict = dict[str, torch.Tensor]


def tensor_bytes(tensors: TensorDict | None) -> int:
    """Bytes on the wire for a payload of tensors (numel x element size, no compression)."""
    if not tensors:
        return 0
    return sum(t.numel() * t.element_size() for t in tensors.values())


def num_elements(tensors: TensorDict | None) -> int:
    if not tensors:
        return 0
    return sum(t.numel() for t in tensors.values())


class CommLedger:
    """Bytes down (server->client) and up (client->server) per client per round."""

    def __init__(self):
        self.rounds: dict[int, dict[int, tuple[int, int]]] = {}

    def record(self, round_idx: int, client_id: int, down: int, up: int) -> None:
        self.rounds.setdefault(round_idx, {})[client_id] = (int(down), int(up))

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
        }

    def to_json(self) -> dict:
        return {str(r): {str(c): list(v) for c, v in per.items()} for r, per in self.rounds.items()}

    @classmethod
    def from_json(cls, data: dict) -> "CommLedger":
        ledger = cls()
        for r, per in data.items():
            for c, (d, u) in per.items():
                ledger.record(int(r), int(c), d, u)
        return ledger
