"""Clients sharded over processes: balanced fixed ownership, and the global test set scored once, split over them."""
import threading

import torch
from torch import nn

from hfpfl.federated import distributed
from hfpfl.federated.distributed import Ownership, batch_shard, evaluate_sharded
from hfpfl.training import Metric, TensorData, evaluate


def test_ownership_is_greedy_longest_processing_time_by_hand():
    # sizes [10, 1, 1, 1, 9] on 2 processes, largest first (ties by id), each to the least-loaded (ties: rank 0):
    # 0 (10) -> p0; 4 (9) -> p1; 1 (1) -> p1 (9 < 10); 2 (1) -> p0 (10 = 10, lowest rank); 3 (1) -> p1 (10 < 11)
    sizes = [10, 1, 1, 1, 9]
    o0, o1 = Ownership(sizes, 2, 0), Ownership(sizes, 2, 1)
    assert [o0.owner(c) for c in range(5)] == [0, 1, 0, 1, 1]
    assert o0.loads == o1.loads == [11.0, 11.0]           # i % 2 would give 20 vs 2
    assert o0.owned([4, 3, 2, 1, 0]) == [2, 0] and o1.owned(range(5)) == [1, 3, 4]   # order kept
    assert o0.share([0, 1, 4], sizes) == [10.0, 10.0]     # a round's share per process
    # 3 processes: 0 -> p0, 4 -> p1, then the three 1s all go to p2 (1 < 9 < 10, 2 < 9, 3 < 9)
    assert [Ownership(sizes, 3, 2).owner(c) for c in range(5)] == [0, 2, 2, 2, 1]
    assert Ownership(sizes, 1, 0).owned([3, 1]) == [3, 1]
    # equal sizes: round robin
    assert [Ownership([5] * 5, 2, 0).owner(c) for c in range(5)] == [0, 1, 0, 1, 0]


def test_ownership_groups_balance_separately():
    # training clients 0-2 and new clients 3-4 are worked on at different times: each group balanced on its own
    o = Ownership([5, 4, 3, 2, 2], 2, 0, groups=[range(3), range(3, 5)])
    assert [o.owner(c) for c in range(5)] == [0, 1, 1, 0, 1]
    assert o.loads == [7.0, 9.0]


def test_engine_ownership_uses_split_sizes(run_sim):
    sim, _ = run_sim("fedavg", run=False)
    costs = [3 * len(c.train) + len(c.test) for c in sim.data.clients]
    assert sim.ownership.world_size == 1 and sim.ownership.loads == [float(sum(costs) + sum(
        3 * len(c.train) + len(c.test) for c in sim.data.new_clients))]
    assert sim.ctx.owned([2, 0]) == [2, 0]


def test_batch_shard_whole_batches_contiguous():
    assert [batch_shard(1000, 256, 2, r) for r in range(2)] == [(0, 512), (512, 1000)]
    assert [batch_shard(1000, 256, 3, r) for r in range(3)] == [(0, 512), (512, 768), (768, 1000)]
    assert batch_shard(1000, 256, 5, 4) == (1000, 1000)   # more processes than batches: nothing to score
    assert batch_shard(100, 256, 2, 0) == (0, 100) and batch_shard(100, 256, 2, 1) == (100, 100)


class _FakeAccelerator:
    def __init__(self, world, rank):
        self.num_processes, self.process_index = world, rank


def _threaded_all_gather(world):
    """all_gather for `world` threads standing in for processes (rank order, as gather_object)."""
    box, barrier = {}, threading.Barrier(world)

    def gather(items, acc):
        box[acc.process_index] = list(items)
        barrier.wait()
        out = [x for r in range(world) for x in box[r]]
        barrier.wait()
        return out
    return gather


def test_evaluate_sharded_gives_one_process_numbers_exactly(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 5))

    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, pixel_values):
            return type("Out", (), {"logits": self.m(pixel_values)})()

    net = Wrapped()
    data = TensorData(torch.randn(50, 3, 2, 2), torch.randint(0, 5, (50,)))
    whole = evaluate(net, data, batch_size=7, metric=Metric())
    world = 3
    monkeypatch.setattr(distributed, "all_gather", _threaded_all_gather(world))
    results, seen = [None] * world, [0] * world

    def run(rank):
        def ev(d, m):
            seen[rank] += len(d)
            return evaluate(net, d, batch_size=7, metric=m)
        results[rank] = evaluate_sharded(ev, data, Metric(), 7, _FakeAccelerator(world, rank))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == [21, 21, 8]           # 8 batches of 7 (the last holds 1 row): 3 + 3 + 2 batches, each row once
    assert all(r == whole for r in results)   # accuracy, loss and count: the same bits as one process
    assert whole["num_samples"] == 50 and 0 < whole["loss"]


def test_checkpointed_clients_load_on_their_owner_under_another_world_size(run_sim):
    sim, _ = run_sim("fedbn", num_rounds=1, output_dir="ck")   # FedBN keeps private BN statistics per client
    assert sorted(sim.store.clients()) == [0, 1, 2, 3]
    resumed, _ = run_sim("fedbn", num_rounds=1, output_dir="ck", resume_from_checkpoint="latest",
                         overwrite_output_dir=False, run=False)
    # as if resumed by 2 processes with owners from sizes [10, 1, 1, 1] (+ 1 new client): 0 -> p0, 1, 2, 3 -> p1
    for rank, mine in ((0, [0]), (1, [1, 2, 3])):
        resumed.ownership = Ownership([10, 1, 1, 1, 5], 2, rank, groups=[range(4), range(4, 5)])
        resumed.load_checkpoint("latest")
        assert sorted(resumed.store.clients()) == mine
        for c in mine:
            assert all(torch.equal(v, sim.store.get(c)["model"][k]) for k, v in resumed.store.get(c)["model"].items())
