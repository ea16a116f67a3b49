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
