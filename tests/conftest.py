"""Shared fixtures. Everything runs offline on tiny models and small real-image data."""
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HFPFL_NUM_PROCESSES", "1")   # tests run one process unless a test asks for more

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

# Multi-process equality tests: two CPU processes (gloo) against one process, both on the CPU. CI has no GPU; on a
# machine with one GPU, accelerate's barrier names the CUDA device of each local rank even for CPU processes (rank 1
# then asks for a GPU that does not exist), and a one-process reference on the GPU would not be bit-comparable with
# CPU processes. So both runs see no GPU.
LAUNCH_TWO = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}                 # for the one-process reference
CPU_PROCESSES = {**CPU_ONLY, "ACCELERATE_USE_CPU": "1"}  # for the LAUNCH_TWO run


class _PipelinesBesideTheTests:
    """``hfpfl.pipelines`` is the repository's top-level ``pipelines/`` folder, installed under that name (pyproject's
    package-dir). The tests import the one beside them: from a checkout other than the installed one (a worktree, or
    mutmut's ``mutants/``, where the pipeline file is mutated) the install's mapping would give another checkout's
    file. Under mutmut the modules are the top-level ``pipelines.*`` ones under a second name: mutmut names a mutant
    after its file's path (``pipelines.pipeline_fedbip.x...``) and switches it on only in a module of that
    ``__name__``. Whether the install itself maps the folder is tests/hub/test_packaging.py's test."""

    root = str(Path(__file__).resolve().parents[1])

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != "hfpfl.pipelines" and not name.startswith("hfpfl.pipelines."):
            return None
        import importlib.machinery
        import importlib.util

        if "MUTANT_UNDER_TEST" in os.environ:
            return importlib.util.spec_from_loader(name, cls(name.removeprefix("hfpfl.")))
        if name == "hfpfl.pipelines":
            return importlib.machinery.PathFinder.find_spec(name, [cls.root])
        return None  # a module of the package: found on its __path__

    def __init__(self, same_as: str):
        self.same_as = same_as

    def create_module(self, spec):
        import importlib

        return importlib.import_module(self.same_as)

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _PipelinesBesideTheTests)


def load_script(relpath: str, name: str | None = None):
    """A repository script or recipe (``"recipes/fedpop.py"``) imported as a module under ``name``, registered in
    ``sys.modules`` (its dataclasses look their module up there), so its ``main(argv)`` runs in this process."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / relpath
    spec = importlib.util.spec_from_file_location(name or "hfpfl_test_" + path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def spy_concept_prompts(monkeypatch) -> list:
    """Every (S, V) the FedBiP pipeline encodes into a prompt from now on, in order (the encoder still runs)."""
    import hfpfl.pipelines.pipeline_fedbip as pf

    seen, real = [], pf.encode_concept_prompt

    def spy(te, tok, tpl, S, V, space="input"):
        seen.append((S.detach().clone(), V.detach().clone()))
        return real(te, tok, tpl, S, V, space)

    monkeypatch.setattr(pf, "encode_concept_prompt", spy)
    return seen


def capture_training_batches(model) -> list:
    """Every training forward's (pixel_values, labels), in order: which batches a method's update trained on."""
    seen = []

    def hook(module, args, kwargs):
        if torch.is_grad_enabled():
            seen.append((kwargs["pixel_values"].detach().clone(), kwargs["labels"].detach().clone()))
    model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


@pytest.fixture
def network_calls(monkeypatch):
    """Every attempt to reach the network during the test, recorded and refused: an internet socket's connect and
    name lookups (whatever the client: httpx, requests, aiohttp, urllib) and the HTTP clients' own send. "Fails fast
    offline" is asserted as ``network_calls == []`` after the failure: a refused attempt would often be swallowed
    by the library's offline fallback, so the record, not the exception, is what the test reads."""
    import socket

    calls = []

    def refuse(what, detail=lambda *args: args[:1]):
        def fn(*args, **kwargs):
            calls.append((what, detail(*args)))
            raise OSError(f"test: network access refused ({what})")
        return fn

    def url(client, request, *rest):
        return str(getattr(request, "url", request))

    def internet_only(real):  # local (unix) sockets stay usable
        def fn(sock, address):
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                return refuse("socket.connect", lambda s, a: a)(sock, address)
            return real(sock, address)
        return fn

    monkeypatch.setattr(socket.socket, "connect", internet_only(socket.socket.connect))
    monkeypatch.setattr(socket.socket, "connect_ex", internet_only(socket.socket.connect_ex))
    monkeypatch.setattr(socket, "getaddrinfo", refuse("socket.getaddrinfo"))
    import httpx
    monkeypatch.setattr(httpx.Client, "send", refuse("httpx", url))
    monkeypatch.setattr(httpx.AsyncClient, "send", refuse("httpx", url))
    try:
        import requests
    except ImportError:
        pass
    else:
        monkeypatch.setattr(requests.Session, "send", refuse("requests", url))
    return calls


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
        recipe_settings = kw.pop("recipe_settings", None)
        cfg = method_config if method_config is not None else get_algorithm(method).Config()
        sim = Simulation(RunArguments(**kw), data_args, cfg, fed_data=fed, keep_uploads=True,
                         recipe_settings=recipe_settings)
        return sim, (sim.run() if run else None)

    return _run


#: a quick budget for the stand-in backbones in tests (same pool and architecture as the real ones, fewer steps)
QUICK_STANDIN = dict(pool_size=930, epochs=1, batch_size=32)


@pytest.fixture(scope="session")
def _standin_hub_cache(tmp_path_factory):
    """A temporary Hub cache holding the out-of-domain tiny ResNet stand-in, pretrained once per session with a quick
    budget (the engine reuses a cached stand-in of the same pool/architecture whatever its budget)."""
    from hfpfl import hub
    from hfpfl.models.pretrained import ensure_standin

    cache = tmp_path_factory.mktemp("hf-hub-cache")
    with hub.use_hub_cache(cache):
        ensure_standin("hfpfl/tiny-resnet-ood", **QUICK_STANDIN)
    return cache


@pytest.fixture
def pretrained_backbone(_standin_hub_cache):
    """``hfpfl/tiny-resnet-ood``, loadable by repo id for the duration of the test (temporary Hub cache)."""
    from hfpfl import hub

    with hub.use_hub_cache(_standin_hub_cache):
        yield "hfpfl/tiny-resnet-ood"


@pytest.fixture
def kill_after_first_checkpoint():
    """kill(proc, out): SIGKILL a running recipe process as soon as it has saved its first round checkpoint under
    ``out``, and check that it left no ``results.json`` behind (a killed run must not look complete)."""
    import signal
    import time
    from pathlib import Path

    def kill(proc, out, timeout: float = 300):
        ck = Path(out) / "checkpoints"
        deadline = time.time() + timeout
        while time.time() < deadline and not (ck.is_dir() and any(p.name.startswith("round-") for p in ck.iterdir())):
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert not (Path(out) / "results.json").exists()

    return kill


@pytest.fixture(scope="module")
def tiny_fed():
    """FedPop's tuner tests: usps, Dirichlet(0.5) over 6 clients with validation splits, 8x8 (one build per module)."""
    from hfpfl.data import DataArguments, build_federated_dataset

    da = DataArguments(dataset="usps", partition="dirichlet", num_clients=6, alpha=0.5, max_per_domain=150,
                       image_size=8, val_fraction=0.2)
    return da, build_federated_dataset(da, seed=0)
