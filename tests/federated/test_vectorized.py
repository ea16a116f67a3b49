"""Vectorized client training (``--vectorize``) gives the sequential loop's numbers; the per-client overhead cuts
(uint8 client data, LRU data cache, evaluation subsets, skipped re-loads) change nothing they should not."""
import dataclasses
import types

import pytest
import torch
from torch import nn
from transformers.modeling_outputs import ImageClassifierOutput

from hfpfl.algorithms import get_algorithm, register
from hfpfl.algorithms.fedavg import FedAvg
from hfpfl.algorithms.fedbn import FedBN
from hfpfl.algorithms.fedprox import FedProx
from hfpfl.config import RunArguments
from hfpfl.federated import vectorized
from hfpfl.federated.aggregation import memory_order
from hfpfl.federated.vectorized import chunks, policy, stacked_splits, trainer
from hfpfl.federated.vectorized.client_states import stack_values
from hfpfl.federated.vectorized.optimizer import StackedOptimizer
from hfpfl.federated.vectorized.schedules import BatchSchedules
from hfpfl.federated.engine import Simulation
from hfpfl.federated.context import NonFiniteError
from hfpfl.training import TensorData, encode_uint8, iterate_batches
from toy_problem import TinyMLP


class TinyNet(nn.Module):
    """A plain nn.Module (no HF config) with BatchNorm: conv 3->4, BN, ReLU, pool, linear."""

    def __init__(self, num_labels=10):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)  # a bias before BN has no gradient: Adam amplifies noise
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 4 * 4, num_labels)

    def forward(self, pixel_values, labels=None):
        x = nn.functional.max_pool2d(torch.relu(self.bn(self.conv(pixel_values))), 4)
        logits = self.head(x.flatten(1))
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return ImageClassifierOutput(loss=loss, logits=logits)


def _register_tiny(net, prefix: str, *bases) -> None:
    """Register ``<prefix>_<method>`` for each base method, with ``net`` (seeded) as its model."""
    def build_model(self):
        torch.manual_seed(0)
        return net(self.ctx.num_labels)

    for base in bases:
        name = f"{prefix}_{base.name}"
        register(type(name, (base,), {"name": name, "build_model": build_model}))


_register_tiny(TinyNet, "tiny", FedAvg, FedProx, FedBN)          # tiny_fedavg, tiny_fedprox, tiny_fedbn
_register_tiny(TinyMLP, "tiny_mlp", FedProx, FedBN)               # tiny_mlp_fedprox, tiny_mlp_fedbn


@pytest.fixture(scope="module")
def ragged(small_digits):
    """The small Digits federation with clients of different sizes (56, 49, 42, 35 training images)."""
    data_args, fed = small_digits
    clients = [dataclasses.replace(c, train=c.train.select(range(len(c.train) - 7 * i)))
               for i, c in enumerate(fed.clients)]
    return data_args, dataclasses.replace(fed, clients=clients, new_clients=[])


def _run(ragged, tmp_path, method, vectorize, **kw):
    data_args, fed = ragged
    run = dict(method=method, num_rounds=2, batch_size=10, lr=0.05, momentum=0.5, progress=False,
               checkpoint_every=0, output_dir=str(tmp_path / f"{method}-{vectorize}"), overwrite_output_dir=True,
               vectorize=vectorize)
    run.update(kw)
    sim = Simulation(RunArguments(**run), data_args, get_algorithm(method).Config(), fed_data=fed)
    return sim, sim.run()


def _close(a: dict, b: dict, atol=2e-5):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k].double(), b[k].double(), atol=atol, rtol=1e-4), (k, (a[k] - b[k]).abs().max())


@pytest.mark.parametrize("method", ["tiny_fedavg", "tiny_fedprox", "tiny_fedbn", "tiny_mlp_fedprox", "tiny_mlp_fedbn"])
def test_vectorized_matches_sequential(ragged, tmp_path, monkeypatch, method):
    calls, evals, probes, mismatched = [], [], [], []
    real, real_eval, real_probe = vectorized.train_chunk, vectorized.evaluate_clients, trainer.grad_layouts
    real_step = StackedOptimizer.step
    monkeypatch.setattr(vectorized, "train_chunk", lambda *a, **k: calls.append(len(a[1])) or real(*a, **k))
    monkeypatch.setattr(trainer, "grad_layouts", lambda *a: probes.append(1) or real_probe(*a))
    monkeypatch.setattr(StackedOptimizer, "step", lambda self, P, g, idx, step: mismatched.append(
        sorted(k for k in g if g[k].stride() != P[k].stride())) or real_step(self, P, g, idx, step))
    monkeypatch.setattr(vectorized, "evaluate_clients", lambda *a, **k: evals.append(len(a[1])) or real_eval(*a, **k))
    seq, rs = _run(ragged, tmp_path, method, "off")
    assert calls == []
    vec, rv = _run(ragged, tmp_path, method, "on")
    assert calls == [4, 4] and evals == [4, 4]  # both rounds, all four clients in one batched chunk
    assert len(probes) == 1  # the gradients' layouts are found once per simulation
    transposed = sorted(k for k, o in vec._grad_layouts.items() if o is not None and list(o) != sorted(o))
    if method == "tiny_mlp_fedbn":  # batched Linear weights' gradients come transposed: stored in their layout
        assert transposed == ["fc.weight", "head.weight"]  # (FedProx's: contiguous, its proximal term summed in)
    # every update of every step, in both rounds, finds parameter and gradient in the same layout
    assert len(mismatched) > 2 and all(m == [] for m in mismatched)
    _close(seq.server_state["model"], vec.server_state["model"])
    for c in range(4):  # private state (FedBN: every client's own BatchNorm affine and running statistics)
        _close(seq.store.get(c).get("model", {}), vec.store.get(c).get("model", {}))
    if method.endswith("fedbn"):
        assert seq.keys_by_role["private"] and vec.store.get(0)["model"]["bn.running_mean"].abs().sum() > 0
        # clients differ: their statistics are their own, not averaged
        assert not torch.allclose(vec.store.get(0)["model"]["bn.running_mean"], vec.store.get(3)["model"]["bn.running_mean"])
    for hs, hv in zip(seq.history, vec.history):
        assert hs["train_loss"] == pytest.approx(hv["train_loss"], abs=1e-5)
    assert rs["final"]["personal_accuracy"] == pytest.approx(rv["final"]["personal_accuracy"], abs=1e-9)
    assert rs["per_client_accuracy"] == rv["per_client_accuracy"]  # evaluated in one batched call, same scores


def test_vector_chunk_mb_splits_chunks_and_changes_no_numbers(ragged, tmp_path, monkeypatch):
    # TinyNet: 766 trainable parameters x 4 (value, gradient, two optimizer slots) x 4 bytes + 40 bytes of BN buffers
    per_client = 4 * 766 * 4 + 40
    calls, evals = [], []
    real, real_eval = vectorized.train_chunk, vectorized.evaluate_clients
    monkeypatch.setattr(vectorized, "train_chunk", lambda *a, **k: calls.append(len(a[1])) or real(*a, **k))
    monkeypatch.setattr(vectorized, "evaluate_clients", lambda *a, **k: evals.append(len(a[1])) or real_eval(*a, **k))
    one, r1 = _run(ragged, tmp_path, "tiny_fedbn", "on")
    assert calls == [4, 4]
    calls.clear(), evals.clear()
    two, r2 = _run(ragged, tmp_path / "c", "tiny_fedbn", "on", vector_chunk_mb=2.5 * per_client / 2**20)
    assert calls == [2, 2, 2, 2]  # two training chunks of two clients per round
    _close(one.server_state["model"], two.server_state["model"], atol=1e-6)
    for c in range(4):
        _close(one.store.get(c)["model"], two.store.get(c)["model"], atol=1e-6)
    assert r1["per_client_accuracy"] == r2["per_client_accuracy"]
    with pytest.raises(ValueError, match="--vector_chunk_mb"):
        RunArguments(vector_chunk_mb=0)


def test_every_chunks_stacked_data_is_built_once_and_dropped_when_unread(ragged, tmp_path, monkeypatch):
    """Two chunks a round: each chunk's train and test stacks are built in round 1 and read again in later rounds
    (one stack per split was kept before, so both chunks rebuilt theirs every round); a cap too small for a second
    stack keeps each split's first and rebuilds only what did not fit; a split's stack that its last round did not
    read is dropped when the split builds a new one, another split's stays; the numbers never change."""
    per_client = 4 * 766 * 4 + 40   # TinyNet's stacked state: two clients per chunk
    small = dict(vector_chunk_mb=2.5 * per_client / 2**20, num_rounds=3)
    built = []
    real = vectorized.StackedData.build.__func__
    monkeypatch.setattr(vectorized.StackedData, "build",
                        classmethod(lambda cls, datas: built.append(len(datas)) or real(cls, datas)))
    kept, r1 = _run(ragged, tmp_path, "tiny_fedbn", "on", **small)
    assert len(built) == 4  # 2 chunks x (train, test), round 1 only
    assert sorted(kept._stacked_data) == [("test", (0, 1)), ("test", (2, 3)), ("train", (0, 1)), ("train", (2, 3))]
    one_stack = kept._stacked_data[("train", (0, 1))]["bytes"]
    # by hand: 2 clients x the longer of their splits x (3x16x16 uint8 pixels + an int64 label)
    longer = max(len(kept.train_data(0)), len(kept.train_data(1)))
    assert one_stack == 2 * longer * (3 * 16 * 16 + 8)
    # a client whose split object changed (the data cache let it go and converted it again) never reads the old
    # stack: the same clients with other data are stacked anew, from the new data
    other = [kept.train_data(1).rows(0, 5), kept.train_data(0)]
    built.clear()
    st = vectorized.stacked_data(kept, [0, 1], "train", other)
    assert built == [2] and st.lengths == [5, len(kept.train_data(0))]
    assert torch.equal(st.columns["labels"][0, :5].cpu(), other[0].select(torch.arange(5))["labels"])  # (on the GPU there)
    built.clear()
    monkeypatch.setattr(stacked_splits, "STACK_CACHE_BYTES", 1)  # room for no second stack of a split
    capped, r2 = _run(ragged, tmp_path / "cap", "tiny_fedbn", "on", **small)
    assert list(capped._stacked_data) == [("train", (0, 1)), ("test", (0, 1))]  # a split's first stack always
    assert len(built) == 4 + 2 * 2  # round 1 builds 4; rounds 2 and 3 rebuild the 2 that did not fit
    assert kept.history == capped.history and r1["per_client_accuracy"] == r2["per_client_accuracy"]
    capped.round += 2  # two rounds later, other clients train: their stack replaces the unread train stack, and
    vectorized.stacked_data(capped, [0], "train", [capped.train_data(0)])  # the test stack (another split) stays
    assert list(capped._stacked_data) == [("test", (0, 1)), ("train", (0,))]


def test_large_rounds_give_freed_heap_back_after_every_chunk_and_change_no_numbers(ragged, tmp_path, monkeypatch):
    per_client = 4 * 766 * 4 + 40   # TinyNet's stacked state, as above: two clients per chunk
    small = dict(vector_chunk_mb=2.5 * per_client / 2**20)
    plain, r1 = _run(ragged, tmp_path, "tiny_fedbn", "on", **small)
    trims = []
    real = vectorized.release_freed_heap
    monkeypatch.setattr(vectorized, "PIN_MMAP_CLIENTS", 4)            # these 4 clients count as a large round
    monkeypatch.setattr(chunks, "PIN_MMAP_CLIENTS", 4)
    monkeypatch.setattr(chunks, "pin_mmap_threshold", lambda: None)  # (leave the test process's malloc alone)
    monkeypatch.setattr(vectorized, "release_freed_heap", lambda: trims.append(1) or real())
    trimmed, r2 = _run(ragged, tmp_path / "t", "tiny_fedbn", "on", **small)
    assert len(trims) == 4                                             # 2 chunks x 2 rounds
    assert plain.history == trimmed.history and r1["per_client_accuracy"] == r2["per_client_accuracy"]
    for c in range(4):
        a, b = plain.store.get(c)["model"], trimmed.store.get(c)["model"]
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_stacks_are_stored_in_a_given_memory_order_with_the_same_values():
    g = torch.randn(3, 5, 4).mT  # a transposed gradient, as a batched Linear's: [3, 4, 5], strides (20, 1, 4)
    assert memory_order(g) == (0, 2, 1) and memory_order(torch.randn(3, 4)) == (0, 1)
    assert memory_order(torch.randn(4, 1).expand(4, 3)) is None  # overlapping: no order reproduces it
    w, other = torch.randn(4, 5), torch.randn(4, 5)
    cpu = torch.device("cpu")
    shared = stack_values([w, w, w], cpu, copy_shared=True, order=(0, 2, 1))   # one value, copied into the order
    mixed = stack_values([w, other, w], cpu, order=(0, 2, 1))
    assert shared.stride() == mixed.stride() == g.stride() == (20, 1, 4)
    assert torch.equal(shared, torch.stack([w, w, w])) and torch.equal(mixed, torch.stack([w, other, w]))
    assert stack_values([w, other], cpu).is_contiguous()  # no order: the usual layout
    shared.add_(g, alpha=-0.5)  # updates keep the layout
    assert torch.equal(shared, torch.stack([w, w, w]) - 0.5 * g) and shared.stride() == (20, 1, 4)


def test_layout_adopted_when_the_first_step_groups_only_some_clients(ragged, tmp_path, monkeypatch):
    """Client 0 keeps 9 images (one batch of 9), the others batches of 10: step 0 steps two groups, the smaller batch
    first, which is not every client. The MLP's chunk still trains batched (no fallback to one by one) and matches
    the sequential path."""
    data_args, fed = ragged
    clients = [dataclasses.replace(fed.clients[0], train=fed.clients[0].train.select(range(9))), *fed.clients[1:]]
    fed9 = (data_args, dataclasses.replace(fed, clients=clients))
    warned = []
    monkeypatch.setattr(policy.logger, "warning", lambda *a, **k: warned.append(a))  # the engine's logger too
    seq, _ = _run(fed9, tmp_path, "tiny_mlp_fedbn", "off", num_rounds=1)
    vec, _ = _run(fed9, tmp_path, "tiny_mlp_fedbn", "on", num_rounds=1)
    assert not getattr(vec, "_vector_failed", False) and warned == []
    _close(seq.server_state["model"], vec.server_state["model"])


@pytest.mark.parametrize("batch_size,groups", [(10, 1), (40, 3)])
def test_plain_sgd_first_step_from_the_shared_start_matches_sequential(ragged, tmp_path, monkeypatch, batch_size,
                                                                       groups):
    """Plain SGD (no momentum, no weight decay) on a convolutional model, every client starting from the download:
    the vectorized first step reads the unstacked start values and writes start - lr * gradient into the stack
    (no optimizer call). Pinned against the sequential path for both step-0 shapes (train sizes 49, 42, 35, 28):
    all clients in one group (batch 10) and three groups of different batch sizes (batch 40: batches of 28, 35
    and 40, the step-0 rows written group by group)."""
    first_steps = []
    real_step = StackedOptimizer.step
    monkeypatch.setattr(StackedOptimizer, "step", lambda self, P, g, idx, step: (
        first_steps.append(step) if step == 1 else None) or real_step(self, P, g, idx, step))
    seq, rs = _run(ragged, tmp_path, "tiny_fedavg", "off", momentum=0.0, batch_size=batch_size, last_batch="keep")
    vec, rv = _run(ragged, tmp_path, "tiny_fedavg", "on", momentum=0.0, batch_size=batch_size, last_batch="keep")
    # round 1's chunk probes the gradients' layouts and steps through the optimizer; round 2 writes its first step
    # straight into the stack
    assert len(first_steps) == groups
    _close(seq.server_state["model"], vec.server_state["model"])
    for hs, hv in zip(seq.history, vec.history):
        assert hs["train_loss"] == pytest.approx(hv["train_loss"], abs=1e-5)
    torch.manual_seed(0)
    assert not torch.allclose(vec.server_state["model"]["head.weight"], TinyNet().head.weight, atol=1e-3)


def test_receive_sees_every_upload_on_the_streaming_path(ragged, tmp_path):
    """A method with a ``receive`` that streams (``aggregation = "stream"``, no ``aggregate``): the engine folds the uploads into the running
    sums, and ``receive`` gets each client's upload once per round, with its model part (a vectorized chunk's
    uploads are then not folded as one stacked block, which would leave the per-client uploads empty)."""
    seen = []

    def build_model(self):
        torch.manual_seed(0)
        return TinyNet(self.ctx.num_labels)

    def receive(self, upd, round_idx):
        seen.append((round_idx, upd.client_id, sorted(upd.upload.get("model", {}))))

    register(type("tiny_receiving_fedavg", (FedAvg,), {"name": "tiny_receiving_fedavg", "build_model": build_model,
                                                        "receive": receive, "aggregation": "stream"}))
    plain, _ = _run(ragged, tmp_path, "tiny_fedavg", "on")
    got, _ = _run(ragged, tmp_path, "tiny_receiving_fedavg", "on")
    assert sorted((r, c) for r, c, _ in seen) == [(r, c) for r in (1, 2) for c in range(4)]
    assert all(keys == sorted(got.keys_by_role["global"]) for _, _, keys in seen)
    _close(plain.server_state["model"], got.server_state["model"], atol=1e-6)


@pytest.mark.parametrize("opt", [dict(optimizer="adam", weight_decay=0.01, lr=0.01),
                                 dict(optimizer="adamw", weight_decay=0.1, lr=0.01),
                                 dict(optimizer="sgd", momentum=0.9, weight_decay=0.01, local_steps=7)])
def test_vectorized_optimizers_match(ragged, tmp_path, opt):
    seq, _ = _run(ragged, tmp_path, "tiny_fedavg", "off", num_rounds=1, **opt)
    vec, _ = _run(ragged, tmp_path, "tiny_fedavg", "on", num_rounds=1, **opt)
    _close(seq.server_state["model"], vec.server_state["model"])
    torch.manual_seed(0)
    assert not torch.allclose(seq.server_state["model"]["head.weight"], TinyNet().head.weight, atol=1e-3)  # it trained


def test_a_subclass_hook_runs_on_both_paths_and_a_hook_without_vectorized_form_falls_back(ragged, tmp_path):
    """Local hooks are one method of pure functions, so a subclass that changes FedProx's hook changes it on both
    paths: with its regularizer 50 times FedProx's, --vectorize on gives the sequential path's state and differs from
    FedProx's. A hook ctx.train takes but the vectorized path cannot batch (an ``after_step``) makes the engine
    train the clients one by one: the same bits as --vectorize off."""
    from hfpfl.algorithms.fedprox import proximal_term

    def tiny(self):
        torch.manual_seed(0)
        return TinyNet(self.ctx.num_labels)

    @register
    class DoubleProx(FedProx):
        name = "tiny_double_prox"
        build_model = tiny

        def local_hooks(self, client_id, down, private):
            mu = self.config.mu
            return {"regularizer": lambda params, anchor: 50 * proximal_term(params, anchor, mu)}

    steps = []

    @register
    class StepCounting(FedAvg):
        name = "tiny_step_counting"
        build_model = tiny

        def local_hooks(self, client_id, down, private):
            return {"after_step": lambda step: steps.append(step)}

    prox, _ = _run(ragged, tmp_path, "tiny_fedprox", "off")
    seq, _ = _run(ragged, tmp_path, "tiny_double_prox", "off")
    vec, _ = _run(ragged, tmp_path, "tiny_double_prox", "on")
    assert not getattr(vec, "_vector_failed", False)
    _close(seq.server_state["model"], vec.server_state["model"], atol=1e-4)   # float order differs under vmap
    assert max(float((v - prox.server_state["model"][k]).abs().max()) for k, v in seq.server_state["model"].items()) > 1e-3
    seq, _ = _run(ragged, tmp_path, "tiny_step_counting", "off")
    n_seq, steps[:] = len(steps), []
    vec, _ = _run(ragged, tmp_path, "tiny_step_counting", "on")
    assert vec._vector_failed and len(steps) == n_seq > 0
    for k, v in seq.server_state["model"].items():  # the sequential path itself: the same bits
        assert torch.equal(v, vec.server_state["model"][k])


def test_option_dependent_override_vectorizes_only_when_inactive(ragged, tmp_path):
    # FedBN overrides client_update for --keep_optimizer_state only: the default still vectorizes, the option does not
    data_args, fed = ragged
    fedbn = get_algorithm("tiny_fedbn")
    for keep, vectorizes in ((False, True), (True, False)):
        run = RunArguments(method="tiny_fedbn", num_rounds=1, progress=False, checkpoint_every=0, vectorize="on",
                           output_dir=str(tmp_path / f"keep{keep}"), overwrite_output_dir=True)
        sim = Simulation(run, data_args, fedbn.Config(keep_optimizer_state=keep), fed_data=fed)
        assert (vectorized.vectorize_reason(sim) is None) is vectorizes


def test_auto_rule_and_dropout_rule(ragged, tmp_path):
    sim, _ = _run(ragged, tmp_path, "tiny_fedavg", "auto", num_rounds=1)
    assert vectorized.should_vectorize(sim)  # 1 k parameters: overhead-bound, vectorized
    sim.model.add_module("drop", nn.Dropout(0.1))
    assert "dropout" in vectorized.vectorize_reason(sim) and not vectorized.should_vectorize(sim)


def test_batch_schedule_is_the_training_loops():
    data = TensorData(torch.arange(23).float()[:, None], torch.zeros(23, dtype=torch.long))
    for epochs, steps in ((2, None), (1, 5), (1, 1)):
        g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
        sched = vectorized.batch_schedule(23, 5, epochs, steps, g1)
        ref = []
        while True:
            for b in iterate_batches(data, 5, shuffle=True, generator=g2):
                ref.append(b["pixel_values"][:, 0].long())
                if steps and len(ref) >= steps:
                    break
            epochs -= 1
            if (steps and len(ref) >= steps) or (not steps and epochs <= 0):
                break
        assert [s.tolist() for s in sched] == [r.tolist() for r in ref]
    assert [len(s) for s in vectorized.batch_schedule(11, 5, 1, None, torch.Generator())] == [5, 6]  # no singleton


def test_chunk_schedules_are_each_clients_own_batch_schedule():
    """The chunk's index matrix gives every client, at every step, the batch ``batch_schedule`` draws from its own
    seeded generator (ragged sizes, several epochs, a step cap), grouped by batch size."""
    for sizes, epochs, steps in (([23, 11, 23, 7, 16], 2, None), ([23, 11, 23, 7, 16], 1, 5), ([26] * 4, 1, None)):
        seeds = [101 + 7 * i for i in range(len(sizes))]
        sch = BatchSchedules(sizes, seeds, 5, epochs, steps)
        ref = [vectorized.batch_schedule(n, 5, epochs, steps, torch.Generator().manual_seed(sd))
               for n, sd in zip(sizes, seeds)]
        assert sch.n_steps == [len(r) for r in ref]
        got = [[] for _ in sizes]
        for s in range(max(sch.n_steps)):
            groups = sch.groups(s)
            assert [len(idx[0]) for _, idx in groups] == sorted({len(r[s]) for r in ref if s < len(r)})
            for members, idx in groups:
                for j, i in enumerate(members):
                    got[i].append(idx[j].tolist())
        assert got == [[b.tolist() for b in r] for r in ref]


def test_seeds_for_is_seed_for_for_many_clients():
    """numpy's SeedSequence hash written out on arrays gives seed_for's seeds (incl. client -1 and large ids), and
    so do prefetched seeds: numpy's SeedSequence([run seed, round, client + 1, crc32(tag)]) itself, for the run
    seed they were fetched with only."""
    import zlib

    import numpy as np

    class Stub:
        seed_for, seeds_for, prefetch_seeds = Simulation.seed_for, Simulation.seeds_for, Simulation.prefetch_seeds
        _seed_memo: dict = {}

    def numpy_seed(seed, r, c, tag):
        return int(np.random.SeedSequence([seed, r, c + 1, zlib.crc32(tag.encode())]).generate_state(1)[0])

    sim = Stub()
    ids = [-1, 0, 1, 2, 3, 17, 999, 123456789, 2**32 - 2]
    for seed in (0, 7, 2**32 - 1):
        sim.args = types.SimpleNamespace(seed=seed)
        for r, tag in ((0, ""), (1, "client"), (12345, "eval")):
            assert sim.seeds_for(r, ids, tag) == [sim.seed_for(r, c, tag) for c in ids]
    sim.args = types.SimpleNamespace(seed=2**40)  # more entropy words: numpy's own path
    assert sim.seeds_for(3, [0, 5], "x") == [sim.seed_for(3, c, "x") for c in (0, 5)]
    sim.args = types.SimpleNamespace(seed=7)
    sim.prefetch_seeds(4, [2, 9], ("client", ""))
    assert len(sim._seed_memo) == 4
    assert [sim.seed_for(4, c, t) for t in ("client", "") for c in (2, 9)] == \
        [numpy_seed(7, 4, c, t) for t in ("client", "") for c in (2, 9)]
    sim.args = types.SimpleNamespace(seed=8)  # another run seed: not the prefetched numbers
    assert sim.seed_for(4, 2, "client") == numpy_seed(8, 4, 2, "client") != numpy_seed(7, 4, 2, "client")


def test_uint8_storage_is_exact_and_quarter_size(small_digits):
    _, fed = small_digits
    ds = fed.clients[0].train
    small, full = TensorData.from_dataset(ds), TensorData.from_dataset(ds, compress=False)
    assert small._stored["pixel_values"].dtype == torch.uint8
    assert torch.equal(small.pixel_values, full.pixel_values)
    idx = torch.tensor([3, 1, 2])
    assert torch.equal(small.select(idx)["pixel_values"], full.select(idx)["pixel_values"])
    assert small.nbytes() < 0.3 * full.nbytes()
    assert encode_uint8(torch.tensor([0.1234])) is None  # not 8-bit pixels: kept as floats


def test_data_cache_is_capped_lru(ragged, tmp_path):
    sim, _ = _run(ragged, tmp_path, "tiny_fedavg", "off", num_rounds=1, data_cache_mb=0.05)  # ~50 kB: 2-3 splits
    assert sim.splits.bytes <= 0.05 * 2**20 or len(sim.splits.entries) == 1
    assert len(sim.splits.entries) < 8  # 4 clients x (train, test) + global test would be 9
    again = sim.train_data(0)
    assert torch.equal(again.pixel_values, TensorData.from_dataset(sim.client(0).train).pixel_values)


def test_eval_clients_subset_then_everyone_at_the_end(ragged, tmp_path):
    sim, res = _run(ragged, tmp_path, "tiny_fedavg", "off", num_rounds=3, eval_clients=2)
    assert [len(h["per_client"]) for h in sim.history] == [2, 2, 4]
    assert len(res["per_client_accuracy"]) == 4
    assert sim.eval_client_ids(1) == sim.eval_client_ids(1) and len(sim.eval_client_ids(1)) == 2
    half, _ = _run(ragged, tmp_path, "tiny_fedavg", "off", num_rounds=1, eval_clients=0.5)
    assert len(half.eval_client_ids(1)) == 2 and len(half.eval_client_ids(1, final=True)) == 4
    with pytest.raises(ValueError, match="--eval_clients"):
        RunArguments(eval_clients=2.5)
    with pytest.raises(ValueError, match="--vectorize"):
        RunArguments(vectorize="yes")


def test_client_store_spills_least_recently_used_to_disk(tmp_path):
    from hfpfl.federated.state import ClientStateStore
    # a client's state in memory: 1,000 B of values rounded to 1,024 and 8 B to 64, plus 480 B per tensor: 2,048 B
    store = ClientStateStore(max_bytes=5000, spill_dir=tmp_path / "spill")
    states = {c: {"model": {"w": torch.full((250,), float(c)), "n": torch.tensor([c])}, "empty": {}} for c in range(5)}
    for c, s in states.items():
        store.put(c, s)
    assert store.in_memory_bytes == 2 * (1024 + 480 + 64 + 480) and len(store) == 5  # two fit under 5,000 B
    spilled = sorted(int(p.stem) for p in (tmp_path / "spill").glob("*.safetensors"))
    assert spilled == [0, 1, 2]  # least recently used first
    got = store.get(0)  # read back from disk, exactly, with its empty part
    assert torch.equal(got["model"]["w"], states[0]["model"]["w"]) and got["empty"] == {}
    assert not (tmp_path / "spill" / "0.safetensors").exists() and (tmp_path / "spill" / "3.safetensors").exists()
    flat = store.flatten()  # checkpoints see every client, in memory or not
    assert {k.split("::")[0] for k in flat} == {str(c) for c in range(5)}
    assert store.nbytes() == 5 * (250 * 4 + 8)
    store.clear()
    assert len(store) == 0 and not list((tmp_path / "spill").glob("*.safetensors"))


def test_spilling_changes_no_numbers(ragged, tmp_path):
    _register_tiny(TinyNet, "tiny_local_spill", FedBN)  # tiny_local_spill_fedbn

    ref, rr = _run(ragged, tmp_path, "tiny_local_spill_fedbn", "off", num_rounds=2)
    small, rs = _run(ragged, tmp_path / "s", "tiny_local_spill_fedbn", "off", num_rounds=2, max_state_mb=0.0001)
    assert len(small.store._states) == 1 and len(small.store) == 4  # only the last client stays in memory
    assert any((tmp_path / "s").rglob("*.safetensors"))
    for c in range(4):
        for k, v in ref.store.get(c)["model"].items():
            assert torch.equal(v, small.store.get(c)["model"][k])
    assert rr["final"] == rs["final"]


def test_an_instance_wrapper_declared_own_sees_every_client(ragged, tmp_path):
    sim, _ = _run(ragged, tmp_path, "tiny_fedavg", "on", num_rounds=1)
    seen = []
    original = sim.algorithm.client_update
    sim.algorithm.client_update = lambda c, d, p, r: seen.append(c) or original(c, d, p, r)  # FedPop's scorer does this
    sim.algorithm.local_update = "own"  # and declares it, as the engine reads declarations, not overrides
    assert "own" in vectorized.vectorize_reason(sim)
    sim.args = dataclasses.replace(sim.args, num_rounds=2)
    sim.step()
    assert seen == [0, 1, 2, 3]  # the wrapper saw every client: the sequential path ran


def test_stacked_data_gathers_what_select_gives(small_digits):
    _, fed = small_digits
    datas = [TensorData.from_dataset(c.train) for c in fed.clients[:3]]
    datas[1] = TensorData.of(**{k: v[:7] for k, v in datas[1].select(torch.arange(7)).items()}).compress()
    st = vectorized.StackedData.build(datas)
    assert st is not None and st.columns["pixel_values"].dtype == torch.uint8  # images stay 8-bit, decoded per batch
    assert st.columns["pixel_values"].shape[:2] == (3, max(len(d) for d in datas))
    idx = torch.tensor([[4, 0, 6], [6, 5, 1]])
    got = st.gather(torch.tensor([0, 1]), idx)  # clients 0 and 1, their own rows
    for i in range(2):
        want = datas[i].select(idx[i])
        for k in want:
            assert torch.equal(got[k][i], want[k]), k  # bit for bit, uint8 -> float exactly as select converts
    every = st.gather(None, torch.tensor([[2, 3]] * 3))
    assert torch.equal(every["labels"][2], datas[2].select(torch.tensor([2, 3]))["labels"])
    # splits that do not stack (another row shape) are gathered client by client instead
    odd = TensorData(torch.zeros(5, 3, 4, 4), torch.zeros(5, dtype=torch.long))
    assert vectorized.StackedData.build([datas[0], odd]) is None


def test_bench_simulator_refuses_a_bad_parallel_spec():
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "scripts/bench_simulator.py", "--parallel", "1", "x2"], cwd=root,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--parallel: 'x2'" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run([sys.executable, "scripts/bench_vectorized_step.py", "--clients", "20", "0"], cwd=root,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--clients must be >= 1, got 0" in out.stderr and "Traceback" not in out.stderr


def test_mmap_threshold_is_pinned_only_for_large_rounds(ragged, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(chunks, "pin_mmap_threshold", lambda: calls.append(1))
    sim, _ = _run(ragged, tmp_path, "tiny_fedavg", "on", num_rounds=1)
    assert calls == []  # 4 clients: speed first, glibc's defaults kept
    monkeypatch.setattr(chunks, "PIN_MMAP_CLIENTS", 4)
    assert vectorized.chunks_of(sim, [0, 1, 2, 3]) == [[0, 1, 2, 3]] and calls == [1]


@pytest.mark.parametrize("row_loop", [1 << 30, 1])  # block float64 matrix-vector sums, and the per-client loop
def test_add_stacked_equals_one_add_per_client(monkeypatch, row_loop):
    from hfpfl.federated.aggregation import WeightedSums
    monkeypatch.setattr(WeightedSums, "STACKED_ROW_LOOP", row_loop)
    for name in ("STACKED_BLOCK_BYTES", "STACKED_BLOCK_BYTES_CPU"):  # blocks of 2 clients (rows of 3 values)
        monkeypatch.setattr(WeightedSums, name, 2 * 3 * 8)
    g = torch.Generator().manual_seed(0)
    # "t": stored transposed, as a vectorized chunk's Linear weights are (their gradients' layout)
    stacked = {"w": torch.randn(5, 3, generator=g), "n": torch.tensor([[3], [9], [1], [4], [2]]),
               "t": torch.randn(5, 4, 3, generator=g).mT}
    assert not stacked["t"].is_contiguous()
    coefs = [0.1, 0.3, 0.2, 0.25, 0.15]
    one, many = WeightedSums(), WeightedSums()
    one.add_stacked("model", stacked, coefs)
    for i, c in enumerate(coefs):
        many.add("model", {k: v[i] for k, v in stacked.items()}, c)
    for k in ("w", "t"):
        hand = sum(c * stacked[k][i].double() for i, c in enumerate(coefs))  # the weighted sum, by hand
        assert one.sums["model"][k].shape == hand.shape
        assert torch.allclose(one.sums["model"][k], hand, atol=1e-15, rtol=0)
        assert torch.allclose(one.sums["model"][k], many.sums["model"][k], atol=1e-15, rtol=0)
    assert one.sums["model"]["n"].tolist() == [9]  # integer tensors: the running max, as add keeps it
    assert one.total["model"] == pytest.approx(1.0)


def test_weighted_means_do_not_depend_on_how_clients_are_split_over_processes():
    """Raw whole-number weights in, one division by the total out: the float64 sums are exact here, so one
    process, two or three (each summing its own clients, then adding the partial sums as the all-reduce does) and
    the stacked fold give the same float32 mean, bit for bit. Normalized coefficients (w / total, the scheme
    before) fail this on the same data: some values come out one float32 step apart."""
    from hfpfl.federated.aggregation import WeightedSums
    g = torch.Generator().manual_seed(2)
    base = torch.randn(40000, generator=g) * 0.05            # uploads as FedAvg sees them: one model, client drift
    ups = [base + torch.randn(40000, generator=g) * 0.01 for _ in range(500)]
    n = torch.randint(5, 7, (500,), generator=g).tolist()     # sample counts
    total = float(sum(n))

    def mean(groups, normalized, stacked=False):
        parts = []
        for members in groups:
            ws = WeightedSums(denominator=1.0 if normalized else total)
            coefs = [n[i] / total if normalized else float(n[i]) for i in members]
            if stacked:
                ws.add_stacked("model", {"w": torch.stack([ups[i] for i in members])}, coefs)
            else:
                for i, c in zip(members, coefs):
                    ws.add("model", {"w": ups[i]}, c)
            parts.append(ws)
        for other in parts[1:]:                               # the all-reduce: partial sums added
            parts[0].sums["model"]["w"] += other.sums["model"]["w"]
        return parts[0].get("model", {"w": ups[0]})["w"]

    one = [list(range(500))]
    two = [list(range(0, 500, 2)), list(range(1, 500, 2))]
    three = [[i for i in range(500) if i % 3 == r] for r in (2, 0, 1)]
    ref = mean(one, normalized=False)
    assert ref.dtype == torch.float32
    for groups in (two, three):
        assert torch.equal(mean(groups, normalized=False), ref)
        assert torch.equal(mean(groups, normalized=False, stacked=True), ref)
    by_hand = (sum(float(n[i]) * ups[i].double() for i in range(500)) / total).float()
    assert torch.allclose(ref, by_hand, atol=1e-7, rtol=0)   # and it is the weighted mean
    old = mean(one, normalized=True)
    assert any(not torch.equal(mean(gr, normalized=True), old) for gr in (two, three))


def test_finite_checks_are_exact_when_the_sum_overflows():
    from hfpfl.federated.aggregation import all_finite, finite_rows
    big = torch.full((2, 4), 3e38)  # every value finite; the float32 sum overflows to inf
    assert all_finite(big) and finite_rows(big).tolist() == [True, True]
    big[1, 2] = float("nan")
    assert not all_finite(big) and finite_rows(big).tolist() == [True, False]
    assert not all_finite(torch.tensor([1.0, float("-inf")]))
    # a stack in its gradients' layout (transposed rows, summed in place) and a stack of scalars (one value a row)
    stack = torch.randn(3, 5, 4).mT.clone(memory_format=torch.preserve_format)
    stack[2, 3, 1] = float("inf")
    assert not stack.is_contiguous() and finite_rows(stack).tolist() == [True, True, False]
    assert finite_rows(torch.tensor([1.0, float("nan"), 2.0])).tolist() == [True, False, True]


def test_an_upload_is_checked_tensor_by_tensor_with_one_wait():
    """all_finite_each: finite float32, float32 with a NaN, float16 with -inf, finite float32 whose sum overflows
    (2 x 3e38), a float16 whose float16 sum would overflow (2 x 6e4, summed in float32) and a float64 with +inf."""
    from hfpfl.federated.aggregation import all_finite_each
    tensors = [torch.tensor([1.0, -2.0]), torch.tensor([1.0, float("nan")]),
               torch.tensor([1.0, float("-inf")], dtype=torch.float16), torch.full((2,), 3e38),
               torch.full((2,), 6e4, dtype=torch.float16), torch.tensor([float("inf")], dtype=torch.float64)]
    assert all_finite_each(tensors) == [True, False, False, True, True, False]
    assert all_finite_each(tensors[:1] + tensors[3:5]) == [True, True, True] and all_finite_each([]) == []


def test_a_non_finite_upload_found_as_the_sums_fold_it_names_its_client(ragged, tmp_path):
    """FedAvg's uploads are checked by the server sums as they fold them (held four at a time here), not read a
    second time: a NaN put into client 2's upload after its own checks (by a callback) stops the round naming
    client 2 and the key, as the per-upload check did; without a source the sums would only be caught as a
    non-finite server state."""
    from hfpfl.federated.aggregation import WeightedSums
    from hfpfl.federated.callbacks import Callback
    from hfpfl.federated.engine import Simulation

    class Poison(Callback):
        needs_each_client = True

        def after_client_update(self, sim, client_id, update):
            if client_id == 2:
                update.upload["model"]["head.bias"][0] = float("nan")

    assert WeightedSums.HOLD_UPLOADS >= 4
    data_args, fed = ragged
    run = RunArguments(method="tiny_fedavg", num_rounds=1, batch_size=10, lr=0.05, progress=False, checkpoint_every=0,
                       output_dir=str(tmp_path / "poison"), vectorize="off")
    sim = Simulation(run, data_args, get_algorithm("tiny_fedavg").Config(), fed_data=fed, callbacks=[Poison()])
    assert "head.bias" in sim.keys_by_role["global"]
    with pytest.raises(NonFiniteError, match=r"round 1 on client 2: non-finite upload 'model/head.bias'; lower --lr"):
        sim.run()


def test_sums_name_the_first_non_finite_upload_with_a_source(monkeypatch):
    """Uploads from sources 10, 11 (NaN in "b"), 12 (inf in "a"), held together: the fold names 11 and "b" (the
    first bad upload, its first bad key); a sourceless NaN is not named, and a later bad upload with a source still
    is; uploads on another part, blocks of 2 values."""
    from hfpfl.federated.aggregation import NonFiniteUpload, WeightedSums
    monkeypatch.setattr(WeightedSums, "FOLD_BLOCK", 2)
    ok = {"a": torch.ones(5), "b": torch.ones(3)}
    sums = WeightedSums()
    sums.add("m", ok, 1.0, source=10)
    sums.add("m", {"a": torch.ones(5), "b": torch.tensor([1.0, float("nan"), 1.0])}, 1.0, source=11)
    with pytest.raises(NonFiniteUpload) as err:
        sums.add("m", {"a": torch.tensor([1.0, 1.0, 1.0, 1.0, float("inf")]), "b": torch.ones(3)}, 1.0, source=12)
        sums.get("m", ok)
    assert (err.value.source, err.value.part, err.value.key) == (11, "m", "b")
    quiet = WeightedSums()
    quiet.add("m", {"a": torch.full((5,), float("nan")), "b": torch.ones(3)}, 1.0)
    quiet.add("m", ok, 1.0, source=20)
    assert quiet.get("m", ok)["a"].isnan().all()  # nobody to name: the caller checks what it passes unsourced
    quiet.add("m", {"a": torch.ones(5), "b": torch.tensor([float("-inf"), 1.0, 1.0])}, 1.0, source=21)
    with pytest.raises(NonFiniteUpload, match="21"):
        quiet.get("m", ok)


def test_vectorized_round_records_and_divergence_as_the_sequential_path(ragged, tmp_path):
    seq, rs = _run(ragged, tmp_path, "tiny_fedbn", "off", num_rounds=1)
    vec, rv = _run(ragged, tmp_path, "tiny_fedbn", "on", num_rounds=1)
    assert rs["communication"] == rv["communication"]  # bytes per client and part, counted once per chunk
    assert seq.history[0]["clients"] == vec.history[0]["clients"]
    for mode in ("off", "on"):  # a diverged client is named the same way on both paths (the chunk's uploads
        with pytest.raises(NonFiniteError, match="round 1 on client 0.*--lr"):  # are folded without copies)
            _run(ragged, tmp_path / mode, "tiny_fedavg", mode, num_rounds=1, lr=1e30)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_bench_simulator_refuses_cuda_without_a_gpu():
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "scripts/bench_simulator.py", "--device", "cuda"], cwd=root,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--device cuda" in out.stderr and "Traceback" not in out.stderr


def test_auto_vectorizes_mid_size_models_only_where_the_chunk_shape_pays(ragged, tmp_path, monkeypatch):
    assert vectorized.clients_per_step([56, 49, 42, 35], 10) == pytest.approx(20 / 6)  # steps 6, 5, 5, 4
    assert vectorized.clients_per_step([5] * 500, 5) == 500 and vectorized.clients_per_step([9, 1], 4, 3) == 2
    sim, _ = _run(ragged, tmp_path, "tiny_fedavg", "auto", num_rounds=1)
    monkeypatch.setattr(policy, "AUTO_MAX_PARAMS", 0)  # treat the tiny net as a mid-size model
    monkeypatch.setattr(sim, "device", torch.device("cpu"))  # the CPU rule first, also where the run got a GPU
    clients = [0, 1, 2, 3]
    assert not vectorized.should_vectorize(sim)  # no clients given: mid-size models are not vectorized
    monkeypatch.setattr(policy, "AUTO_MID_MIN_GROUP", 3)
    # on the CPU, only clients of few steps vectorize: at batch 10 (trailing batches under 8 merge) 56 images take
    # 5 steps (10 x 4 + 16), 49 take 5 (10 x 4 + 9), 42 take 4, 35 and 28 take 3 (10 x 2 + 8)
    assert vectorized.local_steps([56, 49, 42, 35], sim.args) == 5 and vectorized.local_steps([28], sim.args) == 3
    # the run's --last_batch: 21 images at batch 10 are 10 + 11 (merge), 10 + 10 + 1 (keep) or 10 + 10 (drop)
    assert [vectorized.local_steps([21], dataclasses.replace(sim.args, last_batch=rule))
            for rule in ("merge", "keep", "drop")] == [2, 3, 2]
    assert [len(sim.train_data(c)) for c in clients] == [28, 49, 42, 35]  # this run's clients: 5 steps at most
    assert not vectorized.should_vectorize(sim, clients)  # default: at most 1 step per client
    monkeypatch.setattr(policy, "AUTO_MID_CPU_MAX_STEPS", 4)
    assert not vectorized.should_vectorize(sim, clients)  # 5 steps > 4
    monkeypatch.setattr(policy, "AUTO_MID_CPU_MAX_STEPS", 5)
    assert vectorized.should_vectorize(sim, clients)  # batch 10, 3.3 clients per step, 5 steps
    monkeypatch.setattr(policy, "AUTO_MID_MIN_GROUP", 4)
    assert not vectorized.should_vectorize(sim, clients)  # ragged: too few clients step together
    monkeypatch.setattr(policy, "AUTO_MID_MIN_GROUP", 3)
    sim.args = dataclasses.replace(sim.args, local_steps=6)
    assert not vectorized.should_vectorize(sim, clients)  # --local_steps 6: 6 steps > 5
    sim.args = dataclasses.replace(sim.args, local_steps=None, local_epochs=2)
    assert vectorized.local_steps([56, 49, 42, 35], sim.args) == 10 and not vectorized.should_vectorize(sim, clients)
    sim.args = dataclasses.replace(sim.args, local_epochs=1, batch_size=29)
    monkeypatch.setattr(policy, "AUTO_MID_MAX_BATCH", 64)
    monkeypatch.setattr(policy, "AUTO_MID_MIN_GROUP", 1)
    assert vectorized.local_steps([28, 49, 42, 35], sim.args) == 2 and vectorized.local_steps([28], sim.args) == 1
    assert not vectorized.should_vectorize(sim, clients)  # the 28-image client's one batch is partial (28 < 29)
    sim.args = dataclasses.replace(sim.args, batch_size=28)
    assert vectorized.should_vectorize(sim, clients)  # every client at least one full batch, at most 2 steps
    monkeypatch.setattr(policy, "AUTO_MID_MAX_BATCH", 16)
    monkeypatch.setattr(policy, "AUTO_MID_MIN_GROUP", 3)
    sim.args = dataclasses.replace(sim.args, batch_size=32)
    assert not vectorized.should_vectorize(sim, clients)  # large batches are compute-bound: sequential
    # on an accelerator the same shapes vectorize (launch-bound steps): large batches and a ragged round too
    monkeypatch.setattr(sim, "device", torch.device("meta"))
    assert vectorized.should_vectorize(sim, clients) and vectorized.should_vectorize(sim, clients, "test")
    monkeypatch.setattr(policy, "AUTO_MID_MIN_GROUP", 4)
    assert vectorized.should_vectorize(sim, clients)
    assert not vectorized.should_vectorize(sim, [0]) and not vectorized.should_vectorize(sim)  # one client: no
    monkeypatch.setattr(sim, "device", torch.device("cpu"))
    monkeypatch.setattr(policy, "AUTO_MID_MAX_PARAMS", 10)
    sim.args = dataclasses.replace(sim.args, batch_size=10)
    assert not vectorized.should_vectorize(sim, clients)  # too large a model
    monkeypatch.setattr(sim, "device", torch.device("meta"))
    assert not vectorized.should_vectorize(sim, clients)  # on an accelerator too


def test_default_chunk_is_larger_on_an_accelerator_and_the_option_wins_on_both():
    """``--vector_chunk_mb`` unset: 64 MiB of stacked state per chunk on the CPU (host memory), 256 MiB on an
    accelerator (more clients per batched call); set, it is used on either device."""
    model = torch.nn.Linear(100, 100)  # 10,100 trainable values x 4 (value, gradient, 2 optimizer slots) x 4 bytes
    per_client = 10_100 * 4 * 4
    algo = FedAvg.__new__(FedAvg)      # the base client_hparams: every client in one group
    clients = list(range(2000))

    def sizes(device, mb=None):
        sim = types.SimpleNamespace(model=model, args=RunArguments(vector_chunk_mb=mb), device=torch.device(device),
                              algorithm=algo, _client_hp_overrides={}, client_hparams=lambda c: ("same",))
        return [len(c) for c in vectorized.chunks_of(sim, clients)]

    cpu, gpu = 64 * 2**20 // per_client, 256 * 2**20 // per_client
    assert (cpu, gpu) == (415, 1661)
    assert sizes("cpu") == [cpu] * 4 + [2000 - 4 * cpu]
    assert sizes("cuda") == [gpu, 2000 - gpu]
    one_mb = 2**20 // per_client
    assert sizes("cpu", 1.0) == sizes("cuda", 1.0) == [one_mb] * (2000 // one_mb) + [2000 % one_mb]
