"""Each baseline's defining property, on real (small) Digits data with the tiny HF ResNet."""
import torch

from hfpfl.algorithms.base import weighted_average
from hfpfl.algorithms.fedbn import norm_key_prefixes
from hfpfl.algorithms.fedper import is_head
from hfpfl.algorithms.fedprox import FedProxConfig
from hfpfl.federated.comm import tensor_bytes


def test_weighted_average_is_sample_weighted():
    a, b = {"w": torch.tensor([0.0, 2.0])}, {"w": torch.tensor([4.0, 6.0])}
    out = weighted_average([a, b], [1, 3])
    assert torch.allclose(out["w"], torch.tensor([3.0, 5.0]))


def test_fedavg_server_state_is_weighted_mean_of_uploads(run_sim):
    sim, _ = run_sim("fedavg", num_rounds=1)
    ups = sim.last_updates
    assert [u.client_id for u in ups] == [0, 1, 2, 3]
    expect = weighted_average([u.upload for u in ups], [u.num_samples for u in ups])
    for k, v in expect.items():
        assert torch.equal(sim.server_state[k], v), k
    # the clients really differ (otherwise averaging would be untested)
    key = next(k for k in expect if "classifier" in k and k.endswith("weight"))
    assert not torch.equal(ups[0].upload[key], ups[1].upload[key])


def test_fedprox_mu_zero_equals_fedavg_exactly(run_sim):
    avg, r_avg = run_sim("fedavg", output_dir="p_a")
    prox, r_prox = run_sim("fedprox", method_config=FedProxConfig(mu=0.0), output_dir="p_b")
    for k in avg.server_state:
        assert torch.equal(avg.server_state[k], prox.server_state[k]), k
    assert r_avg["final"] == r_prox["final"]
    prox_pos, _ = run_sim("fedprox", method_config=FedProxConfig(mu=1.0), output_dir="p_c")
    assert any(not torch.equal(avg.server_state[k], prox_pos.server_state[k]) for k in avg.server_state)


def test_fedbn_norm_layers_never_travel(run_sim):
    sim, res = run_sim("fedbn")
    norms = norm_key_prefixes(sim.model)
    assert norms, "the tiny ResNet must have BatchNorm layers"
    for u in sim.last_updates:
        assert u.upload and not any(k.startswith(norms) for k in u.upload)
    private = sim.store.get(0)
    assert private and all(k.startswith(norms) for k in private)
    assert any("running_mean" in k for k in private)
    # norm statistics are personal: two clients of different domains differ
    k = next(k for k in private if k.endswith("running_mean"))
    assert not torch.equal(sim.store.get(0)[k], sim.store.get(1)[k])
    # bytes up are exactly the non-norm state
    per_client = res["communication"]["per_client"]["0"]["bytes_up"]
    assert per_client == 2 * tensor_bytes(sim.last_updates[0].upload)
    assert "global_accuracy" not in res["final"] and res["final"]["personal_accuracy"] > 0


def test_local_only_communicates_nothing(run_sim):
    sim, res = run_sim("local")
    assert res["communication"]["bytes_up"] == 0 and res["communication"]["bytes_down"] == 0
    assert len(sim.store) == sim.num_clients


def test_fedper_and_fedrep_keep_the_head_personal(run_sim):
    for method in ("fedper", "fedrep"):
        sim, _ = run_sim(method)
        for u in sim.last_updates:
            assert not any(is_head(k) for k in u.upload)
            assert any(not is_head(k) for k in u.upload)
        heads = sim.store.get(0)
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


def test_ditto_global_is_fedavg_and_personal_stays_local(run_sim):
    avg, _ = run_sim("fedavg", output_dir="d_avg")
    ditto, res = run_sim("ditto", output_dir="d_ditto")
    for k in avg.server_state:
        assert torch.equal(avg.server_state[k], ditto.server_state[k]), k
    for u in ditto.last_updates:
        assert not any(k.startswith("personal::") for k in u.upload)
    assert all(k.startswith("personal::") for k in ditto.store.get(0))
    assert res["final"]["personal_accuracy"] > 0


def test_fedavg_ft_personal_beats_or_matches_no_finetuning_on_train_distribution(run_sim):
    sim, res = run_sim("fedavg_ft", num_rounds=1)
    assert 0 <= res["final"]["personal_accuracy"] <= 1
    # fine-tuning at evaluation changes the model away from the global one
    algo = sim.algorithm
    g = {k: v.clone() for k, v in sim.server_state.items()}
    algo.load_personal(0, sim.server_state, None, 1)
    assert any(not torch.equal(sim.model_state[k], g[k]) for k in algo.global_keys)


def test_scaffold_control_variate_is_mean_of_client_controls(run_sim):
    sim, _ = run_sim("scaffold", num_rounds=1, momentum=0.0)
    key = next(k for k in sim.server_state if k.startswith("control::"))
    client_cs = torch.stack([sim.store.get(c)[key] for c in range(sim.num_clients)])
    # all clients participate and c starts at 0: c = mean_i c_i
    assert torch.allclose(sim.server_state[key], client_cs.mean(0), atol=1e-6)
    assert client_cs.abs().sum() > 0
    # model + control travel down: twice the model parameters
    down = sim.algorithm.download(sim.server_state, 0)
    assert tensor_bytes(down) > tensor_bytes({k: v for k, v in down.items() if not k.startswith("control::")})
