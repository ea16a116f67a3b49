"""The engine's aggregation and FedOpt's server step against hand values: each server option alone, the FedAvg
shortcut's exact mean, the momentum buffer's reset, buffers and integer tensors, dtypes, weights that sum to 1 or
less, integer running maxima, and ``Algorithm.aggregate`` called directly on hand-made uploads.

FedOpt (Reddi et al. 2021) with SGD-momentum as the server optimizer (FedAvgM, Hsu et al. 2019): with
the round's weighted mean ``m_t`` of the uploads, the pseudo-gradient ``d_t = x_t - m_t``, the momentum buffer
``v_t = beta v_{t-1} + d_t`` and ``x_{t+1} = x_t - lr_t v_t`` with ``lr_t = server_lr * server_lr_decay^(t - 1)``.
Model buffers (BatchNorm statistics) and integer tensors take the mean itself.
"""
import threading

import pytest
import torch

from hfpfl.algorithms import register
from hfpfl.algorithms.fedavg import FedAvg
from hfpfl.federated.aggregation import WeightedSums, server_optimizer_step, weighted_average
from hfpfl.federated.context import ServerHParams
from hfpfl.federated.protocol import Update
from test_baseline_pins import FEDAVG1, PIN, STEP0, STEP1, W0, P, _toy, close, lin, make_sim, state


def f32(*v):
    return torch.tensor(v, dtype=torch.float32)


def run_rounds(hp, means, x0=1.0, state0=None):
    """Server steps on one float32 parameter ``p`` from ``x0``: the model and the server's momentum buffer after each
    round (None where the state has no buffer)."""
    s = state0 or {"model": {"p": f32(x0)}}
    out = []
    for r, mean in enumerate(means, start=1):
        s = server_optimizer_step(s, {"p": f32(mean)}, hp, r, param_keys={"p"})
        assert s["model"]["p"].dtype == torch.float32
        buf = s.get("server_opt", {}).get("p")
        if buf is not None:
            assert buf.dtype == torch.float32
        out.append((s["model"]["p"].item(), None if buf is None else buf.item()))
    return s, out


# ------------------------------------------------------------------------------------------------ server step
def test_defaults_return_the_mean_bit_for_bit():
    """server_lr 1, momentum 0, decay 1 is FedAvg: the new model is the mean itself, exactly. x = 1, mean = 2^-60:
    the general step x - 1 * (x - mean) in float64 gives 1 - (1 - 2^-60) = 0 (1 - 2^-60 rounds to 1), so only
    returning the mean gives 2^-60. No momentum buffer is created."""
    for keys in ({"p"}, None):
        s = server_optimizer_step({"model": {"p": f32(1.0)}}, {"p": f32(2.0 ** -60)}, ServerHParams(), 1, keys)
        assert s["model"]["p"].item() == 2.0 ** -60 and s["model"]["p"].dtype == torch.float32
        assert "server_opt" not in s


def test_server_lr_alone_scales_the_pseudo_gradient_without_momentum():
    """server_lr 2 (momentum 0, decay 1): r1 x = 1 - 2 * (1 - 0.5) = 0; r2 mean 0.25: x = 0 - 2 * (0 - 0.25) = 0.5.
    No momentum buffer."""
    s, out = run_rounds(ServerHParams(server_lr=2.0), [0.5, 0.25])
    assert out == [(0.0, None), (0.5, None)]
    assert "server_opt" not in s


def test_server_momentum_alone_accumulates_the_buffer():
    """momentum 0.9 (lr 1, decay 1): r1 d = 0.5, v = 0.5, x = 1 - 0.5 = 0.5; r2 mean 0.25: d = 0.25,
    v = 0.9 * 0.5 + 0.25 = 0.7, x = 0.5 - 0.7 = -0.2. The buffer is the server state's part "server_opt"."""
    s, out = run_rounds(ServerHParams(server_momentum=0.9), [0.5, 0.25])
    assert out[0] == (0.5, 0.5)
    assert out[1] == (pytest.approx(-0.2, abs=1e-7), pytest.approx(0.7, abs=1e-7))
    assert set(s) == {"model", "server_opt"}


def test_server_lr_decay_alone_shrinks_the_step_every_round():
    """decay 0.5 (lr 1, momentum 0): lr_t = 0.5^(t-1) = 1, 0.5, 0.25. r1: x = 1 - (1 - 0.5) = 0.5; r2 mean 0.25:
    x = 0.5 - 0.5 * 0.25 = 0.375; r3 mean 0.125: x = 0.375 - 0.25 * 0.25 = 0.3125. No momentum buffer."""
    s, out = run_rounds(ServerHParams(server_lr_decay=0.5), [0.5, 0.25, 0.125])
    assert out == [(0.5, None), (0.375, None), (0.3125, None)]
    assert "server_opt" not in s


def test_momentum_set_back_to_zero_restarts_the_buffer():
    """A tuner may set momentum 0.9 for a round and then 0: round 2 (defaults, buffer 0.5 kept from round 1) takes
    the general step with v_2 = 0 * 0.5 + d_2, so the buffer becomes d_2 = 0.5 - 0.25 = 0.25 (not the old 0.5, not
    0.9 * 0.5 + 0.25) and x = 0.5 - 0.25 = 0.25."""
    s, _ = run_rounds(ServerHParams(server_momentum=0.9), [0.5])
    assert s["server_opt"]["p"].item() == 0.5
    s = server_optimizer_step(s, {"p": f32(0.25)}, ServerHParams(), 2, param_keys={"p"})
    assert s["model"]["p"].item() == 0.25
    assert s["server_opt"]["p"].item() == 0.25 and s["server_opt"]["p"].dtype == torch.float32


@pytest.mark.parametrize("keys", [{"p"}, None], ids=["param_keys", "all_floats"])
def test_buffers_and_integers_take_the_mean_parameters_the_step(keys):
    """server_lr 2: the parameter p (x 1, mean 0.5) steps to 1 - 2 * 0.5 = 0; an integer counter (x 3, mean 7) takes
    7 in any case (a step would give 3 + 2 * 4 = 11); a float buffer running_var (x 1, mean 2.5) takes 2.5 when it is
    not among the parameter keys, and the step 1 - 2 * (1 - 2.5) = 4 when every float tensor is a parameter
    (param_keys None). The keys before p in the dict do not stop p's step."""
    x = {"bn.num_batches_tracked": torch.tensor(3), "bn.running_var": f32(1.0), "p": f32(1.0)}
    mean = {"bn.num_batches_tracked": torch.tensor(7), "bn.running_var": f32(2.5), "p": f32(0.5)}
    s = server_optimizer_step({"model": x}, mean, ServerHParams(server_lr=2.0), 1, keys)
    new = s["model"]
    assert new["bn.num_batches_tracked"].item() == 7 and new["bn.num_batches_tracked"].dtype == torch.int64
    assert new["bn.running_var"].item() == (2.5 if keys else 4.0)
    assert new["p"].item() == 0.0
    assert "server_opt" not in s


# ------------------------------------------------------------------------------------------------ weighted means
def test_weighted_average_with_fractional_weights_and_integer_max():
    """Weights 0.25 and 0.75 (summing to 1): 0.25 * 4 + 0.75 * 8 = 7 (a float32 result); the integer counter takes
    the max of 3 and 5."""
    a = {"x": f32(4.0), "n": torch.tensor(3)}
    b = {"x": f32(8.0), "n": torch.tensor(5)}
    got = weighted_average([a, b], [0.25, 0.75])
    assert got["x"].item() == 7.0 and got["x"].dtype == torch.float32
    assert got["n"].item() == 5 and got["n"].dtype == torch.int64
    got = weighted_average([a, b], [0.1, 0.2])                        # total 0.3 < 1: (0.4 + 1.6) / 0.3
    assert got["x"].item() == pytest.approx(2.0 / 0.3, rel=1e-6)


def test_weights_summing_to_zero_are_refused():
    with pytest.raises(ValueError, match="^aggregation weights sum to zero"):
        weighted_average([{"x": f32(1.0)}, {"x": f32(2.0)}], [0.0, 0.0])


def test_weighted_sums_divide_floats_by_the_total_keep_integers_and_count_weights():
    """Weights 1 and 1 (total 2): (2 + 6) / 2 = 4 in the template's float32; the integer counter is the max (7), not
    divided; the running total of weights of the part is 1 + 1 = 2 (3 after another upload of weight 1); a fresh
    sum has counted no upload."""
    sums = WeightedSums(denominator=2.0)
    assert sums.count == 0 and "model" not in sums
    sums.add("model", {"x": f32(2.0), "n": torch.tensor(7)}, 1.0)
    sums.add("model", {"x": f32(6.0), "n": torch.tensor(4)}, 1.0)
    assert "model" in sums and "other" not in sums
    assert sums.total == {"model": 2.0}
    got = sums.get("model", {"x": f32(0.0), "n": torch.tensor(0)})
    assert got["x"].item() == 4.0 and got["x"].dtype == torch.float32
    assert got["n"].item() == 7 and got["n"].dtype == torch.int64
    sums.add("model", {"x": f32(1.0), "n": torch.tensor(1)}, 1.0)
    assert sums.total == {"model": 3.0}



@pytest.mark.parametrize("hold_uploads,block", [(1, 4), (3, 4), (8, 4), (8, 1 << 16)])
def test_weighted_sums_fold_held_uploads_value_by_value_in_upload_order(monkeypatch, hold_uploads, block):
    """Held uploads folded block by block add, for every value, in upload order: with 1e30, 1, -1e30 (weights 1)
    the float64 sum is (1e30 + 1) - 1e30 = 0 (1e30 + 1 rounds to 1e30), where another order would give 1. Upload j
    holds ten copies of big[j] (blocks of 4 cross them); another part and an integer counter ride along; held
    uploads are folded before a stacked chunk."""
    monkeypatch.setattr(WeightedSums, "HOLD_UPLOADS", hold_uploads)
    monkeypatch.setattr(WeightedSums, "FOLD_BLOCK", block)
    big = [1e30, 1.0, -1e30, 2.0, 3.0]          # upload j adds big[j] * weight[j] to every value
    weights = [1.0, 1.0, 1.0, 2.0, 1.0]
    sums = WeightedSums(denominator=1.0)
    for j, (b, w) in enumerate(zip(big, weights)):
        sums.add("model", {"x": torch.full((10,), b, dtype=torch.float32), "n": torch.tensor(j)}, w)
        sums.add("other", {"y": f32(b)}, 1.0)
    # by hand: ((((1e30 + 1) - 1e30) + 4) + 3) = 7 in float64; "other" the same with weight 1 everywhere: 5
    assert sums.sums["model"]["x"].tolist() == [7.0] * 10
    assert sums.sums["model"]["n"].item() == 4
    assert sums.sums["other"]["y"].tolist() == [5.0]
    # 1 held, then [1e30, -1e30] stacked (folded client by client): (1 + 1e30) - 1e30 = 0, not (1e30 - 1e30) + 1
    monkeypatch.setattr(WeightedSums, "STACKED_ROW_LOOP", 1)
    again = WeightedSums(denominator=1.0)
    again.add("model", {"x": torch.full((10,), 1.0, dtype=torch.float32)}, 1.0)
    again.add_stacked("model", {"x": torch.tensor([[1e30] * 10, [-1e30] * 10], dtype=torch.float32)}, [1.0, 1.0])
    assert again.get("model", {"x": f32(*[0.0] * 10)})["x"].tolist() == [0.0] * 10



def test_weighted_sums_hold_uploads_up_to_their_byte_and_count_caps(monkeypatch):
    """What is held stays within the caps (the memory the fold may take): with HOLD_BYTES 33, two uploads of four
    float32 (16 + 16 = 32 bytes) stay held and a third folds all three; with HOLD_BYTES 32 the second folds (32 >= 32);
    the count starts afresh after a fold; with HOLD_UPLOADS 2, the second upload folds whatever its size; a
    non-contiguous upload among held ones is folded value by value in upload order like the others."""
    monkeypatch.setattr(WeightedSums, "HOLD_UPLOADS", 8)
    four = torch.arange(4, dtype=torch.float32)
    for cap, held_after in ((33, [1, 2, 0, 1, 2, 0]), (32, [1, 0, 1, 0, 1, 0])):
        monkeypatch.setattr(WeightedSums, "HOLD_BYTES", cap)
        sums, seen = WeightedSums(), []
        for _ in range(6):
            sums.add("m", {"x": four}, 1.0)
            seen.append(sum(map(len, sums._held.values())))
        assert seen == held_after, cap
        assert sums.sums["m"]["x"].tolist() == [0.0, 6.0, 12.0, 18.0]
    monkeypatch.setattr(WeightedSums, "HOLD_BYTES", 2**30)
    monkeypatch.setattr(WeightedSums, "HOLD_UPLOADS", 2)
    sums = WeightedSums()
    sums.add("m", {"x": four}, 1.0)
    assert sum(map(len, sums._held.values())) == 1
    sums.add("m", {"x": four}, 1.0)
    assert sum(map(len, sums._held.values())) == 0
    monkeypatch.setattr(WeightedSums, "HOLD_UPLOADS", 8)
    monkeypatch.setattr(WeightedSums, "FOLD_BLOCK", 2)
    sums = WeightedSums()
    t = torch.tensor([[1e30, 2.0], [3.0, 4.0]], dtype=torch.float32).t()   # not contiguous
    sums.add("m", {"x": torch.full((2, 2), 1.0)}, 1.0)
    sums.add("m", {"x": t}, 1.0)
    sums.add("m", {"x": torch.tensor([[-1e30, 0.0], [0.0, 0.0]])}, 1.0)
    # (1 + 1e30) - 1e30 = 0 in float64; the others 1 + value
    assert sums.sums["m"]["x"].tolist() == [[0.0, 4.0], [3.0, 5.0]]



def test_the_default_accumulate_has_its_upload_checked_only_where_divergence_stops_the_run(monkeypatch):
    """Algorithm.accumulate names the client as the sums' source when ``on_non_finite = "error"``: a NaN upload of
    client 3 is then refused by the fold naming client 3; a method that copes with diverged clients ("skip") folds it
    unchecked, as before (the NaN reaches the sums). An upload folded alone whose float32 sum overflows (two values of
    3e38, all finite) is not refused."""
    from hfpfl.federated.aggregation import NonFiniteUpload
    from hfpfl.federated.protocol import Algorithm, Update

    class Method:
        on_non_finite = "error"

    nan = {"model": {"x": torch.tensor([1.0, float("nan")])}}
    sums = WeightedSums()
    Algorithm.accumulate(Method(), sums, Update(3, nan, 2), 2.0)
    with pytest.raises(NonFiniteUpload) as err:
        sums.get("model", {"x": f32(0.0, 0.0)})
    assert (err.value.source, err.value.key) == (3, "x")
    Method.on_non_finite = "skip"
    sums = WeightedSums()
    Algorithm.accumulate(Method(), sums, Update(3, nan, 2), 2.0)
    assert sums.get("model", {"x": f32(0.0, 0.0)})["x"].isnan().tolist() == [False, True]
    monkeypatch.setattr(WeightedSums, "HOLD_BYTES", 1)  # every upload folded alone
    sums = WeightedSums()
    sums.add("model", {"x": torch.full((2,), 3e38)}, 1.0, source=4)
    assert sums.get("model", {"x": f32(0.0, 0.0)})["x"].tolist() == [pytest.approx(3e38, rel=1e-7)] * 2


# ------------------------------------------------------------------------------------------------ Algorithm.aggregate
class _CountingFedAvg(PIN["fedavg"]):
    """The toy FedAvg recording what ``reduce`` receives."""

    name = "pin_fedavg_counting"
    seen: list = []

    def reduce(self, server_state, sums, round_idx):
        self.seen.append((sums.count, dict(sums.total), round_idx))
        return super().reduce(server_state, sums, round_idx)


register(_CountingFedAvg)
PIN["fedavg_counting"] = _CountingFedAvg
PIN["fedavg_bn"] = _toy(FedAvg, "pin_fedavg_bn", bn=True)


def test_aggregate_weights_uploads_by_the_clients_sample_counts(tmp_path):
    """``Algorithm.aggregate`` on hand-made uploads STEP0 / STEP1: the weights are the clients' train sizes 2 and 3
    (not the uploads' ``num_samples``, set to 100 here), so the mean is FEDAVG1; ``reduce`` gets the round, the 2
    counted uploads and the total weight 5. No upload: the state is returned as it is."""
    sim = make_sim(tmp_path, "fedavg_counting")
    algo = sim.algorithm
    x = algo.init_server_state()
    assert algo.aggregate(x, [], 1) is x
    _CountingFedAvg.seen.clear()
    ups = [Update(0, {"model": state(P(STEP0))}, 100), Update(1, {"model": state(P(STEP1))}, 100)]
    out = algo.aggregate(x, ups, 4)
    close(out["model"], state(P(FEDAVG1)))
    assert _CountingFedAvg.seen == [(2, {"model": 5.0}, 4)]


def test_aggregate_with_weights_summing_to_one_and_to_zero(tmp_path, monkeypatch):
    """Weights 0.25 / 0.75 from ``aggregation_weights``: the mean 0.25 STEP0 + 0.75 STEP1; weights 0 / 0: refused."""
    sim = make_sim(tmp_path, "fedavg")
    algo = sim.algorithm
    x = algo.init_server_state()
    ups = [Update(0, {"model": state(P(STEP0))}, 2), Update(1, {"model": state(P(STEP1))}, 3)]
    monkeypatch.setattr(algo, "aggregation_weights", lambda ids: {0: 0.25, 1: 0.75})
    close(algo.aggregate(x, ups, 1)["model"], state(lin((0.25, P(STEP0)), (0.75, P(STEP1)))))
    monkeypatch.setattr(algo, "aggregation_weights", lambda ids: {0: 0.0, 1: 0.0})
    with pytest.raises(ValueError, match="^aggregation weights sum to zero"):
        algo.aggregate(x, ups, 1)


def test_aggregate_runs_the_server_step_of_the_round_on_parameters_only(tmp_path):
    """FedAvg with a BatchNorm (global) on the toy, server_lr 2, decay 0.5, round 2: lr = 2 * 0.5 = 1, so the
    parameters land on the mean (x - 1 * (x - mean)); round 1 (lr 2) lands on 2 * mean - x. The BN statistics take
    the 2 : 3 mean of the uploads in both rounds, the counter the max."""
    sim = make_sim(tmp_path, "fedavg_bn", server_lr=2.0, server_lr_decay=0.5)
    algo = sim.algorithm
    x = algo.init_server_state()
    assert set(x["model"]) == {"body.weight", "classifier.weight", "classifier.bias", "bn.weight", "bn.bias",
                               "bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}

    def upload(p, rm, rv, n):
        return {**state(P(p)), "bn.weight": torch.tensor([1.0]), "bn.bias": torch.tensor([0.0]),
                "bn.running_mean": torch.tensor([rm]), "bn.running_var": torch.tensor([rv]),
                "bn.num_batches_tracked": torch.tensor(n)}

    ups = [Update(0, {"model": upload(STEP0, 1.0, 2.0, 1)}, 2), Update(1, {"model": upload(STEP1, 6.0, 7.0, 3)}, 3)]
    for r, a in ((2, 1.0), (1, 2.0)):          # x + a * (mean - x): the server step with lr a
        out = algo.aggregate(x, ups, r)["model"]
        close({k: out[k] for k in state(P(W0)).keys()}, state(lin((1 - a, P(W0)), (a, P(FEDAVG1)))), atol=1e-5)
        assert out["bn.running_mean"].item() == pytest.approx(0.4 * 1.0 + 0.6 * 6.0)
        assert out["bn.running_var"].item() == pytest.approx(0.4 * 2.0 + 0.6 * 7.0)
        assert out["bn.num_batches_tracked"].item() == 3


def test_add_stacked_chunks_accumulate_totals_sums_and_integer_maxima():
    """Two vectorized chunks folded into one part: chunk 1 uploads x = (1, 2) and (3, 4) with weights 1 and 2, chunk 2
    uploads (5, 6) with weight 3: the sums are (1 + 6 + 15, 2 + 8 + 18) = (22, 28), the total weight 6, the mean
    (22/6, 28/6). The counters 3, 7 then 5: the running max over both chunks is 7 (chunk 2's own max is 5)."""
    sums = WeightedSums(denominator=6.0)
    sums.add_stacked("model", {"x": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "n": torch.tensor([3, 7])}, [1.0, 2.0])
    sums.add_stacked("model", {"x": torch.tensor([[5.0, 6.0]]), "n": torch.tensor([5])}, [3.0])
    assert sums.total == {"model": 6.0}
    assert sums.sums["model"]["x"].tolist() == [22.0, 28.0] and sums.sums["model"]["x"].dtype == torch.float64
    got = sums.get("model", {"x": f32(0.0, 0.0), "n": torch.tensor(0)})
    torch.testing.assert_close(got["x"], f32(22 / 6, 28 / 6))
    assert got["n"].item() == 7


class _TwoProcesses:
    """Two processes' collectives, simulated by two threads in lockstep: each call deposits this process's value,
    waits for the other's, and computes the collective's result by hand (SUM: a + b, MAX: max(a, b); gather: the two
    lists concatenated in rank order)."""

    def __init__(self):
        self.barrier = threading.Barrier(2, timeout=20)
        self.slots = [None, None]
        self.rank = {}

    def exchange(self, value):
        self.slots[self.rank[threading.get_ident()]] = value
        self.barrier.wait()
        both = list(self.slots)
        self.barrier.wait()
        return both

    def gather_object(self, obj):
        a, b = self.exchange(list(obj))
        return a + b

    def all_reduce(self, t, op=torch.distributed.ReduceOp.SUM):
        a, b = self.exchange(t.clone())
        if op == torch.distributed.ReduceOp.SUM:
            t.copy_(a + b)
        elif op == torch.distributed.ReduceOp.MAX:
            t.copy_(torch.maximum(a, b))
        else:
            raise ValueError(f"unexpected reduce op {op!r}")

    def run(self, *fns):
        errors = []

        def target(rank, fn):
            self.rank[threading.get_ident()] = rank
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 (re-raised below)
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=target, args=(r, fn)) for r, fn in enumerate(fns)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]


def test_all_reduce_sums_floats_maxes_integers_and_joins_missing_keys_and_parts(monkeypatch):
    """Two processes' partial sums, all-reduced (sum for float sums, totals and counts; max for integer counters):
    process 0 folded x = (1, 2) (weight 1) and (3, 4) (weight 2), counter 3, and a part "extra" (y = 1.5, weight 1)
    that process 1 never saw; process 1 folded x = (5, 6) (weight 3), counter 5 and an integer z = -4 that process 0
    never saw. Both end with x = (1 + 6 + 15, 2 + 8 + 18) = (22, 28), counter max(3, 5) = 5, z = -4 (the absent side
    joins with the integer minimum, not 0), y = 1.5 (the absent side joins with zeros), totals model 3 + 3 = 6 and
    extra 1, and 2 + 1 = 3 uploads counted. One process: nothing to do."""
    import types

    import accelerate.utils

    sim = _TwoProcesses()
    monkeypatch.setattr(accelerate.utils, "gather_object", sim.gather_object)
    monkeypatch.setattr(torch.distributed, "all_reduce", sim.all_reduce)
    acc = types.SimpleNamespace(num_processes=2, device=torch.device("cpu"))
    p0, p1 = WeightedSums(), WeightedSums()
    p0.add("model", {"x": f32(1.0, 2.0), "n": torch.tensor(3)}, 1.0)
    p0.add("model", {"x": f32(3.0, 4.0), "n": torch.tensor(1)}, 2.0)
    p0.add("extra", {"y": f32(1.5)}, 1.0)
    p0.count = 2
    p1.add("model", {"x": f32(5.0, 6.0), "n": torch.tensor(5), "z": torch.tensor(-4)}, 3.0)
    p1.count = 1
    sim.run(lambda: p0.all_reduce(acc), lambda: p1.all_reduce(acc))
    for p in (p0, p1):
        assert p.sums["model"]["x"].tolist() == [22.0, 28.0] and p.sums["model"]["x"].dtype == torch.float64
        assert p.sums["model"]["n"].item() == 5 and p.sums["model"]["n"].dtype == torch.int64
        assert p.sums["model"]["z"].item() == -4
        assert p.sums["extra"]["y"].item() == 1.5 and p.sums["extra"]["y"].dtype == torch.float64
        assert p.total == {"model": 6.0, "extra": 1.0}
        assert p.count == 3
    alone = WeightedSums()
    alone.add("model", {"x": f32(1.0)}, 2.0)
    alone.count = 1
    alone.all_reduce(types.SimpleNamespace(num_processes=1, device=torch.device("cpu")))
    assert alone.sums["model"]["x"].tolist() == [2.0] and alone.total == {"model": 2.0} and alone.count == 1
