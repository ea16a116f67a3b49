"""``--num_processes auto|N``: a recipe started with plain python launches itself in N processes (same numbers)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hfpfl import launch
from hfpfl.config import RunArguments

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--num_clients", "4", "--max_per_domain", "100", "--image_size", "16", "--batch_size", "16",
         "--progress", "false"]


def test_auto_counts_idle_cores_gpus_and_clients():
    assert launch.resolve("3") == 3
    assert launch.resolve("auto", cores=2, load=0.1, gpus=0) == 2      # an idle 2-core box: both cores
    assert launch.resolve("auto", cores=2, load=1.2, gpus=0) == 1      # the second core busy: one process
    assert launch.resolve("auto", cores=2, load=3.0, gpus=0) == 1      # never below one
    assert launch.resolve("auto", 3, cores=16, load=0.0, gpus=0) == 3  # at most one per client trained per round
    assert launch.resolve("auto", 20, cores=16, load=0.0, gpus=4) == 4  # one per GPU
    with pytest.raises(ValueError, match="--num_processes must be auto or a whole number >= 1"):
        RunArguments(num_processes="two")
    with pytest.raises(ValueError, match="--num_processes"):
        launch.resolve("0")


def _run(args, out, extra_env=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",
           **(extra_env or {})}
    for k in ("LOCAL_RANK", "ACCELERATE_MIXED_PRECISION", "WORLD_SIZE"):
        env.pop(k, None)
    return subprocess.run([sys.executable, str(ROOT / "recipes" / "run.py"), *SMALL, "--output_dir", str(out), *args],
                          env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_num_processes_two_gives_the_same_numbers_as_one(tmp_path):
    args = ["--method", "fedbn", "--num_rounds", "2", "--checkpoint_every", "0"]
    one = _run(args, tmp_path / "one")
    assert one.returncode == 0, one.stderr[-2000:]
    two = _run(args + ["--num_processes", "2"], tmp_path / "two")
    assert two.returncode == 0, two.stderr[-2000:]
    r1, r2 = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("one", "two"))
    assert (r1["world_size"], r2["world_size"]) == (1, 2)   # two processes really ran
    assert r1["final"] == r2["final"] and r1["per_client_accuracy"] == r2["per_client_accuracy"]
    assert r1["communication"]["bytes_up"] == r2["communication"]["bytes_up"]
    assert two.stdout.count("results: ") == 1                 # the main process reports, once
