"""The trailing-batch rule of the training loop, and the Central oracle under a Dirichlet label skew.

The label-skew FedBiP comparison's Central oracle sat at chance (0.098) because its pooled set (290 images = 9 x 32
+ 2) ended every epoch with a training step on 2 images: at the tiny ResNet's 1x1 last stage, BatchNorm maps every
channel of a 2-image batch to exactly +-1. The loop now merges a trailing batch of fewer than ``MIN_TRAIN_BATCH``
images into the previous one (one rule, shared by the vectorized engine and FedDAT's step counts)."""
import dataclasses
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from hfpfl.training import MIN_TRAIN_BATCH, TensorData, batch_bounds, iterate_batches, train_local  # noqa: E402

torch.set_num_threads(1)


def test_batch_bounds_by_hand():
    assert MIN_TRAIN_BATCH == 8
    # 290 = 9 x 32 + 2: the 2 join the ninth batch (34 images); evaluation keeps them apart
    b = batch_bounds(290, 32)
    assert len(b) == 9 and b[-1] == (256, 290) and b[:2] == [(0, 32), (32, 64)]
    assert batch_bounds(290, 32, "keep")[-1] == (288, 290)
    assert batch_bounds(41, 32) == [(0, 32), (32, 41)]  # 9 >= 8: a batch of its own
    assert batch_bounds(39, 32) == [(0, 39)]  # 7 < 8: merged
    assert batch_bounds(33, 32) == [(0, 33)]  # the old singleton rule is a special case
    assert batch_bounds(5, 32) == [(0, 5)]  # a set smaller than a batch is one batch, never dropped
    assert batch_bounds(0, 32) == []
    assert batch_bounds(10, 4) == [(0, 4), (4, 10)]
    # a batch as large as the batch size asked for is never merged, also below MIN_TRAIN_BATCH
    assert batch_bounds(10, 5) == [(0, 5), (5, 10)]
    assert batch_bounds(12, 4) == [(0, 4), (4, 8), (8, 12)]
    with pytest.raises(ValueError, match="batch_size"):
        batch_bounds(10, 0)


def test_every_path_uses_the_same_rule():
    from hfpfl.algorithms.feddat import steps_per_epoch
    from hfpfl.federated.vectorized import batch_schedule

    for n, bs in [(290, 32), (34, 16), (41, 32), (33, 32), (7, 3), (100, 16)]:
        data = TensorData(torch.zeros(n, 1), torch.arange(n))
        sizes = [len(b["labels"]) for b in iterate_batches(data, bs, shuffle=True,
                                                            generator=torch.Generator().manual_seed(0))]
        sched = batch_schedule(n, bs, epochs=1, max_steps=None, generator=torch.Generator().manual_seed(0))
        assert sizes == [len(s) for s in sched] == [e - s for s, e in batch_bounds(n, bs)]
        assert steps_per_epoch(n, bs) == len(sizes)
        assert sum(sizes) == n  # nothing dropped
    # evaluation sees every batch as it is (and every sample once)
    data = TensorData(torch.zeros(34, 1), torch.arange(34))
    assert [len(b["labels"]) for b in iterate_batches(data, 16, shuffle=False, last="keep")] == [16, 16, 2]


# ------------------------------------------------------------------------------ Central under a Dirichlet skew
@pytest.fixture(scope="module")
def skewed():
    """5 mnistm clients with Dirichlet(0.5) label skew (the fedbip_dirichlet setting, 16x16), trimmed so that the
    pooled train set has 2 x 32 + 2 images: the size that left the old Central with a 2-image step per epoch."""
    from hfpfl.data import DataArguments, build_federated_dataset

    args = DataArguments(dataset="mnistm", partition="dirichlet", alpha=0.5, num_clients=5, min_partition_size=30,
                         max_per_domain=300, image_size=16, test_fraction=0.3)
    fed = build_federated_dataset(args, seed=0)
    keep = [14, 13, 13, 13, 13]  # a prefix of every client's train split, 66 images in all
    fed = dataclasses.replace(fed, clients=[dataclasses.replace(c, train=c.train.select(range(k)))
                                            for c, k in zip(fed.clients, keep)])
    assert sum(len(c.train) for c in fed.clients) == 66 == 2 * 32 + 2
    return args, fed


def test_central_pools_exactly_the_clients_train_sets_and_learns(skewed, tmp_path):
    from hfpfl.algorithms.central import Central, CentralConfig
    from hfpfl.config import RunArguments
    from hfpfl.federated.engine import Simulation
    from hfpfl.training import evaluate

    args, fed = skewed
    pooled = {}
    orig = Central.aggregate

    def spy(self, server_state, updates, round_idx):
        pooled["x"] = torch.cat([u.upload["data"]["pixel_values"] for u in updates])
        pooled["y"] = torch.cat([u.upload["data"]["labels"] for u in updates])
        pooled["ids"] = [u.client_id for u in updates]
        return orig(self, server_state, updates, round_idx)

    run = RunArguments(method="central", num_rounds=1, batch_size=32, lr=0.05, momentum=0.9,
                       output_dir=str(tmp_path / "central"), progress=False, checkpoint_every=0,
                       overwrite_output_dir=True, model="tiny-resnet")
    sim = Simulation(run, args, CentralConfig(epochs=15), fed_data=fed)
    Central.aggregate = spy
    try:
        res = sim.run()
    finally:
        Central.aggregate = orig
    # the pooled set is the union of the clients' train splits, images with their own labels, in client order
    assert pooled["ids"] == list(range(5))
    want_x = torch.cat([sim.train_data(i).pixel_values for i in range(5)])
    want_y = torch.cat([sim.train_data(i).labels for i in range(5)])
    assert torch.equal(pooled["x"], want_x) and torch.equal(pooled["y"], want_y)
    ds_labels = np.concatenate([np.asarray(c.train.with_format(None)["labels"]) for c in fed.clients])
    assert pooled["y"].tolist() == ds_labels.tolist()
    assert len(set(ds_labels.tolist())) >= 8  # the union covers (almost) every class although each client is skewed
    # and the oracle learns it: fit of its own 66 training images far above chance (old loop: ~0.1)
    model = sim.algorithm.load_global(sim.server_state)
    fit = evaluate(model, TensorData(pooled["x"], pooled["y"]), device=sim.device)["accuracy"]
    assert fit >= 0.5, fit
    assert res["final"]["global_accuracy"] is not None


# ------------------------------------------------------------------------------ --last_batch merge | keep | drop
def test_last_batch_rules_by_hand():
    # 131 images in batches of 10 (a 20-client MNIST client): 13 full batches and 1 image
    assert batch_bounds(131, 10, "merge")[-1] == (120, 131) and len(batch_bounds(131, 10, "merge")) == 13
    assert batch_bounds(131, 10, "keep")[-2:] == [(120, 130), (130, 131)] and len(batch_bounds(131, 10, "keep")) == 14
    assert batch_bounds(131, 10, "drop")[-1] == (120, 130) and len(batch_bounds(131, 10, "drop")) == 13
    # 7 images in batches of 5 (500 clients x 10 images): 5 + 2
    assert batch_bounds(7, 5, "merge") == [(0, 7)]  # 2 < min(8, 5): one step of 7
    assert batch_bounds(7, 5, "keep") == [(0, 5), (5, 7)]
    assert batch_bounds(7, 5, "drop") == [(0, 5)]
    # a client smaller than one batch trains on what it has under every rule
    for last in ("merge", "keep", "drop"):
        assert batch_bounds(3, 5, last) == [(0, 3)]
        assert batch_bounds(20, 5, last) == [(0, 5), (5, 10), (10, 15), (15, 20)]  # nothing partial: all alike
    with pytest.raises(ValueError, match="last"):
        batch_bounds(10, 3, "skip")


@pytest.mark.parametrize("last, sizes", [("merge", [16, 18]), ("keep", [16, 16, 2]), ("drop", [16, 16])])
def test_train_local_and_the_vectorized_schedule_follow_last_batch(last, sizes):
    """34 images in batches of 16, two epochs: merge never steps on a handful of images (the default; the old loop
    stepped on [16, 16, 2] each epoch), keep does, drop leaves the 2 out."""
    from hfpfl.federated.vectorized import batch_schedule

    seen = []

    class Spy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 3)

        def forward(self, pixel_values, labels=None):
            seen.append(len(pixel_values))
            logits = self.lin(pixel_values)
            return type("Out", (), {"logits": logits, "loss": nn.functional.cross_entropy(logits, labels)})

    m = Spy()
    data = TensorData(torch.randn(34, 2), torch.arange(34) % 3)
    out = train_local(m, data, torch.optim.SGD(m.parameters(), lr=0.1), batch_size=16, epochs=2,
                      generator=torch.Generator().manual_seed(0), last_batch=last)
    assert seen == sizes * 2 and out["steps"] == 2 * len(sizes) and out["examples"] == 2 * sum(sizes)
    sched = batch_schedule(34, 16, epochs=2, max_steps=None, generator=torch.Generator().manual_seed(0), last=last)
    assert [len(s) for s in sched] == sizes * 2


def test_last_batch_reaches_both_engine_paths(small_digits, tmp_path):
    """Two clients of 23 images in batches of 5 (4 full batches and 3 images): 4 steps each under merge (the 3 join
    the fourth batch), 5 under keep, 4 of 5 images under drop; the sequential and the vectorized round take the
    same steps and examples."""
    from hfpfl.algorithms.fedavg import FedAvg
    from hfpfl.config import RunArguments
    from hfpfl.federated.engine import Simulation

    data_args, fed = small_digits
    fed = dataclasses.replace(fed, clients=[dataclasses.replace(c, train=c.train.select(range(23)))
                                            for c in fed.clients[:2]], new_clients=[])
    data_args = dataclasses.replace(data_args, num_clients=2)
    want = {"merge": (4, 23), "keep": (5, 23), "drop": (4, 20)}
    for last, (steps, examples) in want.items():
        got = []
        for vec in ("off", "on"):
            run = RunArguments(method="fedavg", model="tiny-resnet", num_rounds=1, batch_size=5, last_batch=last,
                               vectorize=vec, progress=False, checkpoint_every=0, overwrite_output_dir=True,
                               output_dir=str(tmp_path / f"{last}-{vec}"))
            sim = Simulation(run, data_args, FedAvg.Config(), fed_data=fed)
            sim.setup()
            _, metrics = sim.run_round(1, sim.server_state)
            got.append((metrics["optimizer_steps"], metrics["examples_seen"]))
        assert got[0] == got[1] == (steps * 2, examples * 2), (last, got)
