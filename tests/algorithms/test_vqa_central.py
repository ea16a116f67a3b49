"""vqa_central: the benchmark check's central fine-tuning (every client's train split pooled once, one model with one
answer head trained on the union), on a tiny random ViLT and a small easy-vqa federation."""
import math

import pytest
import torch

from hfpfl.algorithms import get_algorithm
from hfpfl.config import RunArguments


@pytest.fixture(scope="module")
def fed():
    from hfpfl.data.vqa import vqa_benchmark
    from hfpfl.models.vqa import vqa_tokenizer

    return vqa_benchmark("function", tokenizer=vqa_tokenizer(), seed=0, train_per_client=16, test_per_client=20)


def test_central_uploads_each_clients_split_and_trains_one_model_on_their_union(fed, tmp_path):
    """Each upload is exactly its client's train split; the server runs epochs x ceil(N / batch) steps over the
    N = sum N_k pooled questions (last batch kept), the answer head is global (no private key), and every client is
    scored with that one model: its per-client accuracy equals the final model evaluated on the client's test."""
    from hfpfl.federated.engine import Simulation

    run = RunArguments(method="vqa_central", model="tiny-vilt", random_backbone_ok=True, num_rounds=1, batch_size=7,
                       lr=1e-2, optimizer="adamw", output_dir=str(tmp_path / "c"), progress=False,
                       overwrite_output_dir=True, checkpoint_every=0, eval_batch_size=64, last_batch="keep")
    sim = Simulation(run, None, get_algorithm("vqa_central").Config(peft="full", epochs=2), fed_data=fed,
                     keep_uploads=True)
    res = sim.run()
    sizes = [len(c.train) for c in fed.clients]
    assert res["budget"]["optimizer_steps"] == 2 * math.ceil(sum(sizes) / 7)
    algo = sim.algorithm
    assert any(k.startswith("backbone.classifier.") for k in algo.global_keys) and not algo.private_keys
    for u in sim.last_updates:
        mine = sim.train_data(u.client_id).columns
        assert u.num_samples == sizes[u.client_id]
        assert all(torch.equal(u.upload["data"][k], v) for k, v in mine.items())
    assert len(sim.last_updates) == len(fed.clients)
    model = algo.model
    for cid in range(len(fed.clients)):
        acc = sim.ctx.evaluate(model, sim.test_data(cid))["accuracy"]
        assert res["per_client_accuracy"][str(cid)] == pytest.approx(acc)


def test_central_training_uses_feddats_adamw_and_warmup_schedule_in_shared_mode(fed, tmp_path):
    """The server's one training call, recorded: the adapters run in the shared mode (A_s, what the federated methods
    train), over the pooled N questions for `epochs` passes, with AdamW betas (0.9, 0.98) at the run's lr and weight
    decay, and FedDAT's warm-up + linear decay over T = epochs x ceil(N / B) steps (warm-up w = round(0.2 T) steps:
    (s + 1) / w, then (T - s) / (T - w)), written out here; clients are scored in the shared mode too."""
    from hfpfl.federated.engine import Simulation

    run = RunArguments(method="vqa_central", model="tiny-vilt", random_backbone_ok=True, num_rounds=1, batch_size=10,
                       lr=3e-3, weight_decay=0.05, optimizer="sgd", output_dir=str(tmp_path / "c"),
                       progress=False, overwrite_output_dir=True, checkpoint_every=0, eval_batch_size=64,
                       last_batch="keep")
    sim = Simulation(run, None, get_algorithm("vqa_central").Config(peft="adapter", epochs=2, warmup=0.2), fed_data=fed)
    calls, modes = [], []
    train = sim.ctx.train

    def recording(*args, **kwargs):
        calls.append((args, kwargs, sim.algorithm.model.mode))
        return train(*args, **kwargs)

    sim.ctx.train = recording
    evaluate = sim.ctx.evaluate

    def evaluating(model, *a, **k):
        modes.append(sim.algorithm.model.mode)
        return evaluate(model, *a, **k)

    sim.ctx.evaluate = evaluating
    sim.run()
    (args, kw, mode), = calls
    assert mode == "shared" and modes and set(modes) == {"shared"}
    assert args[0] == -1                      # the server's own seed stream (client ids are 0..K-1)
    n = sum(len(c.train) for c in fed.clients)
    assert kw["epochs"] == 2 and len(kw["data"]) == n and kw["hp"].batch_size == 10
    total = 2 * math.ceil(n / 10)         # last batch kept: 63 = 6 x 10 + 3 -> 7 steps an epoch
    w = round(0.2 * total)
    expected = [(s + 1) / w if s < w else (total - s) / (total - w) for s in range(total)]
    params = [p for p in kw["params"] if p.requires_grad]
    names = {id(p): name for name, p in sim.algorithm.model.named_parameters()}
    assert params and all(".shared." in names[id(p)] or "classifier" in names[id(p)] for p in params)
    opt = kw["optimizer"](params, kw["hp"])
    assert isinstance(opt, torch.optim.AdamW)
    g = opt.param_groups[0]
    assert g["betas"] == (0.9, 0.98) and g["lr"] == 3e-3 and g["weight_decay"] == 0.05
    sched = kw["schedule"](opt)
    got = []
    for _ in range(total):
        got.append(opt.param_groups[0]["lr"] / 3e-3)
        opt.step()
        sched.step()
    assert got == pytest.approx(expected)
    batch = {k: v[:3] for k, v in kw["data"].columns.items()}
    model = sim.algorithm.model
    with torch.no_grad():
        assert float(kw["loss_fn"](model, batch)) == pytest.approx(float(model(**batch).loss))
