"""Every baseline's defining step against hand values, on a 4-number model with known weights and hand-made data.

The model: ``pred = c * (w . x) + b`` with ``w = body.weight`` (2 numbers), ``c = classifier.weight``, ``b =
classifier.bias`` (the classifier is the "head" FedPer/FedRep keep local), loss ``1/2 mean (pred - y)^2``. Its
gradient, written out (``r = pred - y``, ``h = w . x``):

    dL/db = mean r        dL/dc = mean r h        dL/dw = mean r c x

Start ``w = (1, -1), c = 2, b = 0.5``; client 0 holds ``x = (1, 0), (0, 2)`` with ``y = 1, 0``; client 1 holds
``x = (2, 1), (1, 1), (0, 1)`` with ``y = 0, 1, 2``. Batches hold a whole client (batch size 8), so one epoch is one
full-batch gradient step whatever the shuffling. By hand, one step at lr 0.1 from the start:

    client 0: h = (1, -2), pred = (2.5, -3.5), r = (1.5, -3.5): grad b = -1, c = 4.25, w = (1.5, -7)
              -> w = (0.85, -0.3), c = 1.575, b = 0.6
    client 1: h = (1, 0, -1), pred = (2.5, 0.5, -1.5), r = (2.5, -0.5, -3.5): grad b = -0.5, c = 2, w = (3, -1)
              -> w = (0.7, -0.9), c = 1.8, b = 0.55
    sample-weighted mean (2 : 3): w = (0.76, -0.66), c = 1.71, b = 0.57; uniform mean: w = (0.775, -0.6), ...

Methods with a sequential and a vectorized local update (``--vectorize``: FedAvg, FedProx, FedPer, FedBN, Local)
are checked on both paths; the others (SCAFFOLD, FedNova, Ditto, FedRep) train their own way and have one path.
Multi-step and later-round values use :func:`grads` (the formulas above) in the paper's update equations.
"""
import pytest
import torch
from datasets import Dataset

from hfpfl.algorithms import register
from hfpfl.algorithms.central import Central, CentralConfig
from hfpfl.algorithms.distill import KDConfig
from hfpfl.algorithms.ditto import Ditto, DittoConfig
from hfpfl.algorithms.fedavg import FedAvg
from hfpfl.algorithms.fedavg_ft import FedAvgFT, FineTuneConfig
from hfpfl.algorithms.fedbn import FedBN
from hfpfl.algorithms.feddf import FedDF
from hfpfl.algorithms.fednova import FedNova
from hfpfl.algorithms.fedper import FedPer, FedRep, FedRepConfig
from hfpfl.algorithms.fedprox import FedProx, FedProxConfig
from hfpfl.algorithms.local import LocalOnly
from hfpfl.algorithms.scaffold import Scaffold
from hfpfl.config import RunArguments
from hfpfl.data.federated import ClientData, FederatedData
from hfpfl.federated import vectorized
from hfpfl.federated.engine import Simulation
from hfpfl.federated.aggregation import WeightedSums, server_optimizer_step
from hfpfl.federated.context import ServerHParams
from hfpfl.federated.protocol import Update
from toy_problem import W0, SquaredError, Toy  # noqa: E402

LR = 0.1
DATA = [([[1.0, 0.0], [0.0, 2.0]], [1.0, 0.0]),
        ([[2.0, 1.0], [1.0, 1.0], [0.0, 1.0]], [0.0, 1.0, 2.0]),
        ([[1.0, 2.0], [2.0, 0.0]], [3.0, -1.0])]
# one step at lr 0.1 from W0 on client 0 / client 1 (module docstring)
STEP0 = {"w": [0.85, -0.3], "c": 1.575, "b": 0.6}
STEP1 = {"w": [0.7, -0.9], "c": 1.8, "b": 0.55}
FEDAVG1 = {"w": [0.76, -0.66], "c": 1.71, "b": 0.57}
KEYS = {"w": "body.weight", "c": "classifier.weight", "b": "classifier.bias"}
SHAPES = {"w": (1, 2), "c": (1, 1), "b": (1,)}


# ------------------------------------------------------------------------------------------------ the toy problem
def _toy(base, name, bn=False):
    cls = type(name, (base,), {"name": name, "build_model": lambda self: Toy(bn),
                               "metric": lambda self: SquaredError()})
    return register(cls)


PIN = {m.name: _toy(m, f"pin_{m.name}") for m in (FedAvg, FedProx, Scaffold, FedNova, Ditto, FedPer, FedRep,
                                                   LocalOnly, Central, FedAvgFT, FedDF)}
PIN["fedbn"] = _toy(FedBN, "pin_fedbn", bn=True)


def _ds(xs, ys):
    return Dataset.from_dict({"pixel_values": xs, "labels": ys}).with_format("torch")


def federation(n_clients=2, n_new=0):
    """Clients 0 .. n_clients - 1 hold DATA[i]; held-out new clients (ids continue) hold the next DATA rows."""
    clients = [ClientData(i, _ds(*DATA[i]), _ds(*DATA[i])) for i in range(n_clients + n_new)]
    return FederatedData(clients[:n_clients], clients[n_clients:], _ds(*DATA[0]), None, 1, ["y"], 1, 1)


def make_sim(tmp_path, method, config=None, *, clients=2, new_clients=0, vectorize="off", keep_uploads=True, **kw):
    """A Simulation of ``pin_<method>`` on the toy federation: full-batch plain SGD at lr 0.1, every client every
    round (unless ``clients_per_round``), evaluation only after the last round."""
    run = dict(method=f"pin_{method}", num_rounds=20, eval_every=1000, batch_size=8, lr=LR, momentum=0.0,
               progress=False, checkpoint_every=0, overwrite_output_dir=True, vectorize=vectorize,
               output_dir=str(tmp_path / f"{method}-{vectorize}"))
    run.update(kw)
    cfg = config if config is not None else PIN[method].Config()
    return Simulation(RunArguments(**run), None, cfg, fed_data=federation(clients, new_clients),
                      keep_uploads=keep_uploads)


PATHS = [pytest.param("off", True, id="sequential"), pytest.param("on", False, id="vectorized")]


def step_counting_chunks(sim, monkeypatch):
    """``sim.step()`` that also returns how many clients were trained in vectorized chunks."""
    seen = []
    real = vectorized.train_chunk
    monkeypatch.setattr(vectorized, "train_chunk", lambda *a, **k: seen.append(len(a[1])) or real(*a, **k))
    sim.step()
    monkeypatch.setattr(vectorized, "train_chunk", real)
    return sum(seen)


# ------------------------------------------------------------------------------------------------ hand arithmetic
def P(d):
    """A parameter point as float64 tensors."""
    return {"w": torch.tensor(d["w"], dtype=torch.float64), "c": torch.tensor(float(d["c"]), dtype=torch.float64),
            "b": torch.tensor(float(d["b"]), dtype=torch.float64)}


def grads(p, client):
    """The loss gradient at ``p`` on a client's whole data (formulas of the module docstring)."""
    X, Y = (torch.tensor(v, dtype=torch.float64) for v in DATA[client])
    h = X @ p["w"]
    r = p["c"] * h + p["b"] - Y
    return {"w": (r * p["c"])[:, None].mul(X).mean(0), "c": (r * h).mean(), "b": r.mean()}


def sgd(p, client, steps=1, extra=None):
    """``steps`` full-batch SGD steps at LR; ``extra(p)`` adds to the gradient (a proximal pull, a correction)."""
    for _ in range(steps):
        g = grads(p, client)
        e = extra(p) if extra is not None else {k: 0.0 for k in p}
        p = {k: p[k] - LR * (g[k] + e[k]) for k in p}
    return p


def lin(*terms):
    """sum_i a_i * p_i over (coefficient, point) pairs."""
    return {k: sum(a * p[k] for a, p in terms) for k in ("w", "c", "b")}


def state(p, keys=("w", "c", "b")):
    """A point as the model's state-dict entries (float32)."""
    return {KEYS[k]: p[k].reshape(SHAPES[k]).float() for k in keys}


def close(actual: dict, expected: dict, atol=1e-6):
    assert set(actual) == set(expected), (sorted(actual), sorted(expected))
    for k in expected:
        torch.testing.assert_close(actual[k].double(), expected[k].double(), rtol=1e-6, atol=atol, msg=k)


def nbytes(parts):
    return {p: sum(t.numel() * t.element_size() for t in d.values()) for p, d in parts.items()}


def test_hand_arithmetic_of_the_docstring():
    """The reference gradient reproduces the numbers worked out by hand (so the other tests rest on them)."""
    close(state(sgd(P(W0), 0)), state(P(STEP0)))
    close(state(sgd(P(W0), 1)), state(P(STEP1)))
    close(state(lin((0.4, P(STEP0)), (0.6, P(STEP1)))), state(P(FEDAVG1)))


# ------------------------------------------------------------------------------------------------ FedAvg
@pytest.mark.parametrize("vectorize,keep", PATHS)
def test_fedavg_round_is_the_sample_weighted_mean_of_one_sgd_step(tmp_path, monkeypatch, vectorize, keep):
    """Round 1: each client takes one SGD step (hand values); the server takes the 2 : 3 sample-weighted mean
    (w = (0.76, -0.66), c = 1.71, b = 0.57; the uniform mean would be w = (0.775, -0.6)). Every key travels, 16 bytes
    each way per client."""
    sim = make_sim(tmp_path, "fedavg", vectorize=vectorize, keep_uploads=keep)
    assert step_counting_chunks(sim, monkeypatch) == (2 if vectorize == "on" else 0)
    close(sim.server_state["model"], state(P(FEDAVG1)))
    if keep:
        close(sim.last_updates[0].upload["model"], state(P(STEP0)))
        close(sim.last_updates[1].upload["model"], state(P(STEP1)))
    assert sim.ledger.totals()["per_client"] == {"0": {"bytes_down": 16, "bytes_up": 16},
                                                 "1": {"bytes_down": 16, "bytes_up": 16}}


# ------------------------------------------------------------------------------------------------ aggregation
def test_weighted_sums_accumulate_exactly_in_float64_and_divide_last():
    """Uploads 1, 2^-25 and -1 (float32) with weights 1, 2, 1: the exact mean 2^-24 / 4 = 2^-26. Summed in float32,
    1 + 2^-24 rounds to 1 and the result is 0; dividing each weight first rounds too. Integer buffers take the max.
    The stacked fold (a vectorized chunk's uploads) gives the same bits."""
    ups = [torch.tensor([1.0]), torch.tensor([2.0 ** -25]), torch.tensor([-1.0])]
    weights = [1.0, 2.0, 1.0]
    one = WeightedSums(denominator=sum(weights))
    for u, w, n in zip(ups, weights, (3, 7, 5)):
        one.add("model", {"x": u, "steps": torch.tensor(n)}, w)
    got = one.get("model", {"x": ups[0], "steps": torch.tensor(0)})
    assert got["x"].dtype == torch.float32 and got["x"].item() == 2.0 ** -26
    assert got["steps"].item() == 7
    stacked = WeightedSums(denominator=sum(weights))
    stacked.add_stacked("model", {"x": torch.stack(ups), "steps": torch.tensor([3, 7, 5])}, weights)
    got_s = stacked.get("model", {"x": ups[0], "steps": torch.tensor(0)})
    assert got_s["x"].item() == 2.0 ** -26 and got_s["steps"].item() == 7


def test_server_optimizer_fedopt_lr_momentum_and_decay_by_hand():
    """FedOpt on one parameter (x0 = 1) and one BatchNorm statistic, server lr 0.5, momentum 0.9, decay 0.8:
    r1: mean 0.5,  d = 0.5, m = 0.5,                 x = 1 - 0.5 * 0.5 = 0.75
    r2: mean 0.25, d = 0.5, m = 0.9 * 0.5 + 0.5 = 0.95, x = 0.75 - 0.4 * 0.95 = 0.37
    r3: mean 0.37, d = 0,   m = 0.855,               x = 0.37 - 0.32 * 0.855 = 0.0964
    The statistic takes the mean itself every round."""
    hp = ServerHParams(server_lr=0.5, server_momentum=0.9, server_lr_decay=0.8)
    s = {"model": {"p": torch.tensor([1.0], dtype=torch.float64), "bn.running_var": torch.tensor([1.0])}}
    for r, mean, x, m in ((1, 0.5, 0.75, 0.5), (2, 0.25, 0.37, 0.95), (3, 0.37, 0.0964, 0.855)):
        s = server_optimizer_step(s, {"p": torch.tensor([mean], dtype=torch.float64),
                                      "bn.running_var": torch.tensor([mean + 2])}, hp, r, param_keys={"p"})
        assert s["model"]["p"].item() == pytest.approx(x, abs=1e-12), r
        assert s["server_opt"]["p"].item() == pytest.approx(m, abs=1e-12), r
        assert s["model"]["bn.running_var"].item() == pytest.approx(mean + 2), r


@pytest.mark.parametrize("vectorize,keep", PATHS)
def test_server_optimizer_through_the_engine(tmp_path, vectorize, keep):
    """Three FedAvg rounds with server lr 0.5, momentum 0.9, decay 0.8: x <- x - 0.5 * 0.8^(r-1) * m, m = 0.9 m +
    (x - mean), the mean of each round's client steps (reference gradients)."""
    sim = make_sim(tmp_path, "fedavg", vectorize=vectorize, keep_uploads=keep, server_lr=0.5, server_momentum=0.9,
                   server_lr_decay=0.8)
    x, m = P(W0), None
    for r in (1, 2, 3):
        sim.step()
        mean = lin((0.4, sgd(x, 0)), (0.6, sgd(x, 1)))
        d = lin((1, x), (-1, mean))
        m = d if m is None else lin((0.9, m), (1, d))
        x = lin((1, x), (-0.5 * 0.8 ** (r - 1), m))
        close(sim.server_state["model"], state(x), atol=1e-5)


# ------------------------------------------------------------------------------------------------ FedProx
@pytest.mark.parametrize("vectorize,keep", PATHS)
def test_fedprox_adds_mu_times_the_distance_to_the_download(tmp_path, monkeypatch, vectorize, keep):
    """Two local steps, mu = 0.5: the first step is plain SGD (the client is at the download, the proximal pull is
    0): STEP0 / STEP1; the second adds mu (v1 - w0) to the gradient, mu/2 ||v - w0||^2's gradient. For client 0 that
    moves w by -lr * mu * (v1 - w0) = -0.05 * (-0.15, 0.7) = (0.0075, -0.035) against FedAvg's second step."""
    mu = 0.5
    sim = make_sim(tmp_path, "fedprox", FedProxConfig(mu=mu), vectorize=vectorize, keep_uploads=keep, local_steps=2)
    assert step_counting_chunks(sim, monkeypatch) == (2 if vectorize == "on" else 0)
    x = P(W0)
    ys = [sgd(x, i, 2, extra=lambda p: {k: mu * (p[k] - x[k]) for k in p}) for i in (0, 1)]
    plain0 = sgd(x, 0, 2)
    torch.testing.assert_close(ys[0]["w"] - plain0["w"], torch.tensor([0.0075, -0.035], dtype=torch.float64))
    torch.testing.assert_close(ys[0]["c"] - plain0["c"], torch.tensor(-0.05 * -0.425, dtype=torch.float64))
    if keep:
        close(sim.last_updates[0].upload["model"], state(ys[0]))
        close(sim.last_updates[1].upload["model"], state(ys[1]))
    close(sim.server_state["model"], state(lin((0.4, ys[0]), (0.6, ys[1]))))
    # the anchor is the download itself: nothing more travels
    assert sim.ledger.totals()["by_part"] == {"model": {"bytes_down": 32, "bytes_up": 32}}


# ------------------------------------------------------------------------------------------------ SCAFFOLD
def test_scaffold_round_one_by_hand_and_round_two_corrected(tmp_path):
    """One local step (K = 1), server lr 1, both clients of N = 2 sampled.
    Round 1 (c = c_i = 0): y_i = the plain step; option II c_i+ = c_i - c + (x - y_i) / (K lr) = client i's gradient
    at x: c_0 = (w (1.5, -7), c 4.25, b -1), c_1 = (w (3, -1), c 2, b -0.5); the server takes UNIFORM means (not 2:3):
    x = (STEP0 + STEP1) / 2 = (w (0.775, -0.6), c 1.6875, b 0.575), c = |S|/N mean(c_i) = (w (2.25, -4), c 3.125,
    b -0.75). Round 2: y_i = x - lr (g_i(x) - c_i + c)."""
    sim = make_sim(tmp_path, "scaffold")
    sim.step()
    c0 = {"w": [1.5, -7.0], "c": 4.25, "b": -1.0}
    c1 = {"w": [3.0, -1.0], "c": 2.0, "b": -0.5}
    close(sim.store.get(0)["control"], state(P(c0)))
    close(sim.store.get(1)["control"], state(P(c1)))
    close(sim.server_state["control"], state(P({"w": [2.25, -4.0], "c": 3.125, "b": -0.75})))
    x = P({"w": [0.775, -0.6], "c": 1.6875, "b": 0.575})
    close(sim.server_state["model"], state(x))
    # what travels: x and c down, delta y and delta c up, 16 bytes each
    assert nbytes(sim.last_updates[0].upload) == {"delta_y": 16, "delta_c": 16}
    assert sim.ledger.totals()["by_part"] == {p: {"bytes_down": bd, "bytes_up": bu} for p, bd, bu in (
        ("model", 32, 0), ("control", 32, 0), ("delta_y", 0, 32), ("delta_c", 0, 32))}
    sim.step()
    c = P({"w": [2.25, -4.0], "c": 3.125, "b": -0.75})
    ci = [P(c0), P(c1)]
    ys = [sgd(x, i, extra=lambda p, i=i: {k: c[k] - ci[i][k] for k in p}) for i in (0, 1)]
    close(sim.last_updates[0].upload["delta_y"], state(lin((1, ys[0]), (-1, x))))
    close(sim.server_state["model"], state(lin((0.5, ys[0]), (0.5, ys[1]))))


def test_scaffold_partial_participation_and_server_lr_against_the_paper(tmp_path):
    """Algorithm 1 of Karimireddy et al. (option II) redone on the toy: N = 3 clients, 2 sampled per round, K = 2
    local steps with the correction c - c_i, server lr 0.7: x += 0.7 mean(dy), c += (2/3) mean(dc), three rounds."""
    eta_g, K = 0.7, 2
    sim = make_sim(tmp_path, "scaffold", clients=3, clients_per_round=2, local_steps=K, server_lr=eta_g)
    x = P(W0)
    c = {k: torch.zeros_like(v) for k, v in x.items()}
    ci = {i: {k: torch.zeros_like(v) for k, v in x.items()} for i in range(3)}
    for r in (1, 2, 3):
        sampled = sim.sample_clients(r)
        assert len(sampled) == 2
        dys, dcs = [], []
        for i in sampled:
            y = sgd(x, i, K, extra=lambda p, i=i: {k: c[k] - ci[i][k] for k in p})
            new = {k: ci[i][k] - c[k] + (x[k] - y[k]) / (K * LR) for k in x}
            dys.append(lin((1, y), (-1, x)))
            dcs.append(lin((1, new), (-1, ci[i])))
            ci[i] = new
        x = lin((1, x), (eta_g / 2, dys[0]), (eta_g / 2, dys[1]))
        c = lin((1, c), (1 / 3, dcs[0]), (1 / 3, dcs[1]))
        sim.step()
        close(sim.server_state["model"], state(x), atol=1e-5)
        close(sim.server_state["control"], state(c), atol=1e-4)
        for i in sampled:
            close(sim.store.get(i)["control"], state(ci[i]), atol=1e-4)


# ------------------------------------------------------------------------------------------------ FedNova
def test_fednova_normalizes_each_update_by_its_local_steps(tmp_path):
    """Client 0 takes tau_0 = 1 step, client 1 tau_1 = 3 (plain SGD: ||a_i||_1 = tau_i). p = (2/5, 3/5),
    tau_eff = 0.4 * 1 + 0.6 * 3 = 2.2, x+ = x - 2.2 (0.4 (x - y_0) / 1 + 0.6 (x - y_1) / 3) (Wang et al. 2020);
    the plain weighted mean (no normalization) would be x - (0.4 (x - y_0) + 0.6 (x - y_1)). What travels: the model
    and a (one float64, 8 bytes)."""
    sim = make_sim(tmp_path, "fednova")
    sim.step(client_hparams={0: {"local_steps": 1}, 1: {"local_steps": 3}})
    x = P(W0)
    y0, y1 = sgd(x, 0, 1), sgd(x, 1, 3)
    close(sim.last_updates[0].upload["model"], state(P(STEP0)))
    close(sim.last_updates[1].upload["model"], state(y1))
    assert [u.upload["fednova"]["a"].item() for u in sim.last_updates] == [1.0, 3.0]
    assert nbytes(sim.last_updates[1].upload) == {"model": 16, "fednova": 8}
    assert sim.ledger.totals()["per_client"]["1"] == {"bytes_down": 16, "bytes_up": 24}
    expected = lin((1, x), (-2.2 * 0.4, lin((1, x), (-1, y0))), (-2.2 * 0.6 / 3, lin((1, x), (-1, y1))))
    close(sim.server_state["model"], state(expected))


def test_fednova_with_momentum_uses_the_momentum_normalizer(tmp_path):
    """Momentum 0.5, 3 local steps: ||a||_1 = sum_t (1 - 0.5^t) / 0.5 = 1 + 1.5 + 1.75 = 4.25 (Wang et al. 2020,
    momentum SGD)."""
    sim = make_sim(tmp_path, "fednova", momentum=0.5, local_steps=3)
    sim.step()
    assert [u.upload["fednova"]["a"].item() for u in sim.last_updates] == [4.25, 4.25]


# ------------------------------------------------------------------------------------------------ Ditto
def test_ditto_personal_step_pulls_toward_the_received_global_model(tmp_path):
    """lambda = 0.5, 2 personal epochs (2 full-batch steps). The global part is FedAvg (uploads STEP0 / STEP1, server
    FEDAVG1). Client i's personal model starts at the download w0 (pull 0), then v2 = v1 - lr (g(v1) + lambda (v1 -
    w0)): for client 0, -lr * lambda * (v1 - w0) = (0.0075, -0.035) in w against plain training. Round 2: v continues
    from the kept v and is pulled toward round 2's download. Only the global model travels."""
    lam = 0.5
    sim = make_sim(tmp_path, "ditto", DittoConfig(lam=lam, personal_epochs=2))
    sim.step()
    close(sim.last_updates[0].upload["model"], state(P(STEP0)))
    close(sim.server_state["model"], state(P(FEDAVG1)))
    w0 = P(W0)
    v = [sgd(w0, i, 2, extra=lambda p: {k: lam * (p[k] - w0[k]) for k in p}) for i in (0, 1)]
    torch.testing.assert_close(v[0]["w"] - sgd(w0, 0, 2)["w"], torch.tensor([0.0075, -0.035], dtype=torch.float64))
    for i in (0, 1):
        close(sim.store.get(i)["personal"], state(v[i]))
        assert set(sim.last_updates[i].upload) == {"model"}
    assert sim.ledger.totals()["by_part"] == {"model": {"bytes_down": 32, "bytes_up": 32}}
    sim.step()
    w1 = P(FEDAVG1)
    for i in (0, 1):
        v2 = sgd(v[i], i, 2, extra=lambda p: {k: lam * (p[k] - w1[k]) for k in p})
        close(sim.store.get(i)["personal"], state(v2))


# ------------------------------------------------------------------------------------------------ FedPer / FedRep
@pytest.mark.parametrize("vectorize,keep", PATHS)
def test_fedper_head_stays_local_body_is_averaged(tmp_path, monkeypatch, vectorize, keep):
    """FedPer trains head and body jointly (one step: STEP0 / STEP1); only the body w travels (8 bytes each way) and
    is averaged 2 : 3 to (0.76, -0.66); each client keeps its own head (c, b) = (1.575, 0.6) / (1.8, 0.55). Round 2
    starts from the averaged body and the client's own head."""
    sim = make_sim(tmp_path, "fedper", vectorize=vectorize, keep_uploads=keep)
    assert step_counting_chunks(sim, monkeypatch) == (2 if vectorize == "on" else 0)
    close(sim.server_state["model"], state(P(FEDAVG1), "w"))
    close(sim.store.get(0)["model"], state(P(STEP0), "cb"))
    close(sim.store.get(1)["model"], state(P(STEP1), "cb"))
    if keep:
        close(sim.last_updates[0].upload["model"], state(P(STEP0), "w"))
    assert sim.ledger.totals()["per_client"]["1"] == {"bytes_down": 8, "bytes_up": 8}
    sim.step()
    starts = [{**P(STEP0), "w": P(FEDAVG1)["w"]}, {**P(STEP1), "w": P(FEDAVG1)["w"]}]
    ys = [sgd(starts[i], i) for i in (0, 1)]
    close(sim.server_state["model"], state(lin((0.4, ys[0]), (0.6, ys[1])), "w"))
    close(sim.store.get(0)["model"], state(ys[0], "cb"))


def test_fedrep_trains_the_head_first_then_the_body(tmp_path):
    """FedRep, 2 head epochs then 1 body epoch: (c, b) take two steps with w fixed at the download, then w one step
    with the new head fixed. The first head step is STEP0's (c, b) = (1.575, 0.6). Only w travels; the head stays."""
    sim = make_sim(tmp_path, "fedrep", FedRepConfig(head_epochs=2, body_epochs=1))
    sim.step()
    def head_step(p, i):
        g = grads(p, i)
        return {**p, "c": p["c"] - LR * g["c"], "b": p["b"] - LR * g["b"]}

    close(state(head_step(P(W0), 0), "cb"), state(P(STEP0), "cb"))
    ys = []
    for i in (0, 1):
        p = head_step(head_step(P(W0), i), i)
        p = {**p, "w": p["w"] - LR * grads(p, i)["w"]}
        ys.append(p)
        close(sim.store.get(i)["model"], state(p, "cb"))
        close(sim.last_updates[i].upload["model"], state(p, "w"))
    close(sim.server_state["model"], state(lin((0.4, ys[0]), (0.6, ys[1])), "w"))
    assert sim.ledger.totals()["per_client"]["0"] == {"bytes_down": 8, "bytes_up": 8}


# ------------------------------------------------------------------------------------------------ FedBN
def _bn_step(i):
    """Client i's one step on the BN toy from W0 (BN at weight 1, bias 0, fresh statistics): the running statistics
    (momentum 0.1, unbiased batch variance) and the BN affine's step (dL/dbeta = mean r c,
    dL/dgamma = mean r c yhat)."""
    X, Y = (torch.tensor(v, dtype=torch.float64) for v in DATA[i])
    h = X @ torch.tensor(W0["w"], dtype=torch.float64)
    mu, var = h.mean(), h.var(unbiased=False)
    yhat = (h - mu) / torch.sqrt(var + 1e-5)
    r = W0["c"] * yhat + W0["b"] - Y
    return {"bn.running_mean": 0.1 * mu, "bn.running_var": 0.9 + 0.1 * h.var(unbiased=True),
            "bn.weight": 1 - LR * (r * W0["c"] * yhat).mean(), "bn.bias": -LR * (r * W0["c"]).mean()}


@pytest.mark.parametrize("vectorize,keep", PATHS)
def test_fedbn_norm_state_never_travels_and_stays_each_clients_own(tmp_path, monkeypatch, vectorize, keep):
    """BN keys (affine and statistics) are private. Client 0: h = (1, -2): running mean 0.1 * -0.5 = -0.05, running
    var 0.9 + 0.1 * 4.5 = 1.35; gamma = 1 - 0.1 * 3 = 0.7 (r = (1.5, -1.5), yhat ~ (1, -1)), beta = 0. Client 1:
    h = (1, 0, -1): running mean 0, var 0.9 + 0.1 * 1 = 1. Uploads: w, c, b only (16 bytes). Round 2 continues
    each client's own statistics: running mean 0.9 * -0.05 + 0.1 * mean(X_0 w_1) for client 0."""
    sim = make_sim(tmp_path, "fedbn", vectorize=vectorize, keep_uploads=keep)
    assert step_counting_chunks(sim, monkeypatch) == (2 if vectorize == "on" else 0)
    hand0 = {"bn.running_mean": -0.05, "bn.running_var": 1.35, "bn.weight": 0.7, "bn.bias": 0.0}
    for k, v in hand0.items():
        assert _bn_step(0)[k].item() == pytest.approx(v, abs=1e-5), k
    assert _bn_step(1)["bn.running_mean"].item() == 0 and _bn_step(1)["bn.running_var"].item() == pytest.approx(1)
    for i in (0, 1):
        priv = sim.store.get(i)["model"]
        assert set(priv) == {"bn.weight", "bn.bias", "bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
        close({k: v for k, v in priv.items() if k != "bn.num_batches_tracked"},
              {k: v.reshape(1) for k, v in _bn_step(i).items()}, atol=1e-5)
        assert priv["bn.num_batches_tracked"].item() == 1
    assert set(sim.server_state["model"]) == set(KEYS.values())
    if keep:
        assert set(sim.last_updates[0].upload["model"]) == set(KEYS.values())
    assert sim.ledger.totals()["per_client"]["0"] == {"bytes_down": 16, "bytes_up": 16}
    w1 = sim.server_state["model"]["body.weight"].double()[0]
    sim.step()
    h = torch.tensor(DATA[0][0], dtype=torch.float64) @ w1
    rm = sim.store.get(0)["model"]["bn.running_mean"].item()
    assert rm == pytest.approx(0.9 * -0.05 + 0.1 * h.mean().item(), abs=1e-6)


# ------------------------------------------------------------------------------------------------ Local, Central
@pytest.mark.parametrize("vectorize,keep", PATHS)
def test_local_only_trains_alone_and_sends_nothing(tmp_path, monkeypatch, vectorize, keep):
    """Every key is private: client i keeps STEP_i after round 1 and continues from it in round 2; 0 bytes travel."""
    sim = make_sim(tmp_path, "local", vectorize=vectorize, keep_uploads=keep)
    assert step_counting_chunks(sim, monkeypatch) == (2 if vectorize == "on" else 0)
    close(sim.store.get(0)["model"], state(P(STEP0)))
    close(sim.store.get(1)["model"], state(P(STEP1)))
    sim.step()
    close(sim.store.get(0)["model"], state(sgd(P(STEP0), 0)))
    close(sim.store.get(1)["model"], state(sgd(P(STEP1), 1)))
    assert sim.ledger.totals()["bytes_up"] == 0 and sim.ledger.totals()["bytes_down"] == 0


def test_central_trains_once_on_the_union(tmp_path):
    """One epoch over the union of the 5 points (one full batch): the union's gradient is the 2 : 3 mix of the
    clients', so one step lands on FEDAVG1. Each client uploads its raw data once: 2 or 3 rows of 2 + 1 float32."""
    sim = make_sim(tmp_path, "central", CentralConfig(epochs=1), num_rounds=1)
    sim.run()
    close(sim.server_state["model"], state(P(FEDAVG1)))
    assert sim.ledger.totals()["per_client"] == {"0": {"bytes_down": 0, "bytes_up": 2 * 12},
                                                 "1": {"bytes_down": 0, "bytes_up": 3 * 12}}


# ------------------------------------------------------------------------------------------------ FedAvg + FT
def test_fedavg_ft_personal_model_is_the_global_model_fine_tuned(tmp_path):
    """After round 1 the global model is FEDAVG1; client 0's personal model is FEDAVG1 after 2 SGD steps on client
    0's data; the server state is untouched by fine-tuning."""
    sim = make_sim(tmp_path, "fedavg_ft", FineTuneConfig(finetune_epochs=2))
    sim.step()
    close(sim.server_state["model"], state(P(FEDAVG1)))
    assert sim.ledger.totals()["by_part"] == {"model": {"bytes_down": 32, "bytes_up": 32}}
    model = sim.algorithm.load_personal(0, sim.server_state, sim.store.get(0), 1)
    close({k: v.detach() for k, v in model.state_dict().items()}, state(sgd(P(FEDAVG1), 0, 2)))
    close(sim.server_state["model"], state(P(FEDAVG1)))


# ------------------------------------------------------------------------------------------------ FedDF
def test_feddf_distills_from_the_weighted_average_and_the_uploaded_models(tmp_path, monkeypatch):
    """The server's distillation starts from the 2 : 3 average FEDAVG1 with the uploaded client models (STEP0,
    STEP1) as the ensemble, and its result is the new server model; rounds past kd_rounds are plain FedAvg. (The
    distillation itself lives in distill.py and is tested there.)"""
    import hfpfl.algorithms.feddf as feddf

    calls = []

    def fake_distill(algo, avg, teachers, config, round_idx):
        calls.append((avg, teachers, round_idx))
        return {"classifier.bias": torch.tensor([9.0])}, {"kd_loss": 0.0}

    monkeypatch.setattr(feddf, "ensemble_distill", fake_distill)
    sim = make_sim(tmp_path, "feddf", KDConfig(kd_rounds=1))
    sim.step()
    (avg, teachers, r), = calls
    close(avg, state(P(FEDAVG1)))
    close(teachers[0], state(P(STEP0)))
    close(teachers[1], state(P(STEP1)))
    assert r == 1
    expect = state(P(FEDAVG1))
    expect["classifier.bias"] = torch.tensor([9.0])
    close(sim.server_state["model"], expect)
    assert sim.ledger.totals()["by_part"] == {"model": {"bytes_down": 32, "bytes_up": 32}}
    sim.step()  # past kd_rounds: the plain weighted average of two steps from the distilled model
    assert len(calls) == 1
    x = {**P(FEDAVG1), "b": torch.tensor(9.0, dtype=torch.float64)}
    close(sim.server_state["model"], state(lin((0.4, sgd(x, 0)), (0.6, sgd(x, 1)))))


# ------------------------------------------------------------------------------------------------ new clients
@pytest.mark.parametrize("method,start", [
    ("fedavg", FEDAVG1),                                     # the global model
    ("ditto", FEDAVG1),                                      # Ditto's global model (no personal v yet)
    ("fedper", {"w": FEDAVG1["w"], "c": W0["c"], "b": W0["b"]}),   # global body, the initial head
    ("local", W0),                                           # nothing global: the initial model
])
def test_new_client_fine_tunes_from_the_global_state(tmp_path, method, start):
    """The baselines' new-client protocol: a held-out client (DATA[2]) starts from the round's global keys and the
    initial private ones, and takes --new_client_epochs (2) SGD steps on its own data; the server state is untouched."""
    sim = make_sim(tmp_path, method, new_clients=1, new_client_epochs=2)
    sim.step()
    before = {k: v.clone() for k, v in sim.server_state["model"].items()}
    model = sim.algorithm.personalize_new_client(2, sim.server_state, sim.train_data(2), 1)
    close({k: v.detach() for k, v in model.state_dict().items()}, state(sgd(P(start), 2, 2)))
    close(sim.server_state["model"], before, atol=0)


# ------------------------------------------------------------------------------------------------ which path runs
def test_methods_with_their_own_local_update_never_take_the_vectorized_path(tmp_path):
    """``--vectorize on`` trains FedAvg, FedProx, FedPer, FedBN and Local-only in batched chunks (their defining terms
    are pinned on both paths above); SCAFFOLD (correction), FedNova (a_i), Ditto (personal model) and FedRep (head
    then body) train their own way and must fall back to the sequential loop, or their defining step would vanish."""
    for method in ("fedavg", "fedprox", "fedper", "fedbn", "local", "fedavg_ft"):
        assert vectorized.vectorize_reason(make_sim(tmp_path, method, vectorize="on")) is None, method
    for method in ("scaffold", "fednova", "ditto", "fedrep"):
        sim = make_sim(tmp_path, method, vectorize="on")
        assert "trains its clients its own way" in vectorized.vectorize_reason(sim), method
        assert not vectorized.should_vectorize(sim, [0, 1]), method


def test_fednova_skips_a_non_finite_client(tmp_path, caplog):
    """A client whose upload is NaN is left out and logged: with client 1 alone (p = 1, a = 3), x+ = x - 3 (x - y_1)/3
    = y_1, the surviving client's model."""
    sim = make_sim(tmp_path, "fednova")
    algo = sim.algorithm
    x = algo.init_server_state()
    y1 = state(P(STEP1))
    bad = {k: torch.full_like(v, float("nan")) for k, v in y1.items()}
    a = {"a": torch.tensor([1.0], dtype=torch.float64)}
    ups = [Update(0, {"model": bad, "fednova": a}, 2),
           Update(1, {"model": y1, "fednova": {"a": torch.tensor([3.0], dtype=torch.float64)}}, 3)]
    with caplog.at_level("WARNING", logger="hfpfl"):
        out = algo.aggregate(x, ups, 1)
    close(out["model"], y1)
    assert "client 0 sent a non-finite update; skipped" in caplog.text


def test_fedbn_keep_optimizer_state_carries_each_clients_momentum_across_rounds(tmp_path):
    """--keep_optimizer_state, momentum 0.5: client 1's BN shift beta has gradient mean(r c) = 2 * mean(2.949, -0.5,
    -3.949) = -1 in round 1, so its momentum buffer leaves round 1 at -1 (beta = 0.1); round 2's step is then
    lr * (0.5 * -1 + g_2) with g_2 the gradient at round 2's start (a fresh optimizer would step lr * g_2). The state
    stays on the client."""
    from hfpfl.algorithms.fedbn import FedBNConfig

    sim = make_sim(tmp_path, "fedbn", FedBNConfig(keep_optimizer_state=True), momentum=0.5)
    sim.step()
    priv = sim.store.get(1)
    assert priv["model"]["bn.bias"].item() == pytest.approx(0.1, abs=1e-6)
    assert priv["optim"]["0:bn.bias.momentum_buffer"].item() == pytest.approx(-1.0, abs=1e-6)
    g = sim.server_state["model"]
    w, c, b = (g[k].double().flatten() for k in ("body.weight", "classifier.weight", "classifier.bias"))
    gamma, beta = priv["model"]["bn.weight"].double(), priv["model"]["bn.bias"].double()
    X, Y = (torch.tensor(v, dtype=torch.float64) for v in DATA[1])
    h = X @ w
    yhat = (h - h.mean()) / torch.sqrt(h.var(unbiased=False) + 1e-5)
    g2 = ((c * (gamma * yhat + beta) + b - Y) * c).mean()
    sim.step()
    expected = beta - LR * (0.5 * -1.0 + g2)
    assert sim.store.get(1)["model"]["bn.bias"].double().item() == pytest.approx(expected.item(), abs=1e-6)
    assert set(sim.ledger.totals()["by_part"]) == {"model"}


def test_proximal_term_of_a_model_counts_its_trainable_parameters_only_by_hand():
    """proximal_term(model, anchor, coef) -- Ditto's and PerAda's form -- is coef/2 * sum ||p - anchor[p]||^2 over the
    model's trainable parameters named in the anchor: weight [[1, 2]] against [[0, 0]] and bias [3] against [1] give
    (1 + 4) + 4 = 9, times 0.5 * 0.2 = 0.9; the frozen bias counts nothing once frozen (0.5 * 0.2 * 5 = 0.5)."""
    from hfpfl.algorithms.fedprox import proximal_term

    lin = torch.nn.Linear(2, 1)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[1.0, 2.0]]))
        lin.bias.copy_(torch.tensor([3.0]))
    anchor = {"weight": torch.zeros(1, 2), "bias": torch.tensor([1.0])}
    assert float(proximal_term(lin, anchor, 0.2)) == pytest.approx(0.9)
    lin.bias.requires_grad_(False)
    assert float(proximal_term(lin, anchor, 0.2)) == pytest.approx(0.5)
