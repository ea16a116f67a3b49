"""A model's declared loss (transformers' ``loss_function`` convention): equal to the model's own loss, and the
vectorized engine's step with it outside ``vmap`` gives the sequential loop's numbers."""
import dataclasses
import math

import pytest
import torch
from torch import nn
from transformers import ResNetConfig, ResNetForImageClassification, ViTConfig, ViTForImageClassification

from hfpfl.algorithms import get_algorithm, register
from hfpfl.algorithms.fedavg import FedAvg
from hfpfl.algorithms.fedprox import FedProx
from hfpfl.config import RunArguments
from hfpfl.federated.engine import Simulation
from hfpfl.federated.vectorized import trainer
from hfpfl.training import declared_loss
from toy_problem import TinyMLP

torch.set_num_threads(1)


def test_declared_loss_of_a_transformers_classifier_is_its_own_loss_and_the_hand_cross_entropy():
    torch.manual_seed(0)
    models = [ResNetForImageClassification(ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16],
                                                        depths=[1, 1], num_labels=3)),
              ViTForImageClassification(ViTConfig(image_size=8, patch_size=4, hidden_size=16, num_hidden_layers=1,
                                                  num_attention_heads=2, intermediate_size=16, num_labels=3))]
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 2, 1, 2])
    for model in models:
        model.eval()
        fn = declared_loss(model)
        assert fn is not None, type(model).__name__
        out = model(pixel_values=x, labels=y)
        logits = out.logits.detach()
        # by hand: the mean over the 4 examples of -log softmax(logits)[label]
        hand = sum(-(logits[i, y[i]] - torch.logsumexp(logits[i], 0)) for i in range(4)) / 4
        assert fn(logits, y).item() == pytest.approx(hand.item(), abs=1e-6)
        assert fn(logits, y).item() == pytest.approx(out.loss.item(), abs=1e-7)


def test_no_declared_loss_where_the_head_is_not_single_label_classification():
    torch.manual_seed(0)
    reg = ResNetForImageClassification(ResNetConfig(embedding_size=8, hidden_sizes=[8], depths=[1], num_labels=1))
    multi = ResNetForImageClassification(ResNetConfig(embedding_size=8, hidden_sizes=[8], depths=[1], num_labels=3,
                                                      problem_type="multi_label_classification"))
    assert declared_loss(reg) is None and declared_loss(multi) is None
    assert declared_loss(nn.Linear(2, 2)) is None  # a plain module declares nothing unless it says so

    class Own(nn.Module):
        def loss_function(self, logits, labels):
            return nn.functional.cross_entropy(logits, labels)

    assert declared_loss(Own()) is not None


class DeclaringMLP(TinyMLP):
    """A plain module (no HF config, no convolution: the summed-loss step) declaring its loss, which its own
    forward uses too; BatchNorm1d."""

    def task_loss(self, logits, labels):
        return self.loss_function(logits, labels)

    def loss_function(self, logits, labels):
        calls.append(tuple(logits.shape))
        return nn.functional.cross_entropy(logits, labels)


calls: list = []
for base in (FedAvg, FedProx):
    name = f"declaring_mlp_{base.name}"
    register(type(name, (base,), {"name": name, "build_model": lambda self: (torch.manual_seed(0),
                                                                              DeclaringMLP(self.ctx.num_labels))[1]}))


@pytest.fixture(scope="module")
def ragged(small_digits):
    data_args, fed = small_digits
    clients = [dataclasses.replace(c, train=c.train.select(range(len(c.train) - 7 * i)))
               for i, c in enumerate(fed.clients)]
    return data_args, dataclasses.replace(fed, clients=clients, new_clients=[])


@pytest.mark.parametrize("method", ["declaring_mlp_fedavg", "declaring_mlp_fedprox"])
def test_vectorized_step_with_the_declared_loss_outside_vmap_matches_the_sequential_loop(ragged, tmp_path,
                                                                                          monkeypatch, method):
    data_args, fed = ragged
    used = []
    real = trainer._declared_loss_step
    monkeypatch.setattr(trainer, "_declared_loss_step", lambda *a: used.append(1) or real(*a))
    sims = {}
    for vec in ("off", "on"):
        calls.clear()
        run = RunArguments(method=method, num_rounds=2, batch_size=10, lr=0.05, momentum=0.5, progress=False,
                           checkpoint_every=0, output_dir=str(tmp_path / vec), overwrite_output_dir=True,
                           vectorize=vec)
        sims[vec] = Simulation(run, data_args, get_algorithm(method).Config(), fed_data=fed)
        sims[vec].run()
        if vec == "on":
            # one call over every client's logits of a step's group: 4 clients x 10 images, 10 labels
            assert used and (40, 10) in calls
    seq, vec = sims["off"], sims["on"]
    for k, v in seq.server_state["model"].items():
        assert torch.allclose(v.double(), vec.server_state["model"][k].double(), atol=2e-5, rtol=1e-4), k
    for hs, hv in zip(seq.history, vec.history):
        assert math.isclose(hs["train_loss"], hv["train_loss"], abs_tol=1e-5)
