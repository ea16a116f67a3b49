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


def _launcher_env(multi: bool) -> dict:
    """The variables accelerate's own launcher adds for the process it starts (its code, not a copied list)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env, prepare_simple_launcher_cmd_env
    flags = ["--multi_gpu", "--num_processes", "2"] if multi else ["--num_processes", "1"]
    args = launch_command_parser().parse_args([*flags, "--num_machines", "1", "--mixed_precision", "no",
                                               "--dynamo_backend", "no", "x.py"])
    args, _, _ = _validate_launch_command(args)
    env = prepare_multi_gpu_env(args) if multi else prepare_simple_launcher_cmd_env(args)[1]
    return {k: v for k, v in env.items() if os.environ.get(k) != v}


def test_launched_means_a_launcher_started_this_process(monkeypatch):
    for k in ("LOCAL_RANK", *launch._ACCELERATE_LAUNCH_VARS, "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(k, raising=False)
    assert not launch.launched()
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")   # a user's export, no launcher: still relaunch
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    assert not launch.launched()
    with monkeypatch.context() as m:                         # accelerate launch, one process (simple launcher)
        for k, v in _launcher_env(multi=False).items():
            m.setenv(k, v)
        assert launch.launched()
    with monkeypatch.context() as m:                         # torchrun / multi-process launch: LOCAL_RANK per rank
        for k, v in _launcher_env(multi=True).items():
            m.setenv(k, v)
        assert launch.launched()
        for k in launch._ACCELERATE_LAUNCH_VARS:
            m.delenv(k, raising=False)
        m.setenv("LOCAL_RANK", "0")
        assert launch.launched()


def test_num_processes_default_from_the_environment(monkeypatch):
    from hfpfl.cli import _processes_to_launch
    from hfpfl.config import parse_run_args
    for k in ("LOCAL_RANK", *launch._ACCELERATE_LAUNCH_VARS):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.delenv("HFPFL_NUM_PROCESSES", raising=False)
    assert parse_run_args([])[0].num_processes == launch.DEFAULT_NUM_PROCESSES == "1"
    monkeypatch.setenv("HFPFL_NUM_PROCESSES", "auto")
    run, data, _ = parse_run_args(["--num_clients", "4"])
    assert run.num_processes == "auto"
    assert parse_run_args(["--num_processes", "1"])[0].num_processes == "1"   # the flag wins
    monkeypatch.setenv("HFPFL_NUM_PROCESSES", "2")
    run, data, _ = parse_run_args(["--num_clients", "4"])
    assert _processes_to_launch(run, data) == 2                                 # would relaunch in 2 processes
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")                      # an export alone changes nothing
    assert _processes_to_launch(run, data) == 2
    monkeypatch.setenv("LOCAL_RANK", "0")                                       # inside a launch: never again
    assert _processes_to_launch(run, data) == 1
    monkeypatch.setenv("HFPFL_NUM_PROCESSES", "two")
    with pytest.raises(ValueError, match="HFPFL_NUM_PROCESSES must be auto or a whole number >= 1, got 'two'"):
        parse_run_args([])
