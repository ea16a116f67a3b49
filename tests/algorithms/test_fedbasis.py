"""FedBasis (spec adapters_fedbasis.md PART B): the per-group combination by hand, inference as one network,
payloads (coefficients never travel; warm start sends only the major basis), k-means warm start, and new clients
training exactly the coefficients with every basis bitwise unchanged."""
import math

import pytest
import torch

from hfpfl.algorithms import get_algorithm
from hfpfl.algorithms.base import MODEL, PRIVATE
from hfpfl.models.basis import BasisCombinedModel, resnet_groups
from hfpfl.models.cond_norm_resnet import CondNormResNetConfig, CondNormResNetForImageClassification


def _template():
    torch.manual_seed(0)
    return CondNormResNetForImageClassification(CondNormResNetConfig(
        num_labels=3, conditional=False, hidden_sizes=[4, 4, 8, 8], depths=[1, 1, 1, 1]))


def test_combination_by_hand_and_inference_is_one_network():
    m = BasisCombinedModel(_template(), 2, resnet_groups(_template()))
    assert m.group_names == ["fc", "layer1", "layer2", "layer3", "layer4"]
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 and p.numel() > 2 else 0.0))
    a = torch.softmax(m.coef["layer3"], 0)
    k = "blocks__2__conv1__weight"
    theta = m.combined_params()["blocks.2.conv1.weight"]
    assert torch.allclose(theta, 0.5 * m.bases[0][k] + 0.5 * (a[0] * m.bases[1][k] + a[1] * m.bases[2][k]))
    a_fc = torch.softmax(m.coef["fc"], 0)
    assert torch.allclose(m.combined_params()["classifier.bias"], 0.5 * m.bases[0]["classifier__bias"]
                          + 0.5 * (a_fc[0] * m.bases[1]["classifier__bias"] + a_fc[1] * m.bases[2]["classifier__bias"]))
    one = _template()                                 # deploy: one network of the template architecture
    one.load_state_dict(m.combined_state())
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert torch.allclose(one(pixel_values=x).logits, m(x).logits, atol=1e-5)
    assert sum(p.numel() for p in one.parameters()) * 3 + 5 * 2 == sum(p.numel() for p in m.parameters())


def test_payloads_warm_start_and_new_client(run_sim):
    cfg = get_algorithm("fedbasis").Config(num_bases=2, widths="4,4,8,8", warm_fraction=0.5, new_client_steps=3)
    sim = run_sim("fedbasis", method_config=cfg, run=False, num_rounds=2, lr=0.01, local_steps=2, output_dir="fb")[0]
    assert sim.keys_by_role[PRIVATE] == [f"coef.{g}" for g in ["fc", "layer1", "layer2", "layer3", "layer4"]]
    sim.step()                                        # round 1 = the whole warm start: FedAvg on v' alone
    ups = sim.last_updates
    assert all(set(u.upload[MODEL]) == {k for k in sim.keys_by_role["global"] if k.startswith("bases.0.")}
               for u in ups)
    s = sim.server_state[MODEL]
    major = {k: v for k, v in s.items() if k.startswith("bases.0.")}
    mean = {k: torch.stack([u.upload[MODEL][k] for u in ups]).mean(0) for k in major}
    assert all(torch.allclose(major[k], mean[k], atol=1e-6) for k in major)
    locals_ = torch.stack([torch.cat([u.upload[MODEL][k].flatten() for k in major]) for u in ups])
    for b in (1, 2):                                  # v_1, v_2 = k-means centroids: a mean of some local models
        vb = torch.cat([s[k.replace("bases.0.", f"bases.{b}.", 1)].flatten() for k in major])
        assert min(float((vb - locals_[list(sub)].mean(0)).abs().max())
                   for sub in _subsets(len(ups))) < 1e-5
    sim.step()                                        # a FedBasis round: every basis travels, never a coefficient
    for u in sim.last_updates:
        assert set(u.upload[MODEL]) == set(sim.keys_by_role["global"])
        assert not any(k.startswith("coef.") for k in u.upload[MODEL])
        assert set(sim.store.get(u.client_id)[MODEL]) == set(sim.keys_by_role[PRIVATE])
    before = {k: v.clone() for k, v in sim.server_state[MODEL].items()}
    seen, orig = [], sim.ctx.train

    def spy(*a, **kw):
        seen.append(sum(p.numel() for p in sim.model.parameters() if p.requires_grad))
        return orig(*a, **kw)

    sim.ctx.train = spy
    cid = sim.num_clients
    model = sim.algorithm.personalize_new_client(cid, sim.server_state, sim.train_data(cid), 2)
    assert seen == [5 * 2]                            # 5 groups x K coefficients, nothing else
    st = model.state_dict()
    assert all(torch.equal(st[k].cpu(), before[k]) for k in before)
    assert any(not torch.equal(st[k], torch.zeros_like(st[k])) for k in sim.keys_by_role[PRIVATE])


def _subsets(n):
    from itertools import combinations
    return [c for r in range(1, n + 1) for c in combinations(range(n), r)]


def test_resume_after_interruption_equals_straight_run(run_sim):
    """Interrupted after round 2 (warm start + k-means in round 1) and resumed: the same results as 3 rounds
    straight, the collapse diagnostic included (its k-means anchor lives in the server state, part "anchor", and
    never travels)."""
    cfg = get_algorithm("fedbasis").Config(num_bases=2, widths="4,4,8,8", new_client_steps=2)
    kw = dict(method_config=cfg, num_rounds=3, lr=0.01, local_steps=2, checkpoint_every=1,
              eval_every=3)
    straight_sim, straight = run_sim("fedbasis", output_dir="straight", **kw)
    assert "basis_update_cosine" in straight["final"] and "alpha_entropy" in straight["final"]
    assert set(straight_sim.server_state) == {MODEL, "anchor"}
    assert all(set(u.upload) == {MODEL} for u in straight_sim.last_updates)
    cut, _ = run_sim("fedbasis", output_dir="cut", run=False, **kw)
    cut.step(), cut.step()
    _, resumed = run_sim("fedbasis", output_dir="cut", resume_from_checkpoint="latest", overwrite_output_dir=False,
                         **kw)
    for key in ("final", "per_client_accuracy", "new_client_accuracy", "communication"):
        assert resumed[key] == straight[key], key


def _round_with_spy(run_sim, training="improved", lr_coef=0.5):
    """One FedBasis round (round 2 of 2; round 1 is the warm start) of client 0 on a 2-basis toy with known weights:
    v_1 = v' + 0.1 n_1, v_2 = v' - 0.1 n_2 (seeded), the client's stored psi = (3, -3) in every group. The engine's
    loop is wrapped to record, for each training call, what trains, at which lr, and the model's state before/after."""
    cfg = get_algorithm("fedbasis").Config(num_bases=2, widths="4,4,8,8", warm_fraction=0.5, lr_coef=lr_coef,
                                           temperature=0.1, training=training)
    sim = run_sim("fedbasis", method_config=cfg, run=False, num_rounds=2, lr=0.01, local_steps=2, output_dir="fb1")[0]
    algo, m = sim.algorithm, sim.model
    g = torch.Generator().manual_seed(4)
    server = algo.init_server_state()[MODEL]
    down = {}
    for k, v in server.items():
        if k.startswith("bases.0."):
            down[k] = v
            n1, n2 = torch.randn(v.shape, generator=g), torch.randn(v.shape, generator=g)
            down[k.replace("bases.0.", "bases.1.", 1)] = v + 0.1 * n1
            down[k.replace("bases.0.", "bases.2.", 1)] = v - 0.1 * n2
    private = {MODEL: {k: torch.tensor([3.0, -3.0]) for k in sim.keys_by_role[PRIVATE]}}
    calls, orig = [], sim.ctx.train

    def state():
        return {k: v.detach().clone() for k, v in m.named_parameters()}

    def spy(*a, **kw):
        rec = {"tag": kw["tag"], "lr": kw["params"][0]["lr"], "before": state(), "temperature": m.temperature,
               "trains": {k for k, p in m.named_parameters() if p.requires_grad},
               "alpha": None if m.fixed_alpha is None else {k: v.clone() for k, v in m.fixed_alpha.items()},
               "combined": {k: v.detach().clone() for k, v in m.combined_params().items()}}
        out = orig(*a, **kw)
        rec["after"] = state()
        calls.append(rec)
        return out

    sim.ctx.train = spy
    upd = algo.client_update(0, {MODEL: down}, private, 2)
    return sim, m, down, calls, upd


def test_improved_round_resets_psi_then_alternates_coefficients_and_sharpened_bases(run_sim):
    """B2.4, one client round: psi <- 0 (the stored (3, -3) is ignored); step 2 trains exactly the coefficients
    (lr_coef, temperature 1; every basis bitwise unchanged); step 3 freezes alpha = softmax(psi / 0.1) of the psi
    step 2 produced (by hand with math.exp) and the forward uses it: theta = 1/2 v' + 1/2 (a_1 v_1 + a_2 v_2);
    step 4 trains exactly the bases at the run's lr (psi unchanged); the upload is the new bases, the private state
    is step 2's psi."""
    sim, m, down, calls, upd = _round_with_spy(run_sim)
    coef = {k for k in upd.private[MODEL]}
    bases = {k for k in down}
    assert [c["tag"] for c in calls] == ["alpha", "bases"]
    a, b = calls
    # step 2
    assert all(torch.equal(a["before"][k], torch.zeros(2)) for k in coef)          # reset, not (3, -3)
    assert a["trains"] == coef and a["lr"] == 0.5 and a["temperature"] == 1.0 and a["alpha"] is None
    assert all(torch.equal(a["before"][k], a["after"][k]) for k in bases)
    assert all(not torch.equal(a["after"][k], torch.zeros(2)) for k in coef)
    # step 3: sharpened alpha by hand from step 2's psi
    psi = {k.split(".", 1)[1]: a["after"][k].tolist() for k in coef}
    hand = {grp: [math.exp(p / 0.1) / sum(math.exp(q / 0.1) for q in ps) for p in ps] for grp, ps in psi.items()}
    assert set(b["alpha"]) == set(hand)
    for grp, al in hand.items():
        assert b["alpha"][grp].tolist() == pytest.approx(al, rel=1e-5)
    al = hand["fc"]
    theta = 0.5 * down["bases.0.classifier__bias"] + 0.5 * (al[0] * down["bases.1.classifier__bias"]
                                                            + al[1] * down["bases.2.classifier__bias"])
    assert torch.allclose(b["combined"]["classifier.bias"], theta, atol=1e-6)
    # step 4
    assert b["trains"] == bases and b["lr"] == 0.01
    assert all(torch.equal(b["before"][k], b["after"][k]) for k in coef)
    assert any(not torch.equal(b["before"][k], b["after"][k]) for k in bases)
    assert m.fixed_alpha is None
    assert all(torch.equal(upd.upload[MODEL][k], b["after"][k]) for k in bases) and set(upd.upload[MODEL]) == bases
    assert all(torch.equal(upd.private[MODEL][k], a["after"][k]) for k in coef)


def test_naive_round_trains_coefficients_and_bases_jointly_at_temperature_one(run_sim):
    """B2.3 (Eq. 7, the collapse diagnostic): one joint call on every parameter, temperature 1, no fixed alpha."""
    _, m, down, calls, upd = _round_with_spy(run_sim, training="naive")
    assert [c["tag"] for c in calls] == ["joint"]
    (c,) = calls
    assert c["trains"] == set(down) | set(upd.private[MODEL]) and c["temperature"] == 1.0 and c["alpha"] is None
    assert all(torch.equal(c["before"][k], torch.zeros(2)) for k in upd.private[MODEL])   # psi reset here too
