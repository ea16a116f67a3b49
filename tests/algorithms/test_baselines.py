"""Each baseline's defining property, on real (small) Digits data with the tiny HF ResNet, checked against hand
computations where the property is arithmetic."""
import pytest
import torch
from torch import nn
from transformers.modeling_outputs import ImageClassifierOutput

from hfpfl.algorithms.base import Update, weighted_average
from hfpfl.algorithms.ditto import DittoConfig
from hfpfl.algorithms.fedbn import norm_key_prefixes
from hfpfl.algorithms.fednova import FedNova, normalizer
from hfpfl.algorithms.fedper import is_head
from hfpfl.algorithms.fedprox import FedProxConfig
from hfpfl.algorithms.scaffold import Scaffold
from hfpfl.federated.comm import tensor_bytes
from hfpfl.training import iterate_batches


class TinyLinear(nn.Module):
    """A linear classifier on flattened pixels: small enough to redo an algorithm's arithmetic by hand."""

    def __init__(self, in_features=3 * 16 * 16, num_labels=10):
        super().__init__()
        torch.manual_seed(0)
        self.classifier = nn.Linear(in_features, num_labels)

    def forward(self, pixel_values, labels=None):
        logits = self.classifier(pixel_values.flatten(1))
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return ImageClassifierOutput(loss=loss, logits=logits)


def test_weighted_average_is_sample_weighted():
    a, b = {"w": torch.tensor([0.0, 2.0])}, {"w": torch.tensor([4.0, 6.0])}
    out = weighted_average([a, b], [1, 3])
    assert torch.allclose(out["w"], torch.tensor([3.0, 5.0]))


def test_fedavg_server_state_is_weighted_mean_of_uploads(run_sim):
    sim, _ = run_sim("fedavg", num_rounds=1)
    ups = sim.last_updates
    assert [u.client_id for u in ups] == [0, 1, 2, 3]
    n = [u.num_samples for u in ups]
    for k, v in sim.server_state["model"].items():
        vals = [u.upload["model"][k] for u in ups]
        if v.is_floating_point():  # sum_i n_i x_i / sum_i n_i, in float64 (independent of the engine's helper)
            expect = (sum(ni * x.double() for ni, x in zip(n, vals)) / sum(n)).to(v.dtype)
        else:                      # integer buffers (BN step counters): the largest
            expect = torch.stack(vals).amax(0)
        assert torch.equal(v, expect), k
    expect = sim.server_state["model"]
    # the clients really differ (otherwise averaging would be untested)
    key = next(k for k in expect if "classifier" in k and k.endswith("weight"))
    assert not torch.equal(ups[0].upload["model"][key], ups[1].upload["model"][key])


def test_fedprox_mu_zero_equals_fedavg_exactly(run_sim):
    avg, r_avg = run_sim("fedavg", output_dir="p_a")
    prox, r_prox = run_sim("fedprox", method_config=FedProxConfig(mu=0.0), output_dir="p_b")
    for k in avg.server_state["model"]:
        assert torch.equal(avg.server_state["model"][k], prox.server_state["model"][k]), k
    assert r_avg["final"] == r_prox["final"]  # mu > 0 against hand values: test_baseline_pins.py


def test_fedbn_norm_layers_never_travel(run_sim):
    sim, res = run_sim("fedbn")
    norms = norm_key_prefixes(sim.model)
    assert norms, "the tiny ResNet must have BatchNorm layers"
    for u in sim.last_updates:
        assert u.upload["model"] and not any(k.startswith(norms) for k in u.upload["model"])
    private = sim.store.get(0)["model"]
    assert private and all(k.startswith(norms) for k in private)
    assert any("running_mean" in k for k in private)
    # norm statistics are personal: two clients of different domains differ
    k = next(k for k in private if k.endswith("running_mean"))
    assert not torch.equal(sim.store.get(0)["model"][k], sim.store.get(1)["model"][k])
    # bytes up are exactly the non-norm state
    per_client = res["communication"]["per_client"]["0"]["bytes_up"]
    assert per_client == 2 * tensor_bytes(sim.last_updates[0].upload)
    assert "global_accuracy" not in res["final"]


def test_local_only_communicates_nothing(run_sim):
    sim, res = run_sim("local")
    assert res["communication"]["bytes_up"] == 0 and res["communication"]["bytes_down"] == 0
    assert len(sim.store) == sim.num_clients


def test_fedper_and_fedrep_keep_the_head_personal(run_sim):
    for method in ("fedper", "fedrep"):
        sim, _ = run_sim(method)
        for u in sim.last_updates:
            assert not any(is_head(k) for k in u.upload["model"])
            assert any(not is_head(k) for k in u.upload["model"])
        heads = sim.store.get(0)["model"]
        assert heads and all(is_head(k) for k in heads)


def test_fedrep_head_phase_leaves_body_unchanged(run_sim):
    sim, _ = run_sim("fedrep", run=False)
    algo = sim.algorithm
    state = algo.init_server_state()
    algo.load_client(algo.download(state, 0), algo.init_private_state(0))
    body_before = {k: sim.model_state[k].clone() for k in algo.global_keys if "running" not in k and "num_batches" not in k}
    algo.local_train(0, 1, params=algo.trainable_parameters(algo.private_keys), epochs=1, tag="head")
    for k, v in body_before.items():
        assert torch.equal(sim.model_state[k], v), k


# ------------------------------------------------------------------------------------------------ Ditto
def test_ditto_global_is_fedavg_and_personal_stays_local(run_sim):
    avg, _ = run_sim("fedavg", output_dir="d_avg")
    ditto, _ = run_sim("ditto", output_dir="d_ditto")
    for k in avg.server_state["model"]:
        assert torch.equal(avg.server_state["model"][k], ditto.server_state["model"][k]), k
    for u in ditto.last_updates:
        assert set(u.upload) == {"model"}
    assert set(ditto.store.get(0)) == {"personal", "model"}


def _ditto_personal(run_sim, lam, name, epochs=1):
    """(simulation, the global model client 0 received in round 1, client 0's personal model after round 1)"""
    sim, _ = run_sim("ditto", method_config=DittoConfig(lam=lam, personal_epochs=epochs), num_rounds=1, output_dir=name, momentum=0.0,
                     lr=0.01, run=False)
    w0 = sim.algorithm.init_server_state()["model"]
    sim.run()
    return sim, w0, sim.store.get(0)["personal"]


def test_ditto_lambda_limits(run_sim):
    """lambda = 0: the personal model is plain local training from the received global model; lambda large: it
    stays at the received global model."""
    sim0, w0, v0 = _ditto_personal(run_sim, 0.0, "lam0")
    algo = sim0.algorithm
    # plain local training from w0 with the personal stage's data order, no regularizer, by hand
    sim0.ctx.load(w0)
    sim0.ctx.load(sim0.initial_private)
    algo.local_train(0, 1, epochs=1, tag="personal")
    plain = sim0.ctx.snapshot(algo.global_keys)
    for k in v0:
        assert torch.allclose(v0[k], plain[k], atol=1e-6), k

    params = dict(sim0.model.named_parameters())  # weights, not BN statistics (the prox term pulls weights)

    def dist(v):
        return sum(float(((v[k] - w0[k]) ** 2).sum()) for k in v if k in params) ** 0.5

    # lambda -> infinity: SGD with lr * lambda = 1 puts v back at w - lr * grad(v) every step, however long it
    # trains (one step away from w, no more), while lambda = 0 drifts further with every epoch
    _, _, far = _ditto_personal(run_sim, 0.0, "lam0_e4", epochs=4)
    _, _, mid = _ditto_personal(run_sim, 10.0, "lam10_e4", epochs=4)
    _, _, near = _ditto_personal(run_sim, 100.0, "lam100_e4", epochs=4)
    assert dist(near) < dist(mid) < dist(far) and dist(near) < 0.5 * dist(far)


# ------------------------------------------------------------------------------------------------ SCAFFOLD
class TinyScaffold(Scaffold):
    name = "tiny_scaffold"

    def build_model(self):
        return TinyLinear()


def test_scaffold_matches_a_hand_computation(run_sim):
    """Two rounds of SCAFFOLD (option II) redone by hand on a linear model: x, c and every c_i agree."""
    from hfpfl.algorithms import register

    register(TinyScaffold)
    lr, eta_g = 0.05, 0.7
    sim, _ = run_sim("tiny_scaffold", server_lr=eta_g, num_rounds=2, momentum=0.0, local_steps=3,
                     clients_per_round=3, run=False)
    x = {k: v.detach().cpu().double() for k, v in sim.model.state_dict().items()}
    c = {k: torch.zeros_like(v) for k, v in x.items()}
    c_i = {}
    n = sim.num_clients
    for r in (1, 2):
        sampled = sim.sample_clients(r)
        dys, dcs = [], []
        for cid in sampled:
            ci = c_i.get(cid, {k: torch.zeros_like(v) for k, v in x.items()})
            y = {k: v.clone().requires_grad_(True) for k, v in x.items()}
            data, gen = sim.train_data(cid), sim.generator(r, cid, "")
            batches = (b for _ in range(3) for b in iterate_batches(data, 16, shuffle=True, generator=gen))
            for _, batch in zip(range(3), batches):  # 3 steps, across epochs for clients with few batches
                logits = batch["pixel_values"].flatten(1).double() @ y["classifier.weight"].T + y["classifier.bias"]
                loss = nn.functional.cross_entropy(logits, batch["labels"])
                grads = torch.autograd.grad(loss, list(y.values()))
                y = {k: (v - lr * (g - ci[k] + c[k])).detach().requires_grad_(True)
                     for (k, v), g in zip(y.items(), grads)}
            ci_new = {k: ci[k] - c[k] + (x[k] - y[k].detach()) / (3 * lr) for k in x}
            dys.append({k: y[k].detach() - x[k] for k in x})
            dcs.append({k: ci_new[k] - ci[k] for k in x})
            c_i[cid] = ci_new
        x = {k: x[k] + eta_g * sum(d[k] for d in dys) / len(dys) for k in x}
        c = {k: c[k] + len(sampled) / n * sum(d[k] for d in dcs) / len(dcs) for k in x}
        sim.step()
    for k in x:
        assert torch.allclose(sim.server_state["model"][k].double(), x[k], atol=1e-5), k
        assert torch.allclose(sim.server_state["control"][k].double(), c[k], atol=1e-4), k
    for cid, ci in c_i.items():
        for k in ci:
            assert torch.allclose(sim.store.get(cid)["control"][k].double(), ci[k], atol=1e-4), (cid, k)
    # model and control travel down: twice the model's bytes, reported per part
    by_part = sim.ledger.totals()["by_part"]
    assert by_part["control"]["bytes_down"] == by_part["model"]["bytes_down"] > 0
    assert set(by_part) == {"model", "control", "delta_y", "delta_c"}


@pytest.mark.parametrize("bad", [dict(momentum=0.9), dict(optimizer="adam", momentum=0.0),
                                 dict(weight_decay=1e-4, momentum=0.0)])
def test_scaffold_rejects_optimizers_its_correction_does_not_fit(run_sim, bad):
    with pytest.raises(ValueError, match="plain SGD.*--momentum 0"):
        run_sim("scaffold", run=False, **bad)


# ------------------------------------------------------------------------------------------------ FedNova
@pytest.mark.parametrize("tau,rho", [(1, 0.0), (5, 0.0), (3, 0.9), (7, 0.5)])
def test_fednova_normalizer_matches_the_papers_closed_form(tau, rho):
    # Wang et al. 2020, momentum SGD: ||a||_1 = [tau - rho (1 - rho^tau) / (1 - rho)] / (1 - rho)
    closed = (tau - rho * (1 - rho ** tau) / (1 - rho)) / (1 - rho)
    assert normalizer(tau, rho) == pytest.approx(closed, rel=1e-12)
    assert normalizer(3, 0.9) == pytest.approx(1 + 1.9 + 2.71)


def test_fednova_aggregate_matches_hand_values(run_sim):
    """x = 0; client A: y = -1, ||a|| = 1, n = 1; client B: y = -4, ||a|| = 2, n = 3.
    p = (1/4, 3/4); tau_eff = 1/4 + 3/2 = 1.75; d = 1/4 * 1/1 + 3/4 * 4/2 = 1.75; x+ = -1.75 * 1.75 = -3.0625."""
    sim, _ = run_sim("fednova", run=False)
    algo: FedNova = sim.algorithm
    key = algo._param_keys()[0]
    state = {"model": {key: torch.zeros(2)}}
    algo._param_keys = lambda: [key]
    ups = [Update(0, {"model": {key: torch.full((2,), -1.0)}, "fednova": {"a": torch.tensor([1.0], dtype=torch.float64)}}, 1),
           Update(1, {"model": {key: torch.full((2,), -4.0)}, "fednova": {"a": torch.tensor([2.0], dtype=torch.float64)}}, 3)]
    out = algo.aggregate(state, ups, 1)
    assert torch.allclose(out["model"][key], torch.full((2,), -3.0625))
