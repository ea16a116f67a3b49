"""The engine's data cache holds one converted copy per split object: clients built on the same Dataset (the scale
bench's 10,000 clients over 1,000 splits) share it, and sharing changes no number."""
import dataclasses

import pytest
import torch

from hfpfl.config import RunArguments
from hfpfl.federated.engine import Simulation


@pytest.fixture(scope="module")
def shared(small_digits):
    """6 clients over the small federation's first 2 splits: client i trains and tests on split i % 2."""
    data_args, fed = small_digits
    clients = [dataclasses.replace(fed.clients[i % 2], client_id=i) for i in range(6)]
    return data_args, dataclasses.replace(fed, clients=clients, new_clients=[])


def _sim(data, tmp_path, name, **kw):
    data_args, fed = data
    run = RunArguments(method="local", model="tiny-resnet", adapter="lora", lora_r=2, num_rounds=1, batch_size=16,
                       local_steps=1, random_backbone_ok=True, progress=False, checkpoint_every=0,
                       output_dir=str(tmp_path / name), overwrite_output_dir=True, vectorize="off", **kw)
    return Simulation(run, dataclasses.replace(data_args, num_clients=len(fed.clients)), fed_data=fed)


def test_clients_sharing_a_split_share_one_cached_copy(shared, tmp_path):
    sim = _sim(shared, tmp_path, "shared")
    fed = shared[1]
    for cid in range(6):
        sim.train_data(cid), sim.test_data(cid)
    assert sim.train_data(0) is sim.train_data(2) is sim.train_data(4)
    assert sim.train_data(1) is not sim.train_data(0)
    assert len(sim.splits.entries) == 4  # 2 train + 2 test splits, not 6 clients x 2
    # by hand: 3x16x16 uint8 pixels (768 B) + an int64 label (8 B) per image, each split counted once
    images = sum(len(fed.clients[i].train) + len(fed.clients[i].test) for i in range(2))
    assert sim.splits.bytes == images * (3 * 16 * 16 + 8)


def test_sharing_a_split_changes_no_number(shared, tmp_path):
    """The same run on copies of the splits (a Dataset object per client, one cached copy each) gives the same
    history, per-client accuracies and personal adapters."""
    data_args, fed = shared
    copies = [dataclasses.replace(c, train=c.train.select(range(len(c.train))), test=c.test.select(range(len(c.test))))
              for c in fed.clients]
    own = (data_args, dataclasses.replace(fed, clients=copies))
    a, b = _sim(shared, tmp_path, "a"), _sim(own, tmp_path, "b")
    ra, rb = a.run(), b.run()
    assert len(a.splits.entries) < len(b.splits.entries)
    assert a.history == b.history
    assert ra["per_client_accuracy"] == rb["per_client_accuracy"] and len(ra["per_client_accuracy"]) == 6
    for cid in range(6):  # every client's personal adapter, bit for bit
        sa, sb = a.store.get(cid)["model"], b.store.get(cid)["model"]
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
