"""Every entry point answers --help, and a user error exits with a one-line message (no traceback)."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CPU_PROCESSES, LAUNCH_TWO

ROOT = Path(__file__).resolve().parents[2]
ENTRY_POINTS = sorted(str(p.relative_to(ROOT)) for p in [*ROOT.glob("recipes/*.py"), *ROOT.glob("scripts/*.py")])
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.mark.slow
@pytest.mark.parametrize("script", ENTRY_POINTS)
def test_help(script):
    out = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage" in out.stdout.lower() and "--" in out.stdout


@pytest.mark.slow
def test_user_error_is_one_clear_line(tmp_path):
    out = subprocess.run([sys.executable, "recipes/run.py", "--method", "fedavgg", "--output_dir", str(tmp_path)],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert "unknown method 'fedavgg'" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run([sys.executable, "recipes/run.py", "--dataset", "nosuchdata", "--output_dir", str(tmp_path)],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "nosuchdata" in out.stderr and "Traceback" not in out.stderr


# ------------------------------------------------------------------------------------------------ a newcomer's hour
SMALL = ["--dataset", "usps", "--partition", "iid", "--num_clients", "2", "--max_per_domain", "60", "--image_size", "16",
         "--batch_size", "16", "--progress", "false", "--new_client_epochs", "0"]


def _run(argv):
    from hfpfl.cli import run_recipe
    return run_recipe(argv=list(argv))


def test_saved_config_is_a_valid_config_that_reproduces_the_run(tmp_path, capsys):
    from hfpfl.config import LOCATION_KEYS
    from hfpfl.arguments import parse_run_args

    first = tmp_path / "first"
    args = [*SMALL, "--method", "fedprox", "--mu", "0.3", "--num_rounds", "2", "--lr", "0.07", "--seed", "3",
            "--max_per_domain", "None", "--samples_per_client", "40", "--output_dir", str(first)]
    res1 = _run(args)
    cfg = first / "config.yaml"
    assert cfg.read_text().startswith("# hfpfl resolved config")
    want = parse_run_args(args)
    again = parse_run_args(["--config", str(cfg)])
    for a, b in zip(want, again):
        da, db = dataclasses.asdict(a), dataclasses.asdict(b)
        for k in LOCATION_KEYS:
            da.pop(k, None), db.pop(k, None)
        assert da == db
    second = tmp_path / "second"
    res2 = _run(["--config", str(cfg), "--output_dir", str(second)])
    assert res1["final"] == res2["final"] and res1["communication"] == res2["communication"]
    # the sectioned layout earlier versions wrote is accepted too
    nested = tmp_path / "nested.yaml"
    nested.write_text("run:\n  method: fedprox\n  num_rounds: 4\ndata:\n  num_clients: 3\nmethod:\n  mu: 0.2\n")
    run, data, m = parse_run_args(["--config", str(nested)])
    assert (run.method, run.num_rounds, data.num_clients, m.mu) == ("fedprox", 4, 3, 0.2)
    log = capsys.readouterr().out
    assert "hfpfl run: fedprox, 2 rounds, seed 3" in log


@pytest.mark.slow
def test_redirected_log_is_plain_lines(tmp_path):
    out = subprocess.run([sys.executable, "recipes/run.py", *SMALL, "--num_rounds", "2", "--progress", "true",
                          "--output_dir", str(tmp_path / "o")], cwd=ROOT, env=ENV, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "hfpfl run: fedavg, 2 rounds, seed 0"
    for key in ("  model      tiny-resnet (built-in config, random init)", "  dataset    usps", "  partition  iid",
                "  clients    2", "  parameters ", "trainable", "communicated"):
        assert any(key in ln for ln in lines[:8]), key
    rounds = [ln for ln in lines if ln.startswith("round ")]
    assert [r.split(" |")[0] for r in rounds] == ["round 1/2", "round 2/2"]
    assert all("train_loss" in r and "personal_acc" in r and "up " in r and "down " in r and r.endswith(" s")
               for r in rounds)
    assert "\r" not in out.stdout + out.stderr and "it/s" not in out.stderr  # no progress bars off a terminal
    for png in ("accuracy_curve.png", "client_accuracy.png"):
        assert (tmp_path / "o" / png).read_bytes()[:4] == b"\x89PNG"


def test_plots_one_round_bars_loss_chance_and_domains(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    from hfpfl import tracking

    calls = []
    for name in ("bar", "plot", "axhline", "set_xticks"):
        orig = getattr(Axes, name)
        monkeypatch.setattr(Axes, name, lambda self, *a, _o=orig, _n=name, **k: (calls.append((_n, a, k)),
                                                                                  _o(self, *a, **k))[1])
    one = [{"round": 1, "train_loss": 0.5, "global_accuracy": 0.4, "personal_accuracy": 0.6}]
    tracking.plot_curves(tmp_path, one, "x", num_labels=10)
    assert [c[0] for c in calls].count("bar") == 1 and not [c for c in calls if c[0] == "plot"]
    assert any(c[0] == "axhline" and c[1][0] == 0.1 for c in calls)
    calls.clear()
    many = one + [{"round": 2, "train_loss": 0.3, "global_accuracy": 0.5, "personal_accuracy": 0.7}]
    tracking.plot_curves(tmp_path, many, "x", num_labels=4)
    labels = [c[2].get("label") for c in calls if c[0] == "plot"]
    assert "train loss (right)" in labels and any(c[0] == "axhline" and c[1][0] == 0.25 for c in calls)
    calls.clear()
    tracking.plot_client_bars(tmp_path, {"0": 0.5, "1": 0.7}, domains={"0": "usps", "1": "mnistm"}, num_labels=10)
    ticks = [c for c in calls if c[0] == "set_xticks"][0][1][1]
    assert ticks == ["0\nusps", "1\nmnistm"]


def test_set_up_work_does_not_shift_the_runs_random_streams(tmp_path, monkeypatch):
    """A stand-in pretrained in the same process (here: a fake that draws from every global RNG) leaves the run's
    results exactly as a run whose backbone was already cached."""
    import random

    import numpy as np
    import torch

    from hfpfl.models import pretrained

    plain = _run([*SMALL, "--num_rounds", "1", "--output_dir", str(tmp_path / "a")])

    def fake_pretrain(*a, **k):
        torch.rand(1000), np.random.rand(100), random.random(), torch.nn.Linear(50, 50)
        return "tiny-resnet"

    monkeypatch.setattr(pretrained, "default_repo_id", lambda *a, **k: "tiny-resnet")
    monkeypatch.setattr(pretrained, "ensure_pretrained", fake_pretrain)
    shifted = _run([*SMALL, "--num_rounds", "1", "--output_dir", str(tmp_path / "b")])
    assert plain["final"] == shifted["final"]


def test_locally_published_repo_resolves_without_network(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from hfpfl import hub

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    hub.push_folder_to_cache(folder, "someone/local-only", cache_dir=tmp_path / "cache")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert not hub.is_offline()
    with hub.resolve_pretrained("someone/local-only", cache_dir=tmp_path / "cache") as kw:
        assert kw["local_files_only"] is True  # no Hub request at all
    assert hub.published_locally("hfpfl/anything", cache_dir=tmp_path / "cache") is False  # not cached: not local


def _fix_commands(text):
    import re
    return [c for c in re.findall(r"`([^`]+)`", text) if c.split()[0] in ("hf", "python", ".venv/bin/python")]


@pytest.mark.slow
def test_every_printed_fix_command_parses():
    """Commands printed in error messages (uncached dataset, uncached model, an interrupted run) exist as written:
    each one's --help runs and lists every option the command uses."""
    from hfpfl.data.hub_sources import hub_dataset_fix
    from hfpfl.hub import _fix_hint
    from hfpfl.runtime import resume_command

    commands = _fix_commands(hub_dataset_fix("flwrlabs/pacs")) + _fix_commands(_fix_hint("hfpfl/tiny-resnet-digits"))
    commands.append(resume_command(["--method", "fedbn", "--num_rounds", "3", "--output_dir", "x",
                                    "--overwrite_output_dir"], "outputs/fedbn-1", script="python recipes/run.py"))
    assert any(c.startswith("hf download") for c in commands) and len(commands) >= 4
    hf = Path(sys.executable).with_name("hf")
    for cmd in commands:
        words = cmd.split()
        if words[0] == "hf":
            argv = [str(hf), words[1], "--help"]
        else:
            argv = [sys.executable, words[1], "--help"]
        out = subprocess.run(argv, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, (cmd, out.stderr[-1000:])
        for flag in (w for w in words if w.startswith("--")):
            assert flag in out.stdout, (cmd, flag)
    assert "--overwrite_output_dir" not in commands[-1]


@pytest.mark.slow
def test_two_processes_share_one_default_output_dir(tmp_path):
    """The README's 2-process command without --output_dir: both processes agree on outputs/fedavg-<timestamp>."""
    env = {**ENV, **CPU_PROCESSES,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([*LAUNCH_TWO, str(ROOT / "recipes" / "fedavg.py"), *SMALL, "--num_rounds", "1"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = list((tmp_path / "outputs").iterdir())
    assert len(runs) == 1 and runs[0].name.startswith("fedavg-"), runs
    assert json.loads((runs[0] / "results.json").read_text())["world_size"] == 2
    assert out.stdout.count("hfpfl run: fedavg") == 1  # the header and round lines come from the main process only


def test_a_finished_program_closes_its_process_group_and_a_failed_one_does_not(monkeypatch):
    """``worker_exits`` (around every recipe's entry point): on success every process meets at a barrier and
    destroys the process group while the interpreter is alive (gloo's threads can abort a process left to exit with
    it); on failure nothing waits for the others; a call that is not the entry point (``close=False``) leaves it."""
    import torch.distributed as dist

    from hfpfl.cli import worker_exits
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: calls.append("barrier"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: calls.append("destroy"))
    with worker_exits([]):
        pass
    assert calls == ["barrier", "destroy"]
    calls.clear()
    with pytest.raises(ValueError):
        with worker_exits([]):
            raise ValueError("bad input")
    with worker_exits([], close=False):
        pass
    assert calls == []


LATE_FAILURE = """
import sys, time
import torch
import torch.distributed as dist
from hfpfl.cli import worker_exits
from hfpfl.launch import fork_workers

workers = []
with worker_exits(workers):
    workers.append(fork_workers(2))
    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(1))  # the last collective
    if workers[0].rank == 1:
        raise RuntimeError("rank 1 fails after the last collective")
    time.sleep(1)  # the main process reaches the closing barrier after rank 1 is gone
"""


@pytest.mark.slow
def test_a_worker_failing_after_the_last_collective_is_reported_by_its_exit_code(tmp_path):
    """The closing barrier meets a dead peer: the main process reports the worker's exit code in one line (as
    without the barrier), not gloo's connection error."""
    script = tmp_path / "late_failure.py"
    script.write_text(LATE_FAILURE)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr[-2000:]
    assert p.stderr.strip().splitlines()[-1] == "error: a worker process exited with code 1; see its output above"
    assert "Connection closed by peer" not in p.stderr
