"""The run's evaluation skips re-loading unchanged tensors between clients; a personal model that trains at load
(FedAvg+FT fine-tunes each client's copy of the global model) updates BatchNorm's running statistics in place
without bumping their version counters, so every client's model must still get its own buffers: each client's
score in the run's evaluation equals the score of that client's personal model built alone."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from hfpfl.algorithms.fedavg_ft import FedAvgFT  # noqa: E402
from hfpfl.config import RunArguments  # noqa: E402
from hfpfl.federated.engine import Simulation  # noqa: E402
from hfpfl.federated.evaluation import personal_models  # noqa: E402

torch.set_num_threads(1)


def test_fine_tuned_personal_models_are_scored_each_with_its_own_batchnorm_statistics(small_digits, tmp_path):
    data_args, fed = small_digits
    run = RunArguments(method="fedavg_ft", model="tiny-resnet", num_rounds=1, batch_size=16, lr=0.05,
                       vectorize="off", progress=False, checkpoint_every=0, overwrite_output_dir=True,
                       output_dir=str(tmp_path / "run"))
    sim = Simulation(run, data_args, FedAvgFT.Config(finetune_epochs=1), fed_data=fed)
    sim.run()
    stats = [k for k, _ in sim.model.named_buffers() if k.endswith("running_mean")]
    assert stats

    def seen(model, cid):
        return sim.ctx.evaluate(model, sim.test_data(cid))["loss"], {k: dict(model.named_buffers())[k].clone()
                                                                     for k in stats}

    clients = list(range(sim.num_clients))
    # the run's evaluation: one pass over the clients, unchanged tensors not re-loaded
    together = [seen(m, c) for c, m in personal_models(sim, clients, sim.server_state, sim.round,
                                                       skip_unchanged_loads=True)]
    for cid in clients:  # each client alone: nothing could carry over from another client
        (_, model), = personal_models(sim, [cid], sim.server_state, sim.round)
        loss, bufs = seen(model, cid)
        assert together[cid][0] == loss, (cid, together[cid][0], loss)
        assert all(torch.equal(together[cid][1][k], bufs[k]) for k in stats), cid
