"""FedBasis (spec adapters_fedbasis.md PART B): the per-group combination by hand, inference as one network,
payloads (coefficients never travel; warm start sends only the major basis), k-means warm start, and new clients
training exactly the coefficients with every basis bitwise unchanged."""
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
