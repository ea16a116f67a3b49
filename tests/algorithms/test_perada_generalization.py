"""PerAda's generalization metrics (paper Sec. 5, Table 1): every personal model on the union of all clients' test
sets and on the corrupted global test split, each the mean over clients. Pinned with personal models that always
predict one class, so every accuracy is a label count by hand (and unchanged by any corruption of the images)."""
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers.modeling_outputs import ImageClassifierOutput

from hfpfl.algorithms.perada import generalization_accuracy
from hfpfl.training import TensorData


class Always(nn.Module):
    """Predicts class ``k`` for every image."""

    def __init__(self, k: int, num_labels: int = 3):
        super().__init__()
        self.k, self.n = k, num_labels

    def forward(self, pixel_values, labels=None):
        logits = torch.zeros(len(pixel_values), self.n)
        logits[:, self.k] = 1.0
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return ImageClassifierOutput(loss=loss, logits=logits)


def _split(labels):
    return TensorData(torch.zeros(len(labels), 1, 8, 8), torch.tensor(labels))


def test_union_and_corrupted_global_accuracy_by_hand(monkeypatch):
    tests = {0: _split([0, 0, 1]), 1: _split([1, 2, 2, 2])}       # union: labels 0,0,1,1,2,2,2 (7 images)
    glob = _split([0, 1, 1, 1, 2])                                   # global: 1 x 0, 3 x 1, 1 x 2
    models = {0: Always(0), 1: Always(2)}
    seen = []

    def personal_models(cids, state, r):
        seen.append((list(cids), state, r))
        return ((c, models[c]) for c in cids)

    sim = SimpleNamespace(
        num_clients=2, test_data=tests.__getitem__, global_test_data=lambda: glob, server_state="S", round=7,
        data=SimpleNamespace(num_labels=3, image_size=8, num_channels=1), args=SimpleNamespace(seed=0,
                                                                                               eval_batch_size=4),
        device=torch.device("cpu"), evaluator=SimpleNamespace(personal_models=personal_models),
        ctx=SimpleNamespace(owned=lambda ids: list(ids), gather=lambda rows: rows))
    from hfpfl.algorithms import perada
    real, made = perada.corrupted_copy, []
    monkeypatch.setattr(perada, "corrupted_copy", lambda *a: made.append(a[1:]) or real(*a))
    sim.args.seed = 4
    got = generalization_accuracy(sim)
    # the global split under every corruption hfpfl has, severity 3, one seed for every model: 4 * 1000 + 999
    assert made == [(kind, 3, 4999, 3, 8, 1) for kind in ("noise", "color", "rotation")]
    # union: client 0 (always 0) is right on 2 of 7, client 1 (always 2) on 3 of 7
    assert got["personal_accuracy_union"] == pytest.approx((2 / 7 + 3 / 7) / 2)
    # corrupted global, every corruption alike for a constant model: 1 of 5 for each client
    assert got["personal_accuracy_global_corrupted"] == pytest.approx((1 / 5 + 1 / 5) / 2)
    assert seen == [([0, 1], "S", 7)]  # the engine's personal models of the final state and round
