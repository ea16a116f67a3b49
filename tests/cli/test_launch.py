"""``--num_processes auto|N``: a recipe started with plain python launches itself in N processes (same numbers)."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hfpfl import launch
from hfpfl.config import RunArguments

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--num_clients", "4", "--max_per_domain", "100", "--image_size", "16", "--batch_size", "16",
         "--progress", "false"]


def test_auto_counts_idle_cores_gpus_and_clients():
    assert launch.resolve("3") == 3
    assert launch.resolve("auto", cores=2, busy=0.1, gpus=0) == 2      # an idle 2-core box: both cores
    assert launch.resolve("auto", cores=2, busy=1.2, gpus=0) == 1      # the second core busy: one process
    assert launch.resolve("auto", cores=2, busy=3.0, gpus=0) == 1      # never below one
    assert launch.resolve("auto", 3, cores=16, busy=0.0, gpus=0) == 3  # at most one per client trained per round
    assert launch.resolve("auto", 20, cores=16, busy=0.0, gpus=4) == 4  # one per GPU
    with pytest.raises(ValueError, match="--num_processes must be auto or a whole number >= 1"):
        RunArguments(num_processes="two")
    with pytest.raises(ValueError, match="--num_processes"):
        launch.resolve("0")


def test_auto_uses_more_processes_only_where_it_pays():
    """``decide`` (the default ``--num_processes auto``): hand-checked cases of its rule."""
    d = launch.decide
    assert launch.DEFAULT_NUM_PROCESSES == "auto" and launch.MIN_CLIENT_UPDATES == 20
    assert d("3", 4, 2, cores=2, busy=5.0, gpus=0) == (3, "set by --num_processes")   # a number is never second-guessed
    assert d("auto", 8, 10, cores=2, busy=0.3, gpus=0)[0] == 2       # the README default (8 x 10) on an idle 2-core box
    assert d("auto", 8, 10, cores=2, busy=1.6, gpus=0)[0] == 1       # round(2 - 1.6) = 0 idle cores
    assert d("auto", 8, 10, cores=2, busy=1.4, gpus=0)[0] == 1       # round(0.6) = 1 idle core: one process
    assert d("auto", 8, 10, cores=4, busy=1.4, gpus=0)[0] == 3       # round(2.6) = 3
    assert d("auto", 3, 10, cores=16, busy=0.0, gpus=0)[0] == 3      # at most one per client per round
    assert d("auto", 1, 50, cores=16, busy=0.0, gpus=0)[0] == 1      # one client per round: nothing to share
    assert d("auto", 20, 10, cores=16, busy=0.0, gpus=4)[0] == 4     # one per GPU, whatever the cores
    n, why = d("auto", 4, 4, cores=2, busy=0.0, gpus=0)             # 16 client updates < 20: start-up would not pay
    assert n == 1 and "4 clients x 4 rounds = 16 client updates < 20" in why and "2 idle cores" in why
    assert d("auto", 4, 5, cores=2, busy=0.0, gpus=0)[0] == 2        # 20 updates: it pays
    assert d("auto", 4, 2, cores=2, busy=0.0, gpus=0)[0] == 1        # the README's first run (4 x 2) stays in one
    assert d("auto", 500, 3, cores=2, busy=0.2, gpus=0) == (2, "2 idle cores (2 usable, 0.20 busy), 500 clients x 3 rounds")
    # a method's heavier client updates (FedBiP: concept training + synthesis, update cost 100): 3 clients x 1 round
    assert d("auto", 3, 1, cores=2, busy=0.2, gpus=0)[0] == 1                     # 3 small updates: one process
    assert d("auto", 3, 1, cores=2, busy=0.2, gpus=0, update_cost=100) == (
        2, "2 idle cores (2 usable, 0.20 busy), 3 clients x 1 rounds x 100 (update cost)")
    assert d("auto", 3, 1, cores=2, busy=0.2, gpus=0, update_cost=5)[0] == 1       # 15 < 20
    from hfpfl.algorithms import get_algorithm
    assert get_algorithm("fedbip").client_update_cost == 100 and get_algorithm("fedavg").client_update_cost == 1
    with pytest.raises(ValueError, match="--num_processes must be auto or a whole number >= 1"):
        d("0", 4, 5, cores=2, busy=0.0, gpus=0)


SPIN = "import time\nend = time.time() + 30\nwhile time.time() < end:\n    pass\n"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pins the spinner to one CPU (Linux)")
def test_busy_cores_counts_work_running_now():
    """``busy_cores`` watches the CPUs over its window: a child spinning on one of this process's CPUs counts as
    (nearly) one busy core, whatever the load average says (a 1-minute average barely moves in a second). Other
    work on a shared box can only add to the reading, so the test bounds it from below; that this process, asleep
    while it watches, adds nothing is not something a test on a shared box can bound from above."""
    cpu = sorted(os.sched_getaffinity(0))[0]
    child = subprocess.Popen([sys.executable, "-c", SPIN], preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    try:
        time.sleep(0.3)                                   # the spinner is running
        assert launch.busy_cores(window=0.5) >= 0.8
    finally:
        child.kill()
        child.wait()
    m = launch.machine(measure_busy=False)
    assert m["busy"] == 0.0 and m["cores"] == launch.usable_cores()


def test_busy_cores_are_measured_only_where_they_can_change_the_answer(monkeypatch):
    """``_processes_to_launch`` watches the CPUs (half a second) only for a run that could use several processes:
    the README's first run (4 clients x 2 rounds) never does; a long run does, and with the second core busy it runs
    in one process."""
    from hfpfl.cli import _processes_to_launch
    from hfpfl.arguments import parse_run_args
    for k in ("LOCAL_RANK", "HFPFL_NUM_PROCESSES", *launch._ACCELERATE_LAUNCH_VARS):
        monkeypatch.delenv(k, raising=False)
    calls = []
    monkeypatch.setattr(launch, "usable_cores", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a 2-core CPU box also on a GPU machine
    monkeypatch.setattr(launch, "busy_cores", lambda window=launch.BUSY_WINDOW_S: calls.append(window) or 1.0)
    run, data, _ = parse_run_args(["--num_clients", "4", "--num_rounds", "2"])
    assert _processes_to_launch(run, data) == 1 and calls == []                    # a short run: not watched
    run, data, _ = parse_run_args(["--num_clients", "8", "--num_rounds", "10"])
    assert _processes_to_launch(run, data) == 1 and calls == [launch.BUSY_WINDOW_S]  # watched once: 1 core busy
    monkeypatch.setattr(launch, "busy_cores", lambda window=launch.BUSY_WINDOW_S: 0.1)
    assert _processes_to_launch(run, data) == 2                                       # both idle: two processes


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
    from hfpfl.arguments import parse_run_args
    for k in ("LOCAL_RANK", *launch._ACCELERATE_LAUNCH_VARS):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.delenv("HFPFL_NUM_PROCESSES", raising=False)
    run, data, _ = parse_run_args(["--num_clients", "8"])
    assert run.num_processes == launch.DEFAULT_NUM_PROCESSES == "auto"
    monkeypatch.setattr(launch, "machine", lambda measure_busy=True: {"cores": 2, "busy": 0.0, "gpus": 0})
    assert _processes_to_launch(run, data) == 2                                 # 8 clients x 10 rounds, 2 idle cores
    assert _processes_to_launch(run, data, top_level=False) == 1                # called from Python: this process
    with pytest.raises(ValueError, match="--num_processes: a recipe called from Python runs in this process"):
        _processes_to_launch(parse_run_args(["--num_processes", "2"])[0], data, top_level=False)
    run, data, _ = parse_run_args(["--num_clients", "4", "--num_rounds", "2"])
    assert _processes_to_launch(run, data) == 1                                 # a short run stays in one process
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


@pytest.mark.slow
@pytest.mark.skipif(launch.usable_cores() < 2, reason="one core: auto always runs one process")
def test_default_launches_what_the_rule_says(tmp_path):
    """The default (HFPFL_NUM_PROCESSES unset) on a run long enough to pay (12 clients x 2 rounds): the one line it
    prints holds the inputs of ``decide`` (cores, busy cores); the run used exactly the processes the rule gives for them
    (2 where the second core was idle when it started, else 1; this shared box decides which)."""
    import re
    env = {k: v for k, v in os.environ.items() if k != "HFPFL_NUM_PROCESSES"}
    out = tmp_path / "auto"
    p = subprocess.run([sys.executable, str(ROOT / "recipes" / "run.py"), "--num_clients", "12", "--max_per_domain",
                        "60", "--image_size", "16", "--batch_size", "16", "--num_rounds", "2", "--checkpoint_every",
                        "0", "--progress", "false", "--output_dir", str(out)],
                       env={**env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""},
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("using ")]
    assert len(lines) == 1, p.stdout[:2000]                      # one line, printed once (not by every process)
    m = re.match(r"using (\d+) process(?:es)?: \d+ idle cores? \((\d+) usable, ([\d.]+) busy\)", lines[0])
    assert m, lines[0]
    n, cores, busy = int(m[1]), int(m[2]), float(m[3])
    assert (n, lines[0]) == (launch.decide("auto", 12, 2, cores=cores, busy=busy, gpus=0)[0],
                             f"using {n} process{'es' if n > 1 else ''}: "
                             f"{launch.decide('auto', 12, 2, cores=cores, busy=busy, gpus=0)[1]}; set --num_processes "
                             f"{'1 to disable' if n > 1 else 'N to force N'}")
    assert json.loads((out / "results.json").read_text())["world_size"] == n
    assert p.stdout.count("results: ") == 1


RECEIVING = '''
import json, os
from hfpfl.algorithms import register
from hfpfl.algorithms.fedavg import FedAvg
from hfpfl.cli import run_recipe


@register
class ReceivingFedAvg(FedAvg):
    """FedAvg that records, per upload, which process did the server's per-upload work (``receive``)."""
    name = "receiving_fedavg"
    aggregation = "gather"

    def receive(self, upd, round_idx):
        upd.received["process"] = self.ctx.process_index

    def aggregate(self, server_state, updates, round_idx):
        seen = {u.client_id: u.received["process"] for u in updates}
        with open(os.path.join(self.ctx.output_dir, f"received_{round_idx}.json"), "w") as f:
            json.dump(seen, f)
        return super().aggregate(server_state, updates, round_idx)


if __name__ == "__main__":
    run_recipe()
'''


@pytest.mark.slow
def test_receive_runs_where_each_upload_is_once_and_changes_no_numbers(tmp_path):
    """``Algorithm.receive`` (per-upload server work, e.g. FedBiP's synthesis) is spread over the processes: with
    two, each process receives the uploads of the clients it holds, every upload exactly once; same numbers."""
    script = tmp_path / "receiving.py"
    script.write_text(RECEIVING)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    for k in ("LOCAL_RANK", "ACCELERATE_MIXED_PRECISION", "WORLD_SIZE"):
        env.pop(k, None)
    results = {}
    for n in ("1", "2"):
        out = tmp_path / n
        proc = subprocess.run([sys.executable, str(script), *SMALL, "--method", "receiving_fedavg", "--num_rounds", "2",
                               "--checkpoint_every", "0", "--num_processes", n, "--output_dir", str(out)],
                              env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        results[n] = json.loads((out / "results.json").read_text())
        for r in (1, 2):  # rounds count from 1
            seen = json.loads((out / f"received_{r}.json").read_text())
            assert sorted(seen) == ["0", "1", "2", "3"]  # every sampled upload, once
            assert set(seen.values()) == ({0} if n == "1" else {0, 1})  # two processes: both did server work
    assert results["2"]["world_size"] == 2
    assert results["1"]["final"] == results["2"]["final"]
    assert results["1"]["communication"]["bytes_up"] == results["2"]["communication"]["bytes_up"]  # nothing added


THREADS = '''
import json, os
import psutil
import torch
from hfpfl.algorithms import register
from hfpfl.algorithms.fedavg import FedAvg
from hfpfl.cli import run_recipe

psutil.cpu_count = lambda logical=True: 16  # as on a 16-core machine (accelerate sizes its CPU thread pools from it)


@register
class CountingFedAvg(FedAvg):
    """FedAvg that records how many torch threads each process trains with."""
    name = "counting_fedavg"
    local_update = "own"

    def client_update(self, client_id, down, private, round_idx):
        rank = self.ctx.process_index
        with open(os.path.join(self.ctx.output_dir, f"threads_{rank}.json"), "w") as f:
            json.dump(torch.get_num_threads(), f)
        return super().client_update(client_id, down, private, round_idx)


if __name__ == "__main__":
    run_recipe()
'''


@pytest.mark.slow
def test_processes_train_with_the_threads_asked_for_on_a_many_core_machine(tmp_path):
    """``--num_threads`` holds in every process of a ``--num_processes`` run: accelerate's multi-CPU state sets
    torch's thread pool to physical cores / processes when OMP_NUM_THREADS is unset (8 threads each on a 16-core
    machine), which made a 2-process run's floats differ from a 1-process run's there (seen on a 16-core box)."""
    script = tmp_path / "counting.py"
    script.write_text(THREADS)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    for k in ("LOCAL_RANK", "ACCELERATE_MIXED_PRECISION", "WORLD_SIZE", "OMP_NUM_THREADS"):
        env.pop(k, None)
    for threads in ("1", "2"):
        out = tmp_path / threads
        proc = subprocess.run([sys.executable, str(script), *SMALL, "--method", "counting_fedavg", "--num_rounds", "1",
                               "--checkpoint_every", "0", "--num_processes", "2", "--num_threads", threads,
                               "--output_dir", str(out)], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert json.loads((out / "results.json").read_text())["world_size"] == 2
        assert [json.loads((out / f"threads_{r}.json").read_text()) for r in (0, 1)] == [int(threads)] * 2
