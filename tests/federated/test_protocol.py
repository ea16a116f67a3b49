"""The engine's protocol: every hook a method can use, each exercised by a small test plug-in, and the engine's
guarantees (streaming aggregation, private state never leaking, frozen means frozen, whole-state export, resume
checks, non-finite training), checked against hand computations."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers.modeling_outputs import ImageClassifierOutput

from hfpfl.algorithms import register
from hfpfl.algorithms.base import MODEL, OPTIM, PRIVATE, HParams, NonFiniteError, Update
from hfpfl.algorithms.fedavg import FedAvg
from hfpfl.federated.context import dropout_rate
from hfpfl.training import SoftTargetAccuracy, TensorData, evaluate, iterate_batches, train_local

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------------ test plug-ins
@register
class HalfBatchOddClients(FedAvg):
    """Per-client hyperparameters from the method: odd clients train with batch size 8."""

    name = "test_half_batch_odd"

    def client_hparams(self, client_id, round_idx, hp):
        return hp.replace(batch_size=8) if client_id % 2 else hp


@register
class AdamKeepsState(FedAvg):
    """Parameter groups (the head frozen by lr 0) and an Adam state each client keeps across rounds (FedPCE)."""

    name = "test_adam_keeps_state"
    local_update = "own"

    def client_update(self, client_id, down, private, round_idx):
        self.load_client(down, private)
        named = dict(self.model.named_parameters())
        body = [p for n, p in named.items() if not n.startswith("classifier") and p.requires_grad]
        head = [p for n, p in named.items() if n.startswith("classifier")]
        hp = self.ctx.hparams(client_id).replace(optimizer="adam", lr=1e-3)
        m = self.local_train(client_id, round_idx, hp=hp, params=[{"params": body}, {"params": head, "lr": 0.0}],
                             optimizer_state=(private or {}).get(OPTIM, {}))
        return Update(client_id, {MODEL: self.ctx.snapshot(self.global_keys)}, len(self.ctx.train_data(client_id)),
                      {MODEL: self.ctx.snapshot(self.private_keys), OPTIM: m.pop("optimizer_state")}, m)


@register
class OneStepBySchedule(FedAvg):
    """``ctx.train(optimizer=, schedule=)``: plain SGD at 3x the run's lr, its schedule zeroing the lr after step one."""

    name = "test_one_step_by_schedule"
    local_update = "own"

    def client_update(self, client_id, down, private, round_idx):
        self.load_client(down, private)
        m = self.ctx.train(client_id, round_idx, optimizer=lambda ps, hp: torch.optim.SGD(ps, lr=3 * hp.lr),
                           schedule=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: float(s == 0)))
        return Update(client_id, {MODEL: self.ctx.snapshot(self.global_keys)}, len(self.ctx.train_data(client_id)),
                      {MODEL: self.ctx.snapshot(self.private_keys)}, m)


@register
class FrozenStatsThatMove(FedAvg):
    """Declares BatchNorm statistics frozen while training them in train mode: the engine must refuse."""

    name = "test_frozen_stats_that_move"

    def key_role(self, key, default):
        return "frozen" if "running_" in key else default


# ------------------------------------------------------------------------------------------------ per-client hparams
def test_per_client_hyperparameters_from_step_and_from_the_method(run_sim):
    sim, _ = run_sim("fedavg", run=False, num_rounds=2, momentum=0.0)
    x0 = sim.algorithm.init_server_state()[MODEL]
    sim.step(client_hparams={0: {"local_steps": 1}, 1: {"local_steps": 3}, 2: {"lr": 0.0, "local_steps": 2}})
    steps = {u.client_id: u.metrics["steps"] for u in sim.last_updates}
    assert steps[0] == 1 and steps[1] == 3 and steps[2] == 2
    params = dict(sim.model.named_parameters())
    up2 = sim.last_updates[2].upload[MODEL]
    assert all(torch.equal(up2[k], x0[k]) for k in up2 if k in params)  # lr 0: weights unchanged
    assert any(not torch.equal(sim.last_updates[1].upload[MODEL][k], x0[k]) for k in params)
    sim.step()  # the overrides held for one round only: one epoch of batch 16 everywhere
    for u in sim.last_updates:
        assert u.metrics["steps"] == len(list(iterate_batches(sim.train_data(u.client_id), 16, shuffle=False)))
    assert sim.client_hparams(0) == HParams.from_args(sim.args)
    with pytest.raises(ValueError, match="unknown client hyperparameter"):
        sim.step(client_hparams={0: {"learning_rate": 0.1}})

    odd, _ = run_sim("test_half_batch_odd", num_rounds=1, output_dir="odd")
    for u in odd.last_updates:
        n = len(odd.train_data(u.client_id))
        bs = 8 if u.client_id % 2 else 16
        assert u.metrics["steps"] == len(list(iterate_batches(odd.train_data(u.client_id), bs, shuffle=False))), n


def test_per_client_dropout_is_set_and_restored():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1))
    with dropout_rate(model, 0.5):
        assert model[1].p == 0.5
    assert model[1].p == 0.1


# ------------------------------------------------------------------------------------------------ optimizers
def test_parameter_groups_and_optimizer_state_kept_per_client(run_sim):
    sim, _ = run_sim("test_adam_keeps_state", num_rounds=2, run=False)
    x0 = sim.algorithm.init_server_state()[MODEL]
    sim.step()
    head = [k for k in x0 if k.startswith("classifier")]
    for u in sim.last_updates:  # the head's group has lr 0
        assert all(torch.equal(u.upload[MODEL][k], x0[k]) for k in head)
    steps1 = {u.client_id: u.metrics["steps"] for u in sim.last_updates}
    sim.step()
    steps2 = {u.client_id: u.metrics["steps"] for u in sim.last_updates}
    for cid in range(sim.num_clients):
        opt = sim.store.get(cid)[OPTIM]
        step_keys = [k for k in opt if k.endswith(".step")]
        assert step_keys and all(float(opt[k]) == steps1[cid] + steps2[cid] for k in step_keys), cid
        assert any(k.endswith(".exp_avg_sq") and float(opt[k].abs().sum()) > 0 for k in opt)
    assert sim.ledger.totals()["by_part"].keys() == {"model"}  # optimizer state never travels


def test_train_takes_a_method_optimizer_and_schedule(run_sim):
    """The upload is the global model after exactly one plain-SGD step at 3x lr on the client's first batch (done by
    hand): the method's optimizer was used, and its schedule (lr x 0 from step two on) was stepped every step."""
    import copy

    sim, _ = run_sim("test_one_step_by_schedule", num_rounds=1, run=False)
    x0 = sim.algorithm.init_server_state()[MODEL]
    sim.step()
    u = sim.last_updates[0]
    assert u.metrics["steps"] > 1
    ctx = sim.algorithm.ctx
    model = copy.deepcopy(sim.algorithm.model)
    model.load_state_dict(x0, strict=False)
    model.train()
    batch = next(iter(iterate_batches(ctx.train_data(u.client_id), sim.args.batch_size, shuffle=True,
                                      generator=ctx.generator(1, u.client_id))))
    model.cpu()(**{"pixel_values": batch["pixel_values"]}, labels=batch["labels"]).loss.backward()
    moved = 0
    for name, p in model.named_parameters():
        if name in u.upload[MODEL] and p.grad is not None:
            expect = p.detach() - 3 * sim.args.lr * p.grad
            assert torch.allclose(u.upload[MODEL][name], expect, atol=1e-6), name
            moved += int(not torch.equal(expect, p.detach()))
    assert moved > 0


def test_two_optimizers_alternate_inside_each_step():
    """FRAug-style: stage A updates the body on loss A, then stage B the head on loss B, on the same batch."""
    torch.manual_seed(0)
    data = TensorData(torch.randn(12, 3), torch.randint(0, 2, (12,)))

    def make():
        torch.manual_seed(1)
        return nn.ModuleDict({"body": nn.Linear(3, 4), "head": nn.Linear(4, 2)})

    def loss_a(m, b):  # body only: push features towards 1
        return ((m["body"](b["pixel_values"]) - 1) ** 2).mean()

    def loss_b(m, b):
        return nn.functional.cross_entropy(m["head"](m["body"](b["pixel_values"]).detach()), b["labels"])

    m1 = make()
    opts = [torch.optim.SGD(m1["body"].parameters(), lr=0.1), torch.optim.SGD(m1["head"].parameters(), lr=0.2)]
    train_local(m1, data, opts, batch_size=4, epochs=2, generator=torch.Generator().manual_seed(3),
                loss_fn=[loss_a, loss_b])
    m2 = make()  # by hand
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        for batch in iterate_batches(data, 4, shuffle=True, generator=gen):
            for mod, fn, lr in ((m2["body"], loss_a, 0.1), (m2["head"], loss_b, 0.2)):
                m2.zero_grad()
                fn(m2, batch).backward()
                with torch.no_grad():
                    for p in mod.parameters():
                        p -= lr * p.grad
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        assert torch.allclose(a, b, atol=1e-6), n


def test_server_optimizer_matches_fedopt_by_hand(run_sim):
    """FedAvgM: d = x - mean; m = beta m + d; x <- x - lr * decay^(r-1) * m, over three rounds, on the parameters;
    BatchNorm statistics take the plain mean."""
    sim, _ = run_sim("fedavg", run=False, num_rounds=3, server_lr=0.5, server_momentum=0.9, server_lr_decay=0.8)
    params = {n for n, _ in sim.model.named_parameters()}
    x = {k: v.double() for k, v in sim.algorithm.init_server_state()[MODEL].items() if k in params}
    buf = {}
    for r in (1, 2, 3):
        sim.step()
        ups = sim.last_updates
        n = [u.num_samples for u in ups]  # the sample-weighted mean, written out (float64, stored as float32)
        mean = {k: (sum(ni * u.upload[MODEL][k].double() for ni, u in zip(n, ups)) / sum(n)).float()
                for k in ups[0].upload[MODEL] if ups[0].upload[MODEL][k].is_floating_point()}
        for k in x:
            d = x[k] - mean[k].double()
            buf[k] = 0.9 * buf[k] + d if k in buf else d
            x[k] = x[k] - 0.5 * 0.8 ** (r - 1) * buf[k]
        stats = [k for k in mean if "running_" in k]
        assert stats and all(torch.equal(sim.server_state[MODEL][k], mean[k]) for k in stats)
    for k, v in x.items():
        assert torch.allclose(sim.server_state[MODEL][k].double(), v, atol=1e-5), k
    assert "server_opt" in sim.server_state


# ------------------------------------------------------------------------------------------------ data and metrics
def test_validation_split_for_methods(tmp_path):
    from hfpfl.config import RunArguments
    from hfpfl.data import DataArguments, build_federated_dataset
    from hfpfl.federated.engine import Simulation

    data_args = DataArguments(num_clients=2, max_per_domain=60, image_size=16, val_fraction=0.25)
    fed = build_federated_dataset(data_args, seed=0)
    sim = Simulation(RunArguments(num_rounds=1, output_dir=str(tmp_path / "v"), progress=False), data_args,
                     fed_data=fed)
    sim.run()
    val = sim.ctx.val_data(0)
    assert len(val) == len(fed.clients[0].val) > 0
    res = sim.ctx.evaluate(sim.model, val)
    assert res["num_samples"] == len(val) and res["loss"] > 0
    no_val = Simulation(RunArguments(num_rounds=1, output_dir=str(tmp_path / "n"), progress=False),
                        DataArguments(num_clients=2, max_per_domain=60, image_size=16))
    with pytest.raises(ValueError, match="--val_fraction"):
        no_val.ctx.val_data(0)


class TwoInputModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.img = nn.Linear(2, 3)

    def forward(self, input_ids, pixel_values, labels=None):
        return ImageClassifierOutput(logits=self.emb(input_ids).sum(1) + self.img(pixel_values))


def test_dict_batches_and_a_task_metric():
    torch.manual_seed(0)
    n = 7
    data = TensorData.of(input_ids=torch.randint(0, 5, (n, 4)), pixel_values=torch.randn(n, 2),
                         labels=torch.rand(n, 3))
    model = TwoInputModel()
    res = evaluate(model, data, batch_size=3, metric=SoftTargetAccuracy())
    with torch.no_grad():
        logits = model(data.columns["input_ids"], data.columns["pixel_values"]).logits
    hand = float(sum(data.labels[i, logits[i].argmax()] for i in range(n))) / n
    assert res["accuracy"] == pytest.approx(hand) and res["num_samples"] == n
    batch = next(iterate_batches(data, 3, shuffle=False))
    assert set(batch) == {"input_ids", "pixel_values", "labels"} and batch["input_ids"].shape == (3, 4)


# ------------------------------------------------------------------------------------------------ engine guarantees
def test_aggregation_streams_uploads_as_they_arrive(run_sim):
    sim, _ = run_sim("fedavg", run=False, num_rounds=1)
    sim.keep_uploads = False
    calls = []
    algo = sim.algorithm
    cu, acc = algo.client_update, algo.accumulate
    algo.client_update = lambda cid, *a: calls.append(("train", cid)) or cu(cid, *a)
    algo.accumulate = lambda sums, u, coef: calls.append(("fold", u.client_id)) or acc(sums, u, coef)
    sim.step()
    assert calls == [(k, c) for c in range(4) for k in ("train", "fold")]  # never two uploads held at once
    assert sim.last_updates == []


def test_private_model_state_never_leaks_between_clients(run_sim):
    """With LoRA on a frozen backbone, BatchNorm statistics are private: whatever the previous client left in the
    model, a client's update is the same (the engine swaps its private part in, even for Ditto and SCAFFOLD)."""
    for method in ("ditto", "scaffold", "fedavg"):
        sim, _ = run_sim(method, run=False, adapter="lora", lora_r=2, momentum=0.0, output_dir=f"leak-{method}")
        assert any("running_mean" in k for k in sim.keys_by_role[PRIVATE])
        state = sim.algorithm.init_server_state()
        a = sim.rounds.client_work(1, 1, state)
        priv_a = sim.store.get(1)
        sim.store.clear()
        with torch.no_grad():  # pollute: another client's statistics left in the model
            for k in sim.keys_by_role[PRIVATE]:
                sim.model_state[k].add_(3)
        b = sim.rounds.client_work(1, 1, state)
        for p in a.upload:
            for k in a.upload[p]:
                assert torch.equal(a.upload[p][k], b.upload[p][k]), (method, p, k)
        for p in priv_a:
            for k in priv_a[p]:
                assert torch.equal(priv_a[p][k], sim.store.get(1)[p][k]), (method, p, k)


def test_frozen_state_that_changes_is_an_error(run_sim):
    with pytest.raises(ValueError, match="role 'frozen' but changed"):
        run_sim("test_frozen_stats_that_move", num_rounds=1)


def test_state_lives_on_the_cpu(run_sim):
    sim, _ = run_sim("scaffold", num_rounds=1, momentum=0.0)
    tensors = [v for d in sim.server_state.values() for v in d.values()]
    tensors += [v for c in sim.store.clients() for d in sim.store.get(c).values() for v in d.values()]
    assert tensors and all(v.device.type == "cpu" for v in tensors)


@pytest.mark.slow
@pytest.mark.parametrize("method,kw", [("fedprox", {}), ("scaffold", {"momentum": 0.0}),
                                       ("test_adam_keeps_state", {}), ("fedavg", {"server_momentum": 0.5, "server_lr": 0.7})])
def test_export_import_continues_bit_for_bit(run_sim, method, kw):
    """5 rounds straight == 2 rounds, state_dict(), load into a fresh Simulation, 3 more rounds."""
    straight, res = run_sim(method, num_rounds=5, clients_per_round=3, output_dir=f"{method}-a", **kw)
    first, _ = run_sim(method, num_rounds=5, clients_per_round=3, output_dir=f"{method}-b", run=False, **kw)
    first.step()
    first.step()
    exported = first.state_dict()
    fresh, _ = run_sim(method, num_rounds=5, clients_per_round=3, output_dir=f"{method}-c", run=False, **kw)
    fresh.load_state_dict(exported)
    for _ in range(3):
        fresh.step()
    for p, d in straight.server_state.items():
        for k, v in d.items():
            assert torch.equal(fresh.server_state[p][k], v), (p, k)
    for c in straight.store.clients():
        for p, d in straight.store.get(c).items():
            assert all(torch.equal(fresh.store.get(c)[p][k], v) for k, v in d.items()), (c, p)
    assert fresh.finish()["final"] == res["final"]


def test_resume_refuses_changed_settings_and_keeps_the_config(run_sim):
    sim, _ = run_sim("fedavg", num_rounds=2, output_dir="r")
    out = Path(sim.args.output_dir)
    config = (out / "config.yaml").read_text()
    for change, match in (({"lr": 0.1}, "lr"), ({"seed": 3}, "seed"), ({"method": "fedprox"}, "method"),
                          ({"num_rounds": 1}, "--num_rounds 1 is smaller")):
        kw = {"num_rounds": 3, **change}
        with pytest.raises(ValueError, match=match):
            run_sim(kw.pop("method", "fedavg"), output_dir="r", resume_from_checkpoint="latest",
                    overwrite_output_dir=False, **kw)
        assert (out / "config.yaml").read_text() == config
    _, res = run_sim("fedavg", num_rounds=3, output_dir="r", resume_from_checkpoint="latest", overwrite_output_dir=False)
    assert res["num_rounds"] == 3 and json.loads((out / "results.json").read_text())["num_rounds"] == 3
    assert "num_rounds: 3" in (out / "config.yaml").read_text()


@pytest.mark.slow
def test_non_finite_training_stops_with_the_round_and_client(run_sim, tmp_path):
    with pytest.raises(NonFiniteError, match="round 1 on client 0.*--lr"):
        run_sim("fedavg", num_rounds=2, lr=1e30)  # finite, but the weights blow up
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    p = subprocess.run([sys.executable, str(ROOT / "recipes" / "run.py"), "--num_clients", "2", "--max_per_domain",
                        "40", "--image_size", "16", "--num_rounds", "1", "--lr", "1e38", "--progress", "false",
                        "--output_dir", str(tmp_path / "inf")], env=env, capture_output=True, text=True)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].startswith("error: training diverged"), p.stderr
    assert not (tmp_path / "inf" / "results.json").exists()


@pytest.mark.slow
def test_layers_point_one_way():
    code = ("import sys, hfpfl.federated.engine, hfpfl.models, hfpfl.training; "
            "bad = [m for m in sys.modules if m.startswith('hfpfl.algorithms')]; assert not bad, bad; "
            "import hfpfl.models.pretrained; "
            "assert 'hfpfl.federated.training' not in sys.modules")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


class _PlainNet(nn.Module):
    """A user's plain module with the calling convention the engine uses (no HF config)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3 * 16 * 16, 10)

    def forward(self, pixel_values, labels=None):
        logits = self.fc(pixel_values.flatten(1))
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return ImageClassifierOutput(loss=loss, logits=logits)


@register
class OwnModel(FedAvg):
    name = "test_own_model"

    def build_model(self):
        return _PlainNet()


class _Wrapped(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, **kw):
        return self.inner(**kw)


@register
class WrapsDefaultModel(FedAvg):
    name = "test_wraps_default"

    def build_model(self):
        return _Wrapped(self.ctx.build_default_model())


def test_run_header_names_the_model_the_method_built(run_sim):
    """The header said '--model tiny-resnet (built-in config, random init)' for every run, also where the method
    builds its own model (FedBasis, FedPop's tiny MLP, a user's plain module) and --model is never read."""
    from hfpfl.tracking import run_header

    def model_line(method):
        sim, _ = run_sim(method, run=False)
        return next(ln for ln in run_header(sim).splitlines() if ln.startswith("  model "))

    assert model_line("fedavg").split(None, 1)[1] == "tiny-resnet (built-in config, random init)"
    assert model_line("test_own_model").split(None, 1)[1] == \
        "_PlainNet, built by the method test_own_model (--model unused)"
    assert model_line("test_wraps_default").split(None, 1)[1] == \
        "_Wrapped, built by the method test_wraps_default around tiny-resnet (built-in config, random init)"


def test_every_builtin_method_declares_the_path_its_code_takes():
    """The engine reads a method's declarations (aggregation, local_update, personal_model), never which methods it
    overrides; this test keeps the declarations of the built-in methods true: a method with its own ``aggregate``
    gathers, one with its own ``accumulate`` streams, one with its own ``client_update`` / ``load_client`` trains
    its own way (FedBN's answers per option through ``vectorizable``), one with its own ``load_personal`` builds
    its personal models."""
    from hfpfl.algorithms import REGISTRY, load_builtin_methods
    from hfpfl.federated.protocol import Algorithm

    load_builtin_methods()
    builtin = {n: c for n, c in REGISTRY.items() if c.__module__.startswith("hfpfl.algorithms.")}
    assert len(builtin) >= 25
    for name, cls in builtin.items():
        def own(m):
            return getattr(cls, m) is not getattr(Algorithm, m)
        aggregation = "gather" if own("aggregate") else "stream" if own("accumulate") or own("receive") else "mean"
        assert cls.aggregation == aggregation, name
        if cls.vectorizable is Algorithm.vectorizable:
            assert cls.local_update == ("own" if own("client_update") or own("load_client") else "engine"), name
        assert cls.personal_model == ("own" if own("load_personal") or own("load_client") else "loaded"), name
