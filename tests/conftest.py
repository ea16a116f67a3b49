"""Shared fixtures. Everything runs offline on tiny models and small real-image data."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def small_digits():
    """4 feature-shift clients (one Digits domain each) + 1 held-out new client, 16x16 RGB."""
    from hfpfl.data import DataArguments, build_federated_dataset

    args = DataArguments(num_clients=4, max_per_domain=100, image_size=16, num_new_clients=1)
    return args, build_federated_dataset(args, seed=0)


@pytest.fixture
def run_sim(small_digits, tmp_path):
    """run_sim(method, **run_overrides) -> (Simulation, results) on the small Digits federation."""
    from hfpfl.algorithms import get_algorithm
    from hfpfl.config import RunArguments
    from hfpfl.federated.engine import Simulation

    data_args, fed = small_digits

    def _run(method="fedavg", method_config=None, run=True, **overrides):
        kw = dict(method=method, num_rounds=2, batch_size=16, lr=0.05, output_dir=str(tmp_path / method),
                  progress=False, new_client_epochs=1, overwrite_output_dir=True)
        kw.update(overrides)
        kw["output_dir"] = str(tmp_path / kw["output_dir"])  # always inside the test's tmp dir
        cfg = method_config if method_config is not None else get_algorithm(method).Config()
        sim = Simulation(RunArguments(**kw), data_args, cfg, fed_data=fed, keep_uploads=True)
        return sim, (sim.run() if run else None)

    return _run


@pytest.fixture(scope="session")
def pretrained_backbone():
    """The tiny ResNet pretrained on the public pool, published to the local Hub cache (trained once if missing)."""
    from hfpfl.models.pretrained import default_repo_id, ensure_pretrained

    return ensure_pretrained(default_repo_id("tiny-resnet", "digits"))
