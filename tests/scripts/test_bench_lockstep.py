"""``scripts/bench_simulator.py --interleave``: the configurations' processes run their rounds in turn (round r of
each before round r + 1 of any, in turning order), checked with stand-in workers that log every round to one shared
file; a worker that dies is reported by its name instead of hanging the parent."""
import argparse
import os
import sys
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]

WORKER = """
import importlib.util, json, sys, time
spec = importlib.util.spec_from_file_location("bench", {bench!r})
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
name, log, fail_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
gate = bench.RoundGate(sys.argv[sys.argv.index("--lockstep") + 1])
time.sleep(0.3 if name == "A" else 0.0)  # B is ready first: the order must still be A's round, then B's
gate.done()
if fail_at == -2:  # dies between set-up and its first round: the parent's go may meet a closed pipe
    sys.exit("stand-in worker failed on purpose")
times = []
for r in range(3):
    gate.wait()
    if r == fail_at:
        sys.exit("stand-in worker failed on purpose")
    t = time.perf_counter()
    time.sleep(0.05 if name == "A" else 0.0)
    with open(log, "a") as f:
        f.write(f"{{name}}{{r}}\\n")
    times.append(time.perf_counter() - t)
    gate.done()
print(json.dumps({{"s_per_round": min(times), "round_s": times}}))
"""


def _bench():
    from conftest import load_script

    return load_script("scripts/bench_simulator.py", "hfpfl_bench_simulator_lockstep")


def _jobs(tmp_path, fail_b_at=-1):
    code = WORKER.format(bench=str(ROOT / "scripts" / "bench_simulator.py"))
    log = tmp_path / "rounds.log"
    return log, [(("A",), "A with 2 clients", [sys.executable, "-c", code, "A", str(log), "-1"], dict(os.environ)),
                 (("B",), "B with 2 clients", [sys.executable, "-c", code, "B", str(log), str(fail_b_at)],
                  dict(os.environ))]


@pytest.mark.skipif(sys.platform == "win32", reason="pass_fds needs POSIX")
def test_interleaved_configurations_take_turns_round_by_round(tmp_path):
    bench = _bench()
    log, jobs = _jobs(tmp_path)
    out = bench.run_interleaved(jobs, argparse.Namespace(rounds=3, mem_sample_ms=0))
    # round by round, the order turning each round (each configuration goes first in half of them)
    assert log.read_text().split() == ["A0", "B0", "B1", "A1", "A2", "B2"]
    (ra, mem_a), (rb, _) = out
    assert mem_a is None and len(ra["round_s"]) == len(rb["round_s"]) == 3
    assert min(ra["round_s"]) >= 0.05 > max(rb["round_s"])  # each result is its own worker's


@pytest.mark.skipif(sys.platform == "win32", reason="pass_fds needs POSIX")
def test_a_worker_that_dies_mid_run_is_named_not_waited_for(tmp_path):
    bench = _bench()
    log, jobs = _jobs(tmp_path, fail_b_at=1)
    before = {c.pid for c in psutil.Process().children(recursive=True)}  # psutil: accelerate's dependency
    with pytest.raises(SystemExit) as e:
        bench.run_interleaved(jobs, argparse.Namespace(rounds=3, mem_sample_ms=0))
    assert "B with 2 clients failed" in str(e.value) and "failed on purpose" in str(e.value)
    assert log.read_text().split() == ["A0", "B0"]  # round 1 starts with B, which dies
    left = [c for c in psutil.Process().children(recursive=True)
            if c.pid not in before and c.status() != psutil.STATUS_ZOMBIE]
    assert not left  # A, waiting for its next round when B died, was not left running


@pytest.mark.skipif(sys.platform == "win32", reason="pass_fds needs POSIX")
def test_a_worker_that_dies_before_its_first_round_is_named(tmp_path):
    bench = _bench()
    log, jobs = _jobs(tmp_path, fail_b_at=-2)
    with pytest.raises(SystemExit) as e:
        bench.run_interleaved(jobs, argparse.Namespace(rounds=3, mem_sample_ms=0))
    assert "B with 2 clients failed" in str(e.value) and "failed on purpose" in str(e.value)
    assert log.read_text().split() == ["A0"]


def test_interleave_refuses_multi_process_configurations():
    import subprocess
    out = subprocess.run([sys.executable, "scripts/bench_simulator.py", "--interleave", "--parallel", "1", "p2",
                          "--clients", "2", "--device", "cpu"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--interleave: p2" in out.stderr, out.stderr[-500:]
    assert out.stdout == ""  # refused before any configuration ran or any header was printed
