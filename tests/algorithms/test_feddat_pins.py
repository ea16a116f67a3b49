"""FedDAT and its PEFT baselines pinned by hand (FedDAT paper = dissertation ch. 3, Sec. "Dual-Adapter Teacher" and
"Mutual Knowledge Distillation", Alg. 1, Table 4; App. B.2): the gradients of both client losses, the KD weight
schedules, the client update's metrics, the optimizer and its per-round schedule, the key roles of each method,
the server weights, the Table 4 inference rows recounted, and the saved shared adapter."""
import math

import pytest
import torch
from torch.nn import functional as F
import test_feddat
from test_feddat import _client_losses, _hand_kd, _logits_seeded, batch_of

from hfpfl.algorithms import MODEL
from hfpfl.algorithms.feddat import FedDATConfig, VQAPeft, VQAPeftConfig, steps_per_epoch, warmup_linear
from hfpfl.federated.context import HParams

sim_for, vqa_fed = test_feddat.sim_for, test_feddat.vqa_fed   # the FedDAT tests' fixtures


# ------------------------------------------------------------------------------------------------ the two losses
@pytest.mark.parametrize("head_loss", ["shared", "both"])
def test_client_loss_gradients_are_those_of_the_hand_loss(sim_for, vqa_fed, head_loss):
    """The gradients FedDAT's two losses give every trainable tensor equal those of the hand-written losses
    (constant schedule: L^s = 1/2 (CE(z_s, y) + T^2 KL(p_DAT || p_s)) with the DAT teacher detached;
    L^DAT = 1/2 (CE(z_DAT, y) + T^2 KL(p_s || p_DAT)) with z_s from step 1 detached), T = 3, differentiated by
    autograd through the same forward passes: A_s + head get exactly L^s's gradient, A_c exactly L^DAT's, A_c
    nothing from L^s, A_s nothing from L^DAT; the head nothing from L^DAT (``--head_loss shared``: Alg. 1 trains
    DAT = Â_s + A_c with L^DAT) or exactly L^DAT's gradient (``both``, the authors' code)."""
    sim = sim_for("feddat", kd_schedule="constant", head_loss=head_loss)
    m, seen = _client_losses(sim)
    loss_s, loss_dat = seen["fns"]
    named = dict(m.named_parameters())
    trainable = [k for k, p in named.items() if p.requires_grad]
    shared = [k for k in trainable if ".shared." in k]
    local = [k for k in trainable if ".local." in k]
    head = [k for k in trainable if k.startswith("backbone.classifier.")]
    b = {k: v.to(sim.device) for k, v in batch_of(vqa_fed, 1).items()}
    x, y = {k: v for k, v in b.items() if k != "answer"}, b["answer"]

    def grads(loss):
        g = torch.autograd.grad(loss, [named[k] for k in trainable], allow_unused=True)
        return {k: (torch.zeros_like(named[k]) if v is None else v) for k, v in zip(trainable, g)}

    torch.manual_seed(21)
    with torch.no_grad():
        m.mode = "dat"
        z_dat = m(**x).logits
    m.mode = "shared"
    z_s = m(**x).logits
    p_t = torch.softmax(z_dat / 3, -1)
    hand_s = 0.5 * (F.cross_entropy(z_s, y) + 9 * (torch.xlogy(p_t, p_t) - p_t * torch.log_softmax(z_s / 3, -1)).sum(-1).mean())
    want_s = grads(hand_s)
    torch.manual_seed(21)
    got_s = grads(loss_s(m, b))
    torch.manual_seed(22)
    m.mode = "dat"
    z_dat2 = m(**x).logits
    m.mode = "shared"
    p_s = torch.softmax(z_s.detach() / 3, -1)
    hand_dat = 0.5 * (F.cross_entropy(z_dat2, y)
                      + 9 * (torch.xlogy(p_s, p_s) - p_s * torch.log_softmax(z_dat2 / 3, -1)).sum(-1).mean())
    want_dat = grads(hand_dat)
    if head_loss == "shared":
        want_dat.update({k: torch.zeros_like(named[k]) for k in head})
    torch.manual_seed(22)
    got_dat = grads(loss_dat(m, b))
    assert head and all(named[k].requires_grad for k in head)          # the head trains again at the next L^s
    dat_on, dat_off = (local, shared + head) if head_loss == "shared" else (local + head, shared)
    for got, want, on, off in ((got_s, want_s, shared + head, local), (got_dat, want_dat, dat_on, dat_off)):
        for k in trainable:
            assert torch.allclose(got[k], want[k], atol=1e-7, rtol=1e-5), k
        assert all(float(got[k].abs().sum()) == 0.0 for k in off)
        assert all(float(got[k].abs().sum()) > 0 for k in on)


@pytest.mark.parametrize("schedule", ["round", "ramp", "constant"])
def test_kd_weight_schedules(sim_for, schedule):
    """App. B.2: alpha = beta = exp(-5 (1 - t / T0)); ``ramp``: t = (r - 1) x steps + step over T0 = R x steps;
    ``round``: t = step over T0 = steps (restarted every round); ``constant``: 1. Client 1: 16 questions at batch 8
    = 2 steps per round, R = 3."""
    sim = sim_for("feddat", rounds=3, kd_schedule=schedule)
    sim.setup()
    algo = sim.algorithm
    assert algo.round_steps(1) == (2, 2)
    want = {"round": {(1, 0): math.exp(-5), (2, 1): math.exp(-2.5), (3, 1): math.exp(-2.5)},
            "ramp": {(1, 0): math.exp(-5), (2, 1): math.exp(-5 * (1 - 3 / 6)), (3, 1): math.exp(-5 * (1 - 5 / 6))},
            "constant": {(1, 0): 1.0, (2, 1): 1.0, (3, 1): 1.0}}[schedule]
    for (r, step), w in want.items():
        assert algo.kd_weight(1, r, step) == pytest.approx(w, rel=1e-12)


def test_client_update_reports_the_mean_kd_terms_and_the_last_weight(sim_for, vqa_fed):
    """Two local steps driven through FedDAT's losses: kd_s / kd_dat are the means over the steps of
    T^2 KL(p_DAT || p_s) and T^2 KL(p_s || p_DAT) (recomputed here from the logits), kd_weight is alpha of the
    last step (ramp, round 1 of 2, steps 0 and 1 of 2: t = 1 of T0 = 4); the update uploads A_s only and keeps
    A_c + head; the model is left on the inference path (A_s)."""
    sim = sim_for("feddat", rounds=2)
    sim.setup()
    algo, m = sim.algorithm, sim.model
    b = {k: v.to(sim.device) for k, v in batch_of(vqa_fed, 1).items()}
    x = {k: v for k, v in b.items() if k != "answer"}
    hand = {"kd_s": [], "kd_dat": []}

    def two_steps(client_id, r, param_sets, loss_fns):
        loss_s, loss_dat = loss_fns
        for i in range(2):
            z_dat, z_s = _logits_seeded(m, x, ["dat", "shared"], seed=30 + i)
            (z_dat2,) = _logits_seeded(m, x, ["dat"], seed=40 + i)
            hand["kd_s"].append(float(_hand_kd(z_s, z_dat)))
            hand["kd_dat"].append(float(_hand_kd(z_dat2, z_s)))
            torch.manual_seed(30 + i)
            loss_s(m, b)
            torch.manual_seed(40 + i)
            loss_dat(m, b)
        return {"steps": 2, "train_loss": 0.0}

    algo.run_local = two_steps
    g = torch.Generator().manual_seed(5)         # adapters and head of known weights, as in _client_losses
    with torch.no_grad():
        for slot in m.adapters:
            for lin in (slot.shared.down, slot.shared.up, slot.local.down, slot.local.up):
                lin.weight.copy_(0.5 * torch.randn(lin.weight.shape, generator=g))
                lin.bias.copy_(0.1 * torch.randn(lin.bias.shape, generator=g))
            for lin in (slot.shared.down, slot.local.down):
                lin.bias.add_(1.0)
        for k, p in m.named_parameters():
            if k.startswith("backbone.classifier.") and k.endswith("weight"):
                p.copy_(torch.randn(p.shape, generator=g))
    down = {MODEL: {k: sim.model_state[k].clone() for k in algo.global_keys}}
    private = {MODEL: {k: sim.model_state[k].clone() for k in algo.private_keys}}
    upd = algo.client_update(1, down, private, 1)
    assert upd.metrics["kd_s"] == pytest.approx(sum(hand["kd_s"]) / 2, rel=1e-5)
    assert upd.metrics["kd_dat"] == pytest.approx(sum(hand["kd_dat"]) / 2, rel=1e-5)
    assert min(hand["kd_s"] + hand["kd_dat"]) > 1e-2
    assert upd.metrics["kd_weight"] == pytest.approx(math.exp(-5 * (1 - 1 / 4)), rel=1e-12)
    assert set(upd.upload[MODEL]) == set(m.shared_keys())
    assert set(upd.private[MODEL]) == set(m.local_keys()) | set(m.head_keys())
    assert upd.num_samples == 16 and m.mode == "shared"


# ------------------------------------------------------------------------------------------------ optimizer, schedule
def test_optimizer_is_adamw_on_the_trainable_parameters():
    """[D]: AdamW, betas (0.9, 0.98), eps 1e-8, the run's lr and weight decay; frozen tensors are left out."""
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3), requires_grad=False)
    opt = VQAPeft.optimizer([a, b], HParams(lr=0.003, weight_decay=0.02))
    assert isinstance(opt, torch.optim.AdamW)
    g = opt.param_groups
    assert len(g) == 1 and g[0]["params"] == [a]
    assert (g[0]["lr"], g[0]["betas"], g[0]["eps"], g[0]["weight_decay"]) == (0.003, (0.9, 0.98), 1e-8, 0.02)


@pytest.mark.parametrize("total, warmup, factors", [
    (1, 0.1, [1.0]),                              # w = max(1, round(0.1)) = 1: no decay step left
    (2, 0.5, [1.0, 1.0]),                         # w = 1; s = 1: (2 - 1) / max(1, 2 - 1)
    (4, 0.5, [0.5, 1.0, 1.0, 0.5]),               # w = 2; s = 2, 3: (4 - s) / 2
    (3, 1.0, [1 / 3, 2 / 3, 1.0]),                # all warm-up
    (10, 0.0, [1.0] + [(10 - s) / 9 for s in range(1, 10)])])   # w = max(1, 0) = 1
def test_warmup_linear_factors_by_hand(total, warmup, factors):
    """Warm-up (s + 1) / w over w = max(1, round(warmup x total)) steps, then (total - s) / max(1, total - w)."""
    f = warmup_linear(total, warmup)
    assert [f(s) for s in range(total)] == pytest.approx(factors, rel=1e-12)
    assert warmup_linear(10)(1) == pytest.approx(1.0) and warmup_linear(10)(2) == pytest.approx(8 / 9)  # default 0.1


def test_steps_per_round():
    """A small trailing batch joins the previous one: 9 questions at batch 8 = 1 step, 16 = 2, 17 = 2, 24 = 3."""
    assert [steps_per_epoch(n, 8) for n in (9, 16, 17, 24, 8, 3)] == [1, 2, 2, 3, 1, 1]


def test_round_steps_follow_local_steps_or_epochs(sim_for):
    sim = sim_for("feddat")
    sim.setup()
    assert sim.algorithm.round_steps(1) == (2, 2) and sim.algorithm.round_steps(0) == (1, 1)
    sim.args.local_steps = 5
    assert sim.algorithm.round_steps(1) == (5, 2)
    sim.args.local_steps, sim.args.local_epochs = None, 3
    assert sim.algorithm.round_steps(1) == (6, 2)


def test_round_steps_read_the_clients_own_hyperparameters(sim_for):
    """A tuner's per-client hyperparameters (FedPop: ``step(client_hparams=...)``) set that client's steps only."""
    sim = sim_for("feddat")
    sim.setup()
    sim._client_hp_overrides = {1: {"local_steps": 3}}
    assert sim.algorithm.round_steps(1) == (3, 2) and sim.algorithm.round_steps(0) == (1, 1)


@pytest.mark.parametrize("last, steps", [("merge", 1), ("keep", 2), ("drop", 1)])
def test_round_steps_follow_the_runs_last_batch(sim_for, last, steps):
    """Client 0 holds 9 questions at batch 8: ``--last_batch merge`` = one step of 9, ``keep`` = 8 then 1,
    ``drop`` = one step of 8 (the learning-rate schedule spans exactly these steps)."""
    sim = sim_for("feddat", run_kw={"last_batch": last})
    sim.setup()
    assert sim.algorithm.round_steps(0) == (steps, steps)


# ------------------------------------------------------------------------------------------------ config, roles
def test_configs_validate_their_options():
    with pytest.raises(ValueError, match="peft"):
        VQAPeftConfig(peft="nope")
    with pytest.raises(ValueError, match="--peft must be adapter for feddat"):
        FedDATConfig(peft="lora")
    with pytest.raises(ValueError, match="teacher"):
        FedDATConfig(teacher="student")


def _roles(sim):
    return {k: r for r, ks in sim.keys_by_role.items() for k in ks}


@pytest.mark.parametrize("method, cfg", [("feddat", {}), ("vqa_adapter", {}), ("vqa_adapter_local", {}),
                                         ("vqa_peft", {"peft": "lora"}), ("vqa_peft", {"peft": "lora",
                                                                                       "local_only": True})])
def test_key_roles_of_each_method(sim_for, method, cfg):
    """The ViLT head is private in every method; FedDAT: A_s global, A_c private (Alg. 1: only A_s travels);
    Adapter: the adapter global, nothing local; -L variants: the PEFT module private; the frozen backbone frozen."""
    sim = sim_for(method, **cfg)
    roles, m = _roles(sim), sim.model
    local_only = method == "vqa_adapter_local" or cfg.get("local_only", False)
    for k, p in m.named_parameters():
        if k.startswith("backbone.classifier."):
            want = "private"
        elif ".local." in k and k.startswith("adapters."):
            want = "private" if method == "feddat" else "frozen"
        elif p.requires_grad:
            want = "private" if local_only else "global"
        else:
            want = "frozen"
        assert roles[k] == want, k
    assert any(roles[k] == ("private" if local_only else "global") for k in roles
               if ".shared." in k or "lora_" in k)
    if method == "feddat":
        assert all(p.requires_grad for k, p in m.named_parameters() if ".local." in k)


def test_blip_tied_frozen_weights_are_not_client_state(sim_for):
    """BLIP (no head): a frozen tensor tied to a trained one would default to private; it is frozen instead."""
    sim = sim_for("vqa_peft", model="tiny-blip", peft="lora")
    roles = _roles(sim)
    assert not any(k.startswith("backbone.") and r == "private" for k, r in roles.items())


@pytest.mark.parametrize("weighting", ["uniform", "samples"])
def test_server_weights(sim_for, weighting):
    """Alg. 1: 1/K; ``--weighting samples``: N_k (client 0 holds 9 questions, the others 16)."""
    sim = sim_for("feddat", weighting=weighting)
    sim.setup()
    assert sim.algorithm.aggregation_weights([0, 1]) == ({0: 1.0, 1: 1.0} if weighting == "uniform" else
                                                         {0: 9.0, 1: 16.0})


def test_set_mode_uses_adapters_only_when_there_are_adapters(sim_for):
    sim = sim_for("vqa_peft", peft="lora")
    sim.setup()
    sim.algorithm.set_mode("shared")
    assert sim.model.mode == "none"
    sim = sim_for("vqa_adapter")
    sim.setup()
    sim.algorithm.set_mode("dat")
    assert sim.model.mode == "dat"


def test_build_model_passes_the_peft_options(sim_for):
    """--reduction r (bottleneck d / r), --adapter_init zero (W_up = 0), the run's --lora_r."""
    sim = sim_for("vqa_adapter", reduction=8, adapter_init="zero")
    slot = sim.model.adapters[0]
    d = slot.shared.down.in_features
    assert slot.shared.down.out_features == d // 8 and not slot.shared.up.weight.any()
    sim = sim_for("vqa_peft", peft="lora", run_kw={"lora_r": 2})   # not the builder's default rank (4)
    a = [p for k, p in sim.model.named_parameters() if "lora_A" in k]
    assert a and all(p.shape[0] == 2 for p in a)


@pytest.mark.parametrize("head_init", ["random", "pretrained"])
def test_build_model_keeps_the_backbones_head_only_when_asked(sim_for, head_init):
    """ViLT's head: ``--head_init random`` re-draws it (N(0, 0.02) weights, zero biases: Algorithm 1's init_head);
    ``pretrained`` keeps the backbone's own pool head, which the tiny stand-in draws with non-zero biases here."""
    import hfpfl.models.vqa_model as vqa_model

    real_init = vqa_model.VQAModel.__init__

    def init_with_marked_head(self, backbone, *a, **kw):
        for m in backbone.classifier.modules():
            if isinstance(m, torch.nn.Linear):
                torch.nn.init.constant_(m.bias, 0.5)
        real_init(self, backbone, *a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vqa_model.VQAModel, "__init__", init_with_marked_head)
        sim = sim_for("vqa_adapter", head_init=head_init)
    biases = [m.bias for m in sim.model.backbone.classifier.modules() if isinstance(m, torch.nn.Linear)]
    assert biases and all(bool((b == (0.5 if head_init == "pretrained" else 0.0)).all()) for b in biases)


# ------------------------------------------------------------------------------------------------ Table 4, saving
def test_last_round_scores_the_three_inference_paths_recounted(sim_for):
    """Table 4's inference rows at the last round only: per client, Â_s <- the final global A_s, then exact-answer
    accuracy on its test set with A_s, DAT (1/2 Â_s + 1/2 A_c) and A_c alone, averaged over clients (BLIP: no
    random patch order, so the counts are reproducible here)."""
    sim = sim_for("feddat", model="tiny-blip", rounds=2)
    sim.run()
    assert not any(k.startswith("inference_") for k in sim.history[0])
    final = sim.history[-1]
    algo, accs = sim.algorithm, {"shared": [], "dat": [], "local": []}
    for cid in range(5):
        private = sim.store.get(cid)
        sim.ctx.load(private[MODEL])
        model = algo.load_personal(cid, sim.server_state, private, 2).eval()
        for slot in model.adapters:
            for n, p in slot.shared.named_parameters():
                assert torch.equal(getattr(slot, "frozen_" + n.replace(".", "_")), p)
        data = sim.test_data(cid)
        b = {k: v.to(sim.device) for k, v in data.select(torch.arange(len(data))).items()}
        for mode in accs:
            model.mode = mode
            with torch.no_grad():
                pred = model(**{k: v for k, v in b.items() if k != "answer"}).logits.argmax(-1)
            accs[mode].append(int((pred == b["answer"]).sum()) / len(data))
        model.mode = "shared"
    for mode, a in accs.items():
        assert final[f"inference_{mode}"] == pytest.approx(sum(a) / 5, abs=1e-9), mode
    sim = sim_for("feddat", model="tiny-blip", rounds=1, eval_variants=False)
    sim.run()
    assert not any(k.startswith("inference_") for k in sim.history[-1])


def test_the_final_global_shared_adapter_is_saved(sim_for, monkeypatch):
    """At the last round the server's A_s (not a client's) goes to <output_dir>/shared_adapter; a backbone with no
    checkpoint name is skipped (returns None)."""
    import hfpfl.models.vqa_hub as hub
    calls = []
    monkeypatch.setattr(hub, "save_shared_adapter", lambda model, folder, shared_state: calls.append(
        (model, folder, shared_state)) or folder)
    sim = sim_for("feddat", rounds=1, eval_variants=False)
    sim.setup()
    algo = sim.algorithm
    assert algo.save_shared_adapter(sim.server_state) is None and calls == []
    sim.model.backbone.name_or_path = "some/checkpoint"
    sim.run()
    assert len(calls) == 1
    model, folder, state = calls[0]
    assert model is sim.model and folder == str(sim.output_dir / "shared_adapter")
    assert state is sim.server_state[MODEL]


@pytest.mark.parametrize("method", ["vqa_adapter", "vqa_peft"])
def test_baseline_client_update_trains_from_and_keeps_the_clients_head(sim_for, method):
    """The PEFT baselines' client update: A_s <- the download, the head <- this client's private head (it never
    travels), the loss is the model's own CE on the adapter path; the update uploads the global keys and keeps the
    private ones as trained, with the loop's metrics."""
    sim = sim_for(method, **({"peft": "lora"} if method == "vqa_peft" else {}))
    sim.setup()
    algo, m = sim.algorithm, sim.model
    head = m.head_keys()
    assert head and set(head) <= set(algo.private_keys)
    down = {MODEL: {k: torch.full_like(sim.model_state[k], 0.01) for k in algo.global_keys}}
    private = {MODEL: {k: torch.full_like(sim.model_state[k], 0.02) for k in algo.private_keys}}
    seen = {}

    def record(client_id, r, param_sets, loss_fns):
        state = m.state_dict()
        seen["loaded"] = all(torch.equal(state[k], down[MODEL][k]) for k in algo.global_keys) and all(
            torch.equal(state[k], private[MODEL][k]) for k in algo.private_keys)
        seen["mode"] = m.mode
        with torch.no_grad():
            for k in algo.private_keys + algo.global_keys:
                state[k].add_(1.0)                     # "training" moves every trainable tensor by 1
        return {"steps": 1, "train_loss": 0.5}

    algo.run_local = record
    upd = algo.client_update(2, down, private, 1)
    assert seen == {"loaded": True, "mode": "shared" if method == "vqa_adapter" else "none"}
    assert set(upd.upload) == {MODEL} and set(upd.private) == {MODEL}
    assert all(torch.allclose(upd.upload[MODEL][k].cpu(), down[MODEL][k] + 1) for k in algo.global_keys)
    assert all(torch.allclose(upd.private[MODEL][k].cpu(), private[MODEL][k] + 1) for k in algo.private_keys)
    assert upd.metrics == {"steps": 1, "train_loss": 0.5} and upd.num_samples == 16


def test_inference_variants_score_each_clients_own_adapters(sim_for):
    """Table 4's rows evaluate, for each client in turn, its own A_c and head (from its stored private state) with
    Â_s = A_s = the final global A_s, on its own test set, on the paths A_s, DAT, A_c in that order; each row is the
    mean over clients of what the evaluation returned (here a code of client and path)."""
    sim = sim_for("feddat", rounds=1, eval_variants=False)
    sim.run()
    algo, m = sim.algorithm, sim.model
    calls = []

    def fake_evaluate(model, data, metric=None):
        s = model.adapters[0]
        cid = len(calls) // 3
        calls.append({"mode": model.mode, "local": s.local.up.weight.detach().clone(),
                      "shared": s.shared.up.weight.detach().clone(), "frozen": s.frozen_up_weight.clone(),
                      "head": {k: v.clone() for k, v in model.state_dict().items() if k in m.head_keys()},
                      "data": data.select(torch.arange(len(data)))["answer"].clone()})
        return {"accuracy": cid / 10 + {"shared": 0.01, "dat": 0.02, "local": 0.03}[model.mode]}

    algo.ctx.evaluate = fake_evaluate
    rows = algo.inference_variants(sim.server_state)
    assert [c["mode"] for c in calls] == ["shared", "dat", "local"] * 5
    mean_cid = sum(range(5)) / 10 / 5
    assert rows == pytest.approx({"inference_shared": mean_cid + 0.01, "inference_dat": mean_cid + 0.02,
                                  "inference_local": mean_cid + 0.03}, abs=1e-12)
    g = sim.server_state[MODEL]["adapters.0.shared.up.weight"].to(m.adapters[0].shared.up.weight.device)
    for i, c in enumerate(calls):
        cid, private = i // 3, sim.store.get(i // 3)[MODEL]
        assert torch.equal(c["local"].cpu(), private["adapters.0.local.up.weight"].cpu())
        assert torch.equal(c["shared"], g) and torch.equal(c["frozen"], g)
        assert all(torch.equal(v.cpu(), private[k].cpu()) for k, v in c["head"].items()) and c["head"]
        test = sim.test_data(cid)
        assert torch.equal(c["data"], test.select(torch.arange(len(test)))["answer"])
    assert not torch.equal(calls[0]["local"], calls[3]["local"])       # the clients' A_c differ
    assert m.mode == "shared"
    calls.clear()
    algo.ctx.owned = lambda ids: [0]                                   # one client: its own accuracy, not halved
    assert algo.inference_variants(sim.server_state) == pytest.approx(
        {"inference_shared": 0.01, "inference_dat": 0.02, "inference_local": 0.03}, abs=1e-12)
