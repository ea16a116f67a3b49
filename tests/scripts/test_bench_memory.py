"""The bench's process-tree memory sampler against a hand case: a parent that touches 200 MiB and forks a child that
writes nothing. RSS counts the shared pages once per process (about 400 MiB), PSS once (about 200 MiB). And the
benchmarks remove the folders their runs write."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import os, time
b = b"x" * (200 << 20)          # 200 MiB, every page written
pid = os.fork()
time.sleep(2.5)                 # parent and child both hold the pages; the child writes none
if pid:
    os.waitpid(pid, 0)
"""


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux /proc smaps_rollup")
def test_tree_memory_counts_shared_pages_once_in_pss():
    from conftest import load_script

    bench = load_script("scripts/bench_simulator.py", "hfpfl_bench_simulator_mem")
    proc = subprocess.Popen([sys.executable, "-c", CHILD])
    with bench.TreeMemory(proc.pid, 0.02, pss_every=0.1) as mem:
        proc.wait(timeout=60)
    assert proc.returncode == 0 and mem.samples > 10
    mib = 1 / 1024   # GiB per MiB
    assert 400 * mib <= mem.peak_rss_gb <= 460 * mib  # two processes, each with 200 MiB resident (+ interpreter)
    assert 200 * mib <= mem.peak_pss_gb <= 240 * mib  # the 200 MiB once


@pytest.mark.slow
@pytest.mark.parametrize("script, args", [
    ("bench_simulator.py", ["--clients", "4", "--model", "mlp", "--rounds", "1", "--only", "hfpfl",
                            "--vectorize", "off", "--mem_sample_ms", "0"]),
    ("bench_scale_memory.py", ["--clients", "4", "--distinct", "4"]),
])
def test_benchmarks_leave_no_run_folders_behind(tmp_path, script, args):
    """Each benchmark run wrote its results, checkpoints and spilled client states into a temporary folder it never
    removed: ~800 MB left in /tmp by every 10,000-client scale run."""
    env = {**os.environ, "TMPDIR": str(tmp_path), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "load average" in out.stdout.splitlines()[-1]  # it ran to the end
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("hfpfl")] == []  # (torch may keep its own cache)
