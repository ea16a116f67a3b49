"""FedPCE (spec fedpce.md 7.1): full-width parameter counts (meta device), conditioning by hand on a tiny model,
payload keys and exact bytes (embeddings never travel), embedding init rule, per-client Adam state kept, and
new-client adaptation training exactly the E numbers with every global tensor bitwise unchanged."""
import numpy as np
import pytest
import torch

from hfpfl.algorithms import get_algorithm
from hfpfl.algorithms.base import MODEL, OPTIM, PRIVATE
from hfpfl.models.cond_norm_resnet import EMBEDDING_KEY, CondNorm, CondNormResNetConfig, \
    CondNormResNetForImageClassification

TINY = dict(widths="4,4,8,8", depths="1,1,1,1", embedding_dim=4, mlp_hidden=3, new_client_steps=3)


def _meta(**kw):
    with torch.device("meta"):
        return CondNormResNetForImageClassification(CondNormResNetConfig(num_labels=10, **kw))


def test_full_width_parameter_counts():
    pce, base = _meta(conditional=True), _meta(conditional=False)
    norms = base.norm_layers()
    assert len(norms) == 21 and [m.channels for _, m in norms] == [64] * 5 + [128] * 5 + [256] * 5 + [512] * 6
    assert sum(p.numel() for p in base.parameters()) == 11_174_986
    assert sum(p.numel() for n, p in base.named_parameters() if n.startswith(tuple(n + "." for n, _ in norms))) \
        == 10_624                                                              # FedBN local
    assert base.classifier.weight.numel() + base.classifier.bias.numel() == 5_130   # FedPer local
    shared = sum(p.numel() for n, p in pce.named_parameters() if n != EMBEDDING_KEY)
    assert shared == 11_899_274 and pce.client_embedding.numel() == 32           # 32 private on top
    assert sum(p.numel() for n, p in pce.named_parameters() if ".mlp." in n) == 734_912
    with torch.device("meta"):
        p62 = CondNormResNetForImageClassification(CondNormResNetConfig(num_labels=100,
                                                                        hidden_sizes=[62, 124, 248, 496]))
    assert sum(p.numel() for n, p in p62.named_parameters() if n != EMBEDDING_KEY) == 11_235_762   # FedPCE(62)


def test_conditional_norm_by_hand_and_save_pretrained_roundtrip(tmp_path):
    torch.manual_seed(0)
    cfg = CondNormResNetConfig(num_labels=3, hidden_sizes=[4, 4, 8, 8], depths=[1, 1, 1, 1], embedding_dim=4,
                               mlp_hidden=3)
    layer = CondNorm(5, cfg)
    x, v = torch.randn(2, 5, 3, 3), torch.randn(4)
    out = layer.mlp[2](torch.relu(layer.mlp[0](v)))
    beta, gamma = out[:5], 1 + out[5:]
    mu, var = x.mean((2, 3), keepdim=True), x.var((2, 3), unbiased=False, keepdim=True)
    ref = (x - mu) / torch.sqrt(var + 1e-5) * gamma.view(1, 5, 1, 1) + beta.view(1, 5, 1, 1)
    assert torch.allclose(layer(x, v), ref, atol=1e-5)
    h = torch.randn(2, 5)                                   # head norm: per-sample over the features
    ref_h = (h - h.mean(1, keepdim=True)) / torch.sqrt(h.var(1, unbiased=False, keepdim=True) + 1e-5) * gamma + beta
    assert torch.allclose(layer(h, v), ref_h, atol=1e-5)
    # zeroed last MLP layers: the network is an affine-free IN ResNet, whatever v is 
    model = CondNormResNetForImageClassification(cfg).eval()
    px = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        model.client_embedding.copy_(torch.randn(4))
        a = model(pixel_values=px).logits
        model.client_embedding.copy_(torch.randn(4))
        assert not torch.allclose(a, model(pixel_values=px).logits)   # conditioning works
        for _, m in model.norm_layers():
            m.mlp[2].weight.zero_(), m.mlp[2].bias.zero_()
        b = model(pixel_values=px).logits
        model.client_embedding.copy_(torch.randn(4))
        assert torch.allclose(b, model(pixel_values=px).logits)
    from transformers import AutoModelForImageClassification
    model.save_pretrained(tmp_path / "m")
    again = AutoModelForImageClassification.from_pretrained(tmp_path / "m")
    assert type(again) is CondNormResNetForImageClassification
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_conditional_norm_affine_from_the_embedding_by_hand():
    """Eq. 3-4 with known numbers: E = 2, hidden 2, C = 2 channels. v = (2, 3); first layer W1 = [[1, 0], [0, -1]],
    b1 = (0, 0.5): relu((2, -2.5)) = (2, 0); second layer (output ordered beta, gamma - 1) rows (0.5, 1), (-0.25, 1),
    (0.1, 1), (0.2, 1), bias (0.1, 0, -0.2, 0): (1.1, -0.5, 0, 0.4), so beta = (1.1, -0.5), gamma = (1, 1.4).
    Instance norm (4-D): channel 0 (1, 3) -> (-1, 1) * 1 + 1.1 = (0.1, 2.1); channel 1 (0, 4) -> (-1, 1) * 1.4 - 0.5 =
    (-1.9, 0.9). Head norm (2-D, over the features): (1, 3) -> (-1, 1) * (1, 1.4) + (1.1, -0.5) = (0.1, 0.9)."""
    cfg = CondNormResNetConfig(num_labels=3, embedding_dim=2, mlp_hidden=2)
    layer = CondNorm(2, cfg)
    with torch.no_grad():
        layer.mlp[0].weight.copy_(torch.tensor([[1.0, 0.0], [0.0, -1.0]]))
        layer.mlp[0].bias.copy_(torch.tensor([0.0, 0.5]))
        layer.mlp[2].weight.copy_(torch.tensor([[0.5, 1.0], [-0.25, 1.0], [0.1, 1.0], [0.2, 1.0]]))
        layer.mlp[2].bias.copy_(torch.tensor([0.1, 0.0, -0.2, 0.0]))
    v = torch.tensor([2.0, 3.0])
    gamma, beta = layer.affine(v)
    torch.testing.assert_close(gamma, torch.tensor([1.0, 1.4]))
    torch.testing.assert_close(beta, torch.tensor([1.1, -0.5]))
    s1, s2 = (1 + 1e-5) ** -0.5, 2 * (4 + 1e-5) ** -0.5     # |x - mean| / sqrt(var + eps): spreads +-1, +-2
    x = torch.tensor([[[[1.0, 3.0]], [[0.0, 4.0]]]])           # [1, C=2, 1, 2]
    with torch.no_grad():
        out = layer(x, v)
        head = layer(torch.tensor([[1.0, 3.0]]), v)
    torch.testing.assert_close(out, torch.tensor([[[[1.1 - s1, 1.1 + s1]], [[-0.5 - 1.4 * s2, -0.5 + 1.4 * s2]]]]),
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(head, torch.tensor([[1.1 - s1, -0.5 + 1.4 * s1]]), atol=1e-6, rtol=0)


def test_every_norm_layer_reads_the_clients_embedding():
    """Each CondNorm of the network (stem, both norms of every block, every shortcut norm, the head norm) is called
    with the model's own client embedding (the tensor the engine swaps per client), nothing else."""
    cfg = CondNormResNetConfig(num_labels=3, hidden_sizes=[4, 4, 8, 8], depths=[1, 1, 1, 1], embedding_dim=4,
                               mlp_hidden=3)
    model = CondNormResNetForImageClassification(cfg)
    seen = {}

    def record(name):
        def hook(module, args):
            seen[name] = args[1]
        return hook

    for name, m in model.norm_layers():
        m.register_forward_pre_hook(record(name))
    model(pixel_values=torch.randn(2, 3, 16, 16))
    names = [n for n, _ in model.norm_layers()]
    assert len(names) == 1 + 2 * 4 + 3 + 1                      # stem, 4 blocks x 2, 3 shortcuts, head
    assert sorted(seen) == sorted(names) and all(v is model.client_embedding for v in seen.values())


@pytest.fixture
def pce_sim(run_sim):
    def _make(method="fedpce", local_steps=2, **kw):
        cfg = get_algorithm(method).Config(**{**TINY, **kw})
        return run_sim(method, method_config=cfg, run=False, optimizer="adam", lr=1e-3, weight_decay=1e-4,
                       local_steps=local_steps, output_dir=method)[0]
    return _make


def test_embeddings_never_travel_and_payload_bytes(pce_sim):
    sim = pce_sim("fedpce", embedding_dim=2)       # E = 2 < 4 clients: clients 2, 3 start at 0 
    algo = sim.algorithm
    assert sim.keys_by_role[PRIVATE] == [EMBEDDING_KEY]
    assert torch.equal(algo.init_private_state(0)[MODEL][EMBEDDING_KEY], torch.tensor([1.0, 0.0]))
    assert torch.equal(algo.init_private_state(1)[MODEL][EMBEDDING_KEY], torch.tensor([0.0, 1.0]))
    assert torch.equal(algo.init_private_state(3)[MODEL][EMBEDDING_KEY], torch.zeros(2))
    sim.step()
    shared = {n: p for n, p in sim.model.named_parameters() if n != EMBEDDING_KEY}
    expect = sum(p.numel() * p.element_size() for p in shared.values())
    for u in sim.last_updates:
        assert set(u.upload) == {MODEL} and set(u.upload[MODEL]) == set(shared)       # no embedding travels
        assert sum(t.numel() * t.element_size() for t in u.upload[MODEL].values()) == expect
        priv = sim.store.get(u.client_id)
        assert set(priv[MODEL]) == {EMBEDDING_KEY} and priv[OPTIM]                   # Adam moments kept per client
    # unweighted mean (1/N) of the uploads, whatever the client sizes
    mean = {k: torch.stack([u.upload[MODEL][k].double() for u in sim.last_updates]).mean(0) for k in shared}
    assert all(torch.allclose(sim.server_state[MODEL][k].double(), mean[k], atol=1e-6) for k in shared)
    # the Adam state continues: a client's second-round step counter is 2 local steps further
    sim.step()
    st = sim.store.get(0)[OPTIM]
    steps = [v for k, v in st.items() if k.endswith(".step")]
    assert steps and all(float(s) == 4.0 for s in steps)


def test_first_adam_step_moves_every_group_by_its_learning_rate(pce_sim):
    """One local Adam step (bias-corrected, its step is lr * g / |g| per coordinate) in round 1, where the cosine is at
    its start: every coordinate of every client's embedding moves by lr_embedding = 0.1 (also the zero-initialised
    v of clients 2 and 3: E = 2 < 4 clients), the MLP weights by lr_mlp = 0.01, the other weights by --lr = 0.001
    (median over a tensor's coordinates: a coordinate whose gradient is ~0 moves less)."""
    sim = pce_sim("fedpce", local_steps=1, embedding_dim=2)
    x0 = sim.algorithm.init_server_state()[MODEL]
    sim.step()
    for c in range(4):
        e0 = sim.algorithm.init_private_state(c)[MODEL][EMBEDDING_KEY]
        e1 = sim.store.get(c)[MODEL][EMBEDDING_KEY]
        torch.testing.assert_close((e1 - e0).abs(), torch.full_like(e0, 0.1), atol=1e-5, rtol=0)
    up = next(u for u in sim.last_updates if u.client_id == 0).upload[MODEL]
    params = dict(sim.model.named_parameters())
    for k in up:
        if k not in params:
            continue
        lr = 0.01 if ".mlp." in k else 1e-3
        moved = (up[k] - x0[k]).abs()
        assert torch.allclose(moved.median(), torch.tensor(lr), rtol=1e-3), (k, moved.median())


def test_new_client_trains_exactly_the_embedding(pce_sim):
    sim = pce_sim("fedpce")
    sim.step()
    algo, cid = sim.algorithm, sim.num_clients
    before = {k: v.clone() for k, v in sim.server_state[MODEL].items()}
    seen = []
    orig = sim.ctx.train

    def spy(*a, **kw):
        seen.append([(n, p.numel()) for n, p in sim.model.named_parameters() if p.requires_grad])
        return orig(*a, **kw)

    sim.ctx.train = spy
    model = algo.personalize_new_client(cid, sim.server_state, sim.train_data(cid), 1)
    assert seen == [[(EMBEDDING_KEY, 4)]]                      # only v_{N+1} (E numbers) has requires_grad
    state = model.state_dict()
    assert all(torch.equal(state[k].cpu(), before[k]) for k in before)   # every global tensor bitwise unchanged
    assert not torch.equal(state[EMBEDDING_KEY].cpu(), torch.zeros(4))        # started at 0, moved
    assert all(p.requires_grad for n, p in model.named_parameters())   # trainability restored afterwards


@pytest.mark.parametrize("method,local,adapts", [("pce_fedbn", "norm", True), ("pce_fedper", "classifier.", True),
                                                 ("pce_fedavg", None, False)])
def test_baselines_split_and_new_client_protocol(pce_sim, method, local, adapts):
    sim = pce_sim(method)
    priv = sim.keys_by_role[PRIVATE]
    if local is None:
        assert priv == []
    else:
        assert priv and all((local in k) if local == "norm" else k.startswith(local) for k in priv)
        assert not any(k in sim.keys_by_role["global"] for k in priv)
    sim.step()
    cid = sim.num_clients
    before = {k: v.clone() for k, v in sim.server_state[MODEL].items()}
    model = sim.algorithm.personalize_new_client(cid, sim.server_state, sim.train_data(cid), 1)
    state = model.state_dict()
    assert all(torch.equal(state[k].cpu(), before[k]) for k in before)  # globals frozen in every variant
    changed = [k for k in priv if not torch.equal(state[k].cpu(), sim.initial_private[k])]
    assert bool(changed) == adapts


def test_run_results_and_budget_benchmark(pce_sim):
    """A one-round run reports exact bytes (each of the 4 clients receives and sends the shared weights once, nothing
    else travels) and, as the new client's accuracy, that of the new-client protocol's model (the global weights with
    the client's own embedding adapted) on its test split; a budget keeps exactly min(k, available) training images
    per class of a new client, the budget-1 images among the budget-2 ones."""
    from hfpfl.data.benchmarks import with_new_client_budget
    sim = pce_sim("fedpce")
    sim.args = sim.args.__class__(**{**sim.args.__dict__, "num_rounds": 1})
    res = sim.run()
    shared = sum(p.numel() * p.element_size() for n, p in sim.model.named_parameters() if n != EMBEDDING_KEY)
    assert res["communication"]["by_part"] == {"model": {"bytes_down": 4 * shared, "bytes_up": 4 * shared}}
    cid = sim.num_clients
    model = sim.algorithm.personalize_new_client(cid, sim.server_state, sim.train_data(cid), 1)
    assert res["new_client_accuracy"] == {str(cid): sim.ctx.evaluate(model, sim.test_data(cid))["accuracy"]}
    labels = np.asarray(sim.data.new_clients[0].train.with_format(None)["labels"])
    available = np.bincount(labels, minlength=10)
    rows = {}
    for k in (1, 2):
        c = with_new_client_budget(sim.data, k, seed=0).new_clients[0]
        counts = np.bincount(np.asarray(c.train.with_format(None)["labels"]), minlength=10)
        assert counts.tolist() == np.minimum(available, k).tolist() and len(c.test) == len(sim.data.new_clients[0].test)
        rows[k] = {np.asarray(x).tobytes() for x in c.train.with_format(None)["pixel_values"]}
    assert rows[1] <= rows[2]


def test_resume_after_interruption_equals_straight_run(pce_sim, run_sim):
    """3 rounds straight == 2 rounds, a fresh process-like Simulation resuming the round-2 checkpoint, round 3: the
    per-client Adam moments, embeddings and the cosine schedule continue exactly (results compared whole)."""
    cfg = get_algorithm("fedpce").Config(**TINY)
    kw = dict(method_config=cfg, optimizer="adam", lr=1e-3, weight_decay=1e-4, local_steps=2, num_rounds=3,
              checkpoint_every=1, eval_every=3)
    straight_sim, straight = run_sim("fedpce", output_dir="straight", **kw)
    cut, _ = run_sim("fedpce", output_dir="cut", run=False, **kw)
    cut.step(), cut.step()                                 # "killed" after round 2 (its checkpoint is on disk)
    again, resumed = run_sim("fedpce", output_dir="cut", resume_from_checkpoint="latest", overwrite_output_dir=False,
                             **kw)
    for key in ("final", "per_client_accuracy", "new_client_accuracy", "communication"):
        assert resumed[key] == straight[key], key
    # the PCA map reads, for every client, exactly the embedding the straight run ended with (its stored private v)
    emb, ref = again.algorithm.embeddings(), straight_sim.algorithm.embeddings()
    assert sorted(emb) == list(range(again.num_clients)) == sorted(ref)
    for c in emb:
        assert torch.equal(emb[c], ref[c]) and torch.equal(emb[c], straight_sim.store.get(c)[MODEL][EMBEDDING_KEY])


def test_paper_degradation_levels():
    """The paper's per-client settings (section 4.2): noise variances linspace(0.005, 1, M) added unclamped on the
    [0, 1] scale (2 sigma on [-1, 1] inputs), jitter factors linspace-spaced and permuted, identity at (1, 1, 1, 0)."""
    from datasets import Array3D, Dataset, Features, Image as HFImage
    from PIL import Image

    from hfpfl.data.benchmarks import degradation_settings
    from hfpfl.data.transforms import add_input_noise, color_jitter_fixed
    noise = degradation_settings("noise", 5)
    assert [round(s["variance"], 5) for s in noise] == [0.005, 0.25375, 0.5025, 0.75125, 1.0]
    assert noise[-1]["std"] == 1.0
    col = degradation_settings("color", 5, seed=3)
    for j in range(3):
        assert sorted(f["factors"][j] for f in col) == [0.5, 0.75, 1.0, 1.25, 1.5]
    assert sorted(f["factors"][3] for f in col) == [-0.5, -0.25, 0.0, 0.25, 0.5]
    assert degradation_settings("rotation", 6, "paper") == degradation_settings("rotation", 6, "cycled")
    x = np.zeros((64, 3, 8, 8), np.float32)
    ds = Dataset.from_dict({"pixel_values": x}, features=Features({"pixel_values": Array3D((3, 8, 8), "float32")}))
    out = np.asarray(add_input_noise(ds, 0.5, seed=1)[:]["pixel_values"])
    assert abs(out.std() - 1.0) < 0.03 and out.max() > 1.5           # 2 * 0.5 on [-1, 1]; not clamped
    # exact: the same draw z per seed, added as 2 * std * z (std 0.25 -> half of std 0.5's noise, bit for bit) on
    # top of the input, unclamped (inputs of 1 come out as 1 + the same noise)
    quarter = np.asarray(add_input_noise(ds, 0.25, seed=1)[:]["pixel_values"])
    assert np.array_equal(out, 2 * quarter)
    ones = Dataset.from_dict({"pixel_values": x + 1}, features=ds.features)
    np.testing.assert_allclose(np.asarray(add_input_noise(ones, 0.5, seed=1)[:]["pixel_values"]), 1 + out,
                               rtol=0, atol=1e-6)
    assert np.array_equal(out, np.asarray(add_input_noise(ds, 0.5, seed=1)[:]["pixel_values"]))
    img = Image.fromarray((np.arange(48, dtype=np.uint8).reshape(4, 4, 3) * 5))
    pil = Dataset.from_dict({"image": [img, img]}, features=Features({"image": HFImage()}))
    same = color_jitter_fixed(pil, (1.0, 1.0, 1.0, 0.0), seed=0)[0]["image"]
    assert np.abs(np.asarray(same, np.int16) - np.asarray(img, np.int16)).max() <= 2   # HSV round trip only
    dark = color_jitter_fixed(pil, (0.5, 1.0, 1.0, 0.0), seed=0)[0]["image"]
    assert abs(np.asarray(dark).mean() - 0.5 * np.asarray(img).mean()) < 2
