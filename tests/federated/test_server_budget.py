"""The budget a run reports (``results["budget"]``), read by the study runner to match rows: for a method whose
evaluated model is trained on the server (Central, FedBiP's classifier), its steps and examples; for client training,
the steps and examples per client model. Hand counts on a pooled set of known size."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402

from hfpfl.algorithms.central import CentralConfig  # noqa: E402
from hfpfl.config import RunArguments  # noqa: E402
from hfpfl.data import DataArguments  # noqa: E402
from hfpfl.federated.engine import Simulation  # noqa: E402

# 3 clients x 10 classes x 2 shots = 60 pooled train images
DATA = DataArguments(dataset="digits-nomnist", num_clients=3, max_per_domain=80, image_size=8, test_fraction=0.3,
                     shots_per_class=2, data_seed=0)


def _budget(tmp_path, method, cfg=None, **kw):
    run = RunArguments(method=method, model="tiny-resnet", output_dir=str(tmp_path / method), progress=False,
                       checkpoint_every=0, overwrite_output_dir=True, batch_size=32, **kw)
    return Simulation(run, DATA, cfg).run()["budget"]


@pytest.mark.parametrize("steps, epochs, want_steps, want_examples", [
    (7, 50, 7, 32 + 28 + 32 + 28 + 32 + 28 + 32),   # exact steps over 60 images in batches of 32 and 28
    (None, 2, 4, 2 * 60),                            # two epochs: two batches each
])
def test_central_reports_its_server_training(tmp_path, steps, epochs, want_steps, want_examples):
    b = _budget(tmp_path, "central", CentralConfig(epochs=epochs, steps=steps), num_rounds=1)
    assert b["trained_models"] == 1
    assert b["optimizer_steps"] == b["optimizer_steps_per_model"] == want_steps
    assert b["examples_seen"] == b["examples_seen_per_model"] == want_examples


def test_client_training_is_counted_per_client_model(tmp_path):
    b = _budget(tmp_path, "fedavg", num_rounds=2, local_steps=3)
    assert b["trained_models"] == 3 and b["optimizer_steps"] == 2 * 3 * 3 and b["optimizer_steps_per_model"] == 6
    assert "client_optimizer_steps" not in b   # no server training: the clients' models are the budget
