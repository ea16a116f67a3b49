"""FRAug pinned by hand (dissertation ch. 2, Sec. 3.3.2 "Client Update", Eq. 1-6; App. A.2; Alg. 1): every loss of
one local step recomputed from the modules' weights on a tiny model, for the full method and each ablation, and the
algorithm's plumbing (the stage parameters and optimizer settings, each round's schedules and noise, key roles, the
server weights, what a client update returns, the final-round embedding plot) against values written out here."""
import copy
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from test_fraug import _ce_by_hand, _mlp_by_hand

from hfpfl.algorithms.base import FROZEN, GLOBAL, MODEL, OPTIM, PRIVATE
from hfpfl.algorithms.fraug import FRAugConfig, FRAugStages, plot_embeddings
from hfpfl.models import build_classifier
from hfpfl.models.fraug import FRAugModel

#: batch labels that differ from the class-balanced cyclic labels at every position (g(z, y) != g(z, c) matters)
Y = (torch.arange(20) * 3 + 1) % 10
LAM_SYN, LAM_C = 0.8, 0.3
B_SYN = 12                                        # != the real batch size: z and z' have different lengths


def _setup(**cfg_kw):
    torch.manual_seed(0)
    net = build_classifier("tiny-resnet", num_labels=10, image_size=16, num_channels=3)
    model = FRAugModel(net, d_z=16, rtnet_label_conditioned=cfg_kw.get("rtnet_label_conditioned", False)).train()
    cfg = FRAugConfig(d_z=16, syn_batch_size=B_SYN, **cfg_kw)
    x = torch.randn(20, 3, 16, 16)
    with torch.no_grad():
        model.prototypes.copy_(torch.rand(10, model.d_u))
        model.rtnet.net[-1].weight.fill_(2.0)      # an RTNet residual of order 1 (known output BN affine)
        model.rtnet.net[-1].bias.copy_(torch.linspace(-1, 1, model.d_u))
    st = FRAugStages(model, cfg, lam_syn=LAM_SYN, lam_c=LAM_C, noise=torch.Generator().manual_seed(1))
    return model, st, {"pixel_values": x, "labels": Y.clone()}


def _draws(n):
    """The stage's noise draws in order: (20, 16), (B_SYN, 16), then (20, 16) each ..."""
    g = torch.Generator().manual_seed(1)
    return [torch.randn(k, 16, generator=g) for k in n]


def _mods(ref, label_conditioned=False):
    """g, m^k and h recomputed from their weights (BatchNorm on batch statistics, as both auxiliary nets use)."""
    lin = ref.net.classifier[-1]

    def g(z, labels):
        return _mlp_by_hand(ref.generator.net, torch.cat([z, F.one_hot(labels, 10).float()], 1))

    def m(v, labels):
        inp = torch.cat([v, F.one_hot(labels, 10).float()], 1) if label_conditioned else v
        return _mlp_by_hand(ref.rtnet.net, inp)

    def h(v):
        return v @ lin.weight.T + lin.bias
    return g, m, h


def _entropy_by_hand(logits):
    p = torch.softmax(logits, -1)
    return float(-(p * torch.log(p)).sum(-1).mean())


def _mmd_by_hand(a, b, mul=2.0, num=5):
    """The authors' multi-kernel Gaussian MMD: bandwidth = mean off-diagonal squared distance / mul^(num // 2),
    kernels exp(-d^2 / (bw mul^i)), i < num; mean K_aa + mean K_bb - 2 mean K_ab. Distances written out."""
    t = torch.cat([a, b])
    d2 = ((t[:, None, :] - t[None, :, :]) ** 2).sum(-1)
    n, m = len(a), len(t)
    bw = d2.sum() / (m * m - m) / mul ** (num // 2)
    k = sum(torch.exp(-d2 / (bw * mul ** i)) for i in range(num))
    return float(k[:n, :n].mean() + k[n:, n:].mean() - 2 * k[:n, n:].mean())


# ------------------------------------------------------------------------------------------------ stage 1
@pytest.mark.parametrize("variant", ["full", "g_only", "rtnet_only", "label_conditioned"])
def test_stage1_loss_of_each_ablation_by_hand(variant):
    """Eq. 1-4 (Sec. 3.3.2) and Table 5's ablations, batch labels != the cyclic labels c, B_syn = 12:
    full: u_hat = u + lam_syn m(g(z, y)), u_hat_c = proto_c + lam_syn m(g(z', c));
    G only (--use_rtnet false): u_hat = g(z, y), u_hat_c = proto_c + lam_syn g(z', c);
    RTNet only (--use_generator false): u_hat = u + lam_syn m(u), u_hat_c = proto_c + lam_syn m(proto_c);
    the authors' label-conditioned RTNet: m(concat(v, onehot(label))).
    L_cls = CE(h(u), y) + CE(h(u_hat), y) + CE(h(u_hat_c), c), prototypes first moved by this batch's EMA."""
    kw = {"full": {}, "g_only": {"use_rtnet": False}, "rtnet_only": {"use_generator": False},
          "label_conditioned": {"rtnet_label_conditioned": True}}[variant]
    model, st, batch = _setup(**kw)
    ref = copy.deepcopy(model)
    g, m, h = _mods(ref, variant == "label_conditioned")
    x, y = batch["pixel_values"], batch["labels"]
    with torch.no_grad():
        u = ref.embed(x)
        proto = ref.prototypes.clone()
        for k in range(10):
            proto[k] = 0.7 * proto[k] + 0.3 * u[y == k].mean(0)
        z, z2 = _draws([20, B_SYN])
        c = torch.arange(B_SYN) % 10
        if variant == "g_only":
            u_hat, uc_hat = g(z, y), proto[c] + LAM_SYN * g(z2, c)
        elif variant == "rtnet_only":
            u_hat, uc_hat = u + LAM_SYN * m(u, y), proto[c] + LAM_SYN * m(proto[c], c)
        else:
            u_hat, uc_hat = u + LAM_SYN * m(g(z, y), y), proto[c] + LAM_SYN * m(g(z2, c), c)
        real, syn = _ce_by_hand(h(u), y), _ce_by_hand(h(u_hat), y) + _ce_by_hand(h(uc_hat), c)
    loss = st.loss_cls(model, batch).detach()
    assert float(loss) == pytest.approx(real + syn, rel=1e-5)
    assert st.log["loss_real"] == [pytest.approx(real, rel=1e-5)]
    assert st.log["loss_syn"] == [pytest.approx(syn, rel=1e-5)]
    assert st.log["loss_cls"] == [pytest.approx(real + syn, rel=1e-5)]
    assert torch.allclose(model.prototypes, proto, atol=1e-6)
    assert set(st.step) == {"z", "z2", "c"} and torch.equal(st.step["c"], c) and torch.equal(st.step["z2"], z2)


def test_stage1_lambda_syn_and_the_prototype_path_are_visible():
    """The two changes a review made unnoticed: lambda_syn dropped from the residual (u + m(g) instead of
    u + lam_syn m(g)) and the EMA-prototype term of L_syn zeroed. Either moves L_cls by far more than the test's
    tolerance (so the by-hand equality above fails), computed here on the same tiny model."""
    model, st, batch = _setup()
    g, m, h = _mods(copy.deepcopy(model))
    x, y = batch["pixel_values"], batch["labels"]
    with torch.no_grad():
        u = model.embed(x)
        z, z2 = _draws([20, B_SYN])
        c = torch.arange(B_SYN) % 10
        proto = model.prototypes.clone()
        for k in range(10):
            proto[k] = 0.7 * proto[k] + 0.3 * u[y == k].mean(0)
        with_lam = _ce_by_hand(h(u + LAM_SYN * m(g(z, y), y)), y)
        without_lam = _ce_by_hand(h(u + m(g(z, y), y)), y)
        proto_term = _ce_by_hand(h(proto[c] + LAM_SYN * m(g(z2, c), c)), c)
    loss = float(st.loss_cls(model, batch))
    assert abs(with_lam - without_lam) > 1e-2 * loss
    assert proto_term > 1e-2 * loss


# ------------------------------------------------------------------------------------------------ stage 2
@pytest.mark.parametrize("balanced", [False, True])
def test_generator_loss_by_hand(balanced):
    """Eq. 5: L_gen = CE(h(v_hat), y) - alpha MMD(v_hat, u), v_hat = g(z, y) on the step's third noise draw,
    u = f(X) with BatchNorm in eval mode (no graph), alpha = 2; ``--balanced_gen_labels`` (the authors' code) uses
    the cyclic labels for both g and CE. The classifier stays in train mode afterwards."""
    model, st, batch = _setup(mmd_alpha=2.0, balanced_gen_labels=balanced)
    x, y = batch["pixel_values"], batch["labels"]
    st.loss_cls(model, batch)                      # draws z, z' and updates the BN statistics
    ref = copy.deepcopy(model).eval()
    g, _, h = _mods(ref)
    with torch.no_grad():
        u_ref = ref.embed(x)
        z3 = _draws([20, B_SYN, 20])[2]
        y_g = torch.arange(20) % 10 if balanced else y
        v_hat = g(z3, y_g)
        expected = _ce_by_hand(h(v_hat), y_g) - 2.0 * _mmd_by_hand(v_hat, u_ref)
    loss = st.loss_gen(model, batch)
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    assert st.log["loss_gen"] == [pytest.approx(expected, rel=1e-5)]
    assert model.net.training and torch.allclose(st.step["u_ref"], u_ref, atol=1e-6)
    assert abs(2.0 * _mmd_by_hand(v_hat, u_ref)) > 1e-3 * abs(expected)   # the MMD term is visible


@pytest.mark.parametrize("variant", ["full", "no_ema", "rtnet_only", "label_conditioned"])
def test_rtnet_loss_by_hand(variant):
    """Eq. 6: L_rt = -H(h(u_hat)) - H(h(u_hat_c)) + beta (MMD(u_hat, u) + MMD(u_hat_c, proto_c)), u = f(X) in eval
    mode, u_hat = u + lam_syn m(g(z, y)), u_hat_c = proto_c + lam_syn m(g(z', c)) on the step's z, z' and the
    prototypes after this step's EMA; beta = 2.5. ``--use_ema false`` drops both u_hat_c terms; without the generator
    m sees u and proto_c; the label-conditioned RTNet sees concat(v, onehot). The step is over afterwards."""
    kw = {"full": {}, "no_ema": {"use_ema": False}, "rtnet_only": {"use_generator": False},
          "label_conditioned": {"rtnet_label_conditioned": True}}[variant]
    model, st, batch = _setup(mmd_beta=2.5, **kw)
    x, y = batch["pixel_values"], batch["labels"]
    st.loss_cls(model, batch)
    ref = copy.deepcopy(model).eval()
    g, m, h = _mods(ref, variant == "label_conditioned")
    with torch.no_grad():
        u = ref.embed(x)
        z, z2 = _draws([20, B_SYN])
        c = torch.arange(B_SYN) % 10
        proto = ref.prototypes[c]
        v1, v2 = (u, proto) if variant == "rtnet_only" else (g(z, y), g(z2, c))
        u_hat, uc_hat = u + LAM_SYN * m(v1, y), proto + LAM_SYN * m(v2, c)
        first = -_entropy_by_hand(h(u_hat)) + 2.5 * _mmd_by_hand(u_hat, u)
        second = -_entropy_by_hand(h(uc_hat)) + 2.5 * _mmd_by_hand(uc_hat, proto)
        expected = first + (second if variant != "no_ema" else 0.0)
    loss = st.loss_rt(model, batch)
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    assert st.log["loss_rt"] == [pytest.approx(expected, rel=1e-5)]
    assert st.step == {}
    assert abs(second) > 1e-2 * abs(first) and 2.5 * _mmd_by_hand(u_hat, u) > 1e-3 * abs(first)


def test_head_fixed_is_h_with_detached_weights():
    model, st, _ = _setup()
    u = torch.randn(5, model.d_u, requires_grad=True)
    lin = model.net.classifier[-1]
    out = st.head_fixed(u)
    assert torch.allclose(out, u @ lin.weight.T + lin.bias, atol=1e-6)
    out.sum().backward()
    assert lin.weight.grad is None and lin.bias.grad is None and u.grad is not None


def test_real_reference_is_cached_and_restores_the_mode():
    """u_ref is computed once per step (stage 2a and 2b share it) in eval mode; the classifier's mode is restored
    whatever it was."""
    model, st, batch = _setup()
    model.net.eval()
    u_ref = st.real_reference(batch["pixel_values"])
    assert not model.net.training
    assert st.real_reference(torch.zeros_like(batch["pixel_values"])) is u_ref
    model.net.train()
    st.step = {}
    st.real_reference(batch["pixel_values"])
    assert model.net.training


@pytest.mark.parametrize("gen, rt", [(True, True), (True, False), (False, True)])
def test_stages_optimizers_and_order(gen, rt):
    """One local step = classifier, then generator (eta_g, aux momentum), then RTNet (eta_m, aux momentum); an
    ablation drops its module's stage. The classifier's group holds exactly the trainable classifier parameters."""
    model, st, _ = _setup(use_generator=gen, use_rtnet=rt, gen_lr=0.003, rtnet_lr=0.007, aux_momentum=0.2)
    params, fns = st.stages()
    want = [("cls", [p for p in model.net.parameters() if p.requires_grad], None, None)]
    if gen:
        want.append(("gen", list(model.generator.parameters()), 0.003, 0.2))
    if rt:
        want.append(("rt", list(model.rtnet.parameters()), 0.007, 0.2))
    assert [f.__name__ for f in fns] == ["loss_" + w[0] for w in want]
    assert len(params) == len(want)
    for groups, (_, ps, lr, mom) in zip(params, want):
        assert len(groups) == 1 and [id(p) for p in groups[0]["params"]] == [id(p) for p in ps]
        assert groups[0].get("lr") == lr and groups[0].get("momentum") == mom


def test_config_rejects_no_generator_and_no_rtnet():
    with pytest.raises(ValueError, match="--use_generator and --use_rtnet cannot both be false"):
        FRAugConfig(use_generator=False, use_rtnet=False)
    FRAugConfig(use_generator=False)
    FRAugConfig(use_rtnet=False)


# ------------------------------------------------------------------------------------------------ the algorithm
def _roles(sim):
    return {k: r for r, ks in sim.keys_by_role.items() for k in ks}


@pytest.mark.parametrize("off", [None, "use_ema", "use_rtnet", "use_generator"])
def test_key_roles(run_sim, off):
    """What travels (Sec. 3.3.1 + FedBN): the classifier without its BatchNorms and the generator are global; the
    classifier's BatchNorms (affine and statistics), the RTNet and the prototypes are private; an ablated module is
    frozen (neither trains nor travels)."""
    cfg = FRAugConfig(d_z=16, plot_embeddings=False, **({off: False} if off else {}))
    sim, _ = run_sim("fraug", run=False, method_config=cfg)
    roles, net = _roles(sim), sim.model.net
    bn = tuple(f"net.{k}." for k, mod in net.named_modules() if isinstance(mod, nn.modules.batchnorm._BatchNorm))
    assert bn
    for k in sim.model.state_dict():
        if k == "prototypes":
            want = FROZEN if off == "use_ema" else PRIVATE
        elif k.startswith("rtnet."):
            want = FROZEN if off == "use_rtnet" else PRIVATE
        elif k.startswith("generator."):
            want = FROZEN if off == "use_generator" else GLOBAL
        elif k.startswith(bn):
            want = PRIVATE
        else:
            want = GLOBAL
        assert roles.get(k) == want, k
    assert set(sim.algorithm.new_client_keys()) == {k for k in sim.model.state_dict() if k.startswith("net.")}


def test_build_model_passes_the_config_and_refuses_adapters(run_sim):
    sim, _ = run_sim("fraug", run=False, method_config=FRAugConfig(d_z=8, rtnet_label_conditioned=True))
    assert sim.model.generator.d_z == 8 and sim.model.rtnet.label_conditioned
    assert sim.model.rtnet.net[0].in_features == sim.model.d_u + 10 and sim.model.rtnet.net[0].out_features == 8
    with pytest.raises(ValueError, match="fraug trains the whole classifier: use --adapter none"):
        run_sim("fraug", run=False, adapter="lora", method_config=FRAugConfig(d_z=8))


@pytest.mark.parametrize("uniform", [True, False])
def test_server_weights(run_sim, uniform):
    """Alg. 1 lines 5-6: the unweighted 1/K mean; ``--uniform_aggregation false``: weights N_k (the code)."""
    sim, _ = run_sim("fraug", run=False, method_config=FRAugConfig(d_z=16, uniform_aggregation=uniform))
    w = sim.algorithm.aggregation_weights([0, 2])
    assert w == ({0: 1.0, 2: 1.0} if uniform else {c: float(len(sim.train_data(c))) for c in (0, 2)})
    assert uniform or w[0] != 1.0


def test_stages_for_uses_the_rounds_schedules_and_noise(run_sim):
    """App. A.2 with non-default settings: R = --schedule_rounds 10 (not --num_rounds), gamma = 0.05, lambda_0 = 0.4,
    r_0 = 0.5 R = 5; round 2: lambda_syn = e^{0.05 (2 - 10)}, lambda_c = 0.4 e^{-5 (1 - 2/5)}; the noise is the
    engine's generator for (round, client, "fraug-noise")."""
    cfg = FRAugConfig(d_z=16, schedule_rounds=10, syn_gamma=0.05, lambda_0=0.4, ramp_fraction=0.5)
    sim, _ = run_sim("fraug", run=False, num_rounds=3, method_config=cfg)
    algo = sim.algorithm
    assert algo.rounds() == 10
    st = algo.stages_for(1, 2)
    assert st.lam_syn == pytest.approx(math.exp(0.05 * (2 - 10)), rel=1e-12)
    assert st.lam_c == pytest.approx(0.4 * math.exp(-5 * (1 - 2 / 5)), rel=1e-12)
    assert st.m is sim.model and st.cfg is cfg
    assert torch.equal(torch.randn(4, generator=st.noise), torch.randn(4, generator=sim.generator(2, 1, "fraug-noise")))
    assert algo.stages_for(1, 6).lam_c == pytest.approx(0.4)
    sim, _ = run_sim("fraug", run=False, num_rounds=3, method_config=FRAugConfig(d_z=16))
    assert sim.algorithm.rounds() == 3


@pytest.mark.parametrize("keep", [True, False])
def test_client_update_returns_the_stages_means_and_state(run_sim, keep):
    """A client update of 2 local steps: each loss metric is the mean of the stage's two logged values, train_loss is
    the classifier's L_cls, the round's lambda_syn / lambda_c are reported; the upload is the global keys' trained
    values, the private part the private keys' values plus, with ``--keep_optimizer_state``, the three optimizers'
    state -- which the next round starts from (momentum carries over: its uploads differ from a fresh start)."""
    cfg = FRAugConfig(d_z=16, plot_embeddings=False, keep_optimizer_state=keep)
    sim, _ = run_sim("fraug", run=False, local_steps=2, momentum=0.5, lr=0.05, num_rounds=4, method_config=cfg)
    sim.setup()
    algo, seen = sim.algorithm, []
    orig = algo.stages_for

    def spy(cid, r):
        seen.append(orig(cid, r))
        return seen[-1]
    algo.stages_for = spy
    down = {MODEL: {k: sim.server_state[MODEL][k].clone() for k in algo.global_keys}}
    sim.ctx.load(sim.initial_private)
    upd = algo.client_update(1, down, None, 2)
    st = seen[-1]
    for k in ("loss_real", "loss_syn", "loss_cls", "loss_gen", "loss_rt"):
        assert len(st.log[k]) == 2 and upd.metrics[k] == pytest.approx(sum(st.log[k]) / 2, rel=1e-12)
    assert upd.metrics["train_loss"] == upd.metrics["loss_cls"]
    assert upd.metrics["lambda_syn"] == pytest.approx(math.exp(0.01 * (2 - 4)))
    assert upd.metrics["lambda_c"] == pytest.approx(0.3)
    assert "optimizer_state" not in upd.metrics
    assert set(upd.upload) == {MODEL} and set(upd.upload[MODEL]) == set(algo.global_keys)
    state = sim.model.state_dict()
    assert all(torch.equal(upd.upload[MODEL][k].cpu(), state[k].cpu()) for k in algo.global_keys)
    assert set(upd.private) == ({MODEL, OPTIM} if keep else {MODEL})
    assert set(upd.private[MODEL]) == set(algo.private_keys)
    assert upd.num_samples == len(sim.train_data(1))
    if not keep:
        return
    assert upd.private[OPTIM]
    nxt = {}
    for name, private in (("kept", upd.private), ("fresh", {MODEL: upd.private[MODEL]})):
        sim.ctx.load(upd.private[MODEL])
        sim.ctx.load(down[MODEL])
        nxt[name] = algo.client_update(1, down, private, 3).upload[MODEL]
    assert any(not torch.equal(nxt["kept"][k], nxt["fresh"][k]) for k in nxt["kept"])


# ------------------------------------------------------------------------------------------------ embedding plot
def _pca_abs(real, pts):
    """|2-D PCA coordinates| of pts (principal axes of the centred real set, from its covariance; sign-free)."""
    mean = real.mean(0)
    w, v = np.linalg.eigh(np.cov((real - mean).T))
    axes = v[:, np.argsort(w)[::-1][:2]]
    return np.abs((pts - mean) @ axes)


def test_plot_embeddings_draws_each_clients_pca(tmp_path, monkeypatch):
    """One panel per client (4 columns at most), a 2-D PCA fitted on the client's real embeddings applied to real u,
    u_hat and (when present) v_hat, coloured by label; panels without a client are blank; the file is written (its
    folder created)."""
    import matplotlib.pyplot as plt
    figs = []
    monkeypatch.setattr(plt, "close", lambda fig: figs.append(fig))
    rng = np.random.default_rng(0)

    def client(v_hat):
        s = {"real": rng.normal(size=(30, 6)) * np.array([5, 3, 1, 1, 0.5, 0.2]), "labels": np.arange(30) % 10,
             "u_hat": rng.normal(size=(30, 6))}
        if v_hat:
            s["v_hat"] = rng.normal(size=(30, 6)) + 2
        return s
    sets = [(0, client(True)), (1, client(False)), (2, client(True)), (3, client(True)), (4, client(True))]
    path = tmp_path / "new" / "dir" / "emb.png"           # folders created, parents included
    plot_embeddings(sets, {0: "mnist", 1: "svhn", 3: "usps"}, path)
    assert path.stat().st_size > 0 and len(figs) == 1
    axes = figs[0].axes
    assert len(axes) == 8                                       # 5 clients: 2 rows x 4 columns
    assert [ax.get_title() for ax in axes[:5]] == ["client 0 (mnist)", "client 1 (svhn)", "client 2 ()",
                                                   "client 3 (usps)", "client 4 ()"]
    assert all(ax.axison for ax in axes[:5]) and not any(ax.axison for ax in axes[5:])
    for ax, (_, s) in zip(axes, sets):
        keys = [k for k in ("real", "u_hat", "v_hat") if k in s]
        assert len(ax.collections) == len(keys)
        for col, k in zip(ax.collections, keys):
            assert np.allclose(np.abs(col.get_offsets()), _pca_abs(s["real"], s[k]), atol=1e-6)
            assert np.array_equal(col.get_array(), s["labels"])
        assert list(ax.get_xticks()) == [] and list(ax.get_yticks()) == []
    assert [t.get_text() for t in axes[0].get_legend().get_texts()] == ["real u", "u_hat (client-specific)",
                                                                        "v_hat (generator)"]
    assert figs[0]._suptitle.get_text().startswith("FRAug: real vs generated embeddings")


def test_final_round_plots_every_clients_embeddings(run_sim, monkeypatch):
    """At the last round only (and only with --plot_embeddings), each client's real embeddings f(X) under its own
    personal model (its local BatchNorms), sorted by client, with the client's domain name, to
    <output_dir>/fraug_embeddings.png. f(X) is recomputed here from the stored private state."""
    import hfpfl.algorithms.fraug as fraug_mod
    calls = []
    monkeypatch.setattr(fraug_mod, "plot_embeddings", lambda sets, names, path: calls.append((sets, names, path)))
    sim, _ = run_sim("fraug", num_rounds=2, local_steps=1, method_config=FRAugConfig(d_z=16))
    assert len(calls) == 1
    sets, names, path = calls[0]
    assert [cid for cid, _ in sets] == list(range(sim.num_clients))
    assert names == {cid: str(sim.client(cid).domain) for cid in range(sim.num_clients)}
    assert path == sim.output_dir / "fraug_embeddings.png"
    algo = sim.algorithm

    def real_embeddings(cid, private_of):
        private = sim.store.get(private_of)
        sim.ctx.load(private[MODEL])
        model = algo.load_personal(cid, sim.server_state, private, 2).eval()
        data = sim.train_data(cid)
        x = data.select(torch.arange(min(200, len(data))))["pixel_values"]
        with torch.no_grad():
            out = model.net.resnet(x).pooler_output.flatten(1).numpy()
        model.train()
        return out

    for cid, s in sets:
        assert np.allclose(s["real"], real_embeddings(cid, cid), atol=1e-5)
        assert len(s["labels"]) == min(200, len(sim.train_data(cid)))
        assert set(s) == {"real", "labels", "v_hat", "u_hat"}
    assert not np.allclose(sets[1][1]["real"], real_embeddings(1, 2), atol=1e-3)   # the clients' BatchNorms differ
    calls.clear()
    run_sim("fraug", num_rounds=1, local_steps=1, output_dir="off", method_config=FRAugConfig(d_z=16,
                                                                                            plot_embeddings=False))
    assert calls == []


@pytest.mark.parametrize("k, grid", [(1, (1, 1)), (4, (1, 4)), (5, (2, 4))])
def test_plot_embeddings_grid(tmp_path, monkeypatch, k, grid):
    """ceil(K / 4) rows of min(4, K) panels: one client is one panel (no squeezed axes), four fill one row."""
    import matplotlib.pyplot as plt
    figs = []
    monkeypatch.setattr(plt, "close", lambda fig: figs.append(fig))
    rng = np.random.default_rng(1)
    sets = [(c, {"real": rng.normal(size=(8, 3)), "labels": np.arange(8) % 2, "u_hat": rng.normal(size=(8, 3))})
            for c in range(k)]
    plot_embeddings(sets, {}, tmp_path / "p.png")
    shape = figs[0].axes[0].get_subplotspec().get_gridspec().get_geometry()
    assert shape == grid and len(figs[0].axes) == grid[0] * grid[1]
