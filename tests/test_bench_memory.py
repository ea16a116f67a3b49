"""The bench's process-tree memory sampler against a hand case: a parent that touches 200 MiB and forks a child that
writes nothing. RSS counts the shared pages once per process (about 400 MiB), PSS once (about 200 MiB)."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

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
    spec = importlib.util.spec_from_file_location("hfpfl_bench_simulator_mem", ROOT / "scripts" / "bench_simulator.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    proc = subprocess.Popen([sys.executable, "-c", CHILD])
    with bench.TreeMemory(proc.pid, 0.02, pss_every=0.1) as mem:
        proc.wait(timeout=60)
    assert proc.returncode == 0 and mem.samples > 10
    mib = 1 / 1024   # GiB per MiB
    assert 400 * mib <= mem.peak_rss_gb <= 460 * mib  # two processes, each with 200 MiB resident (+ interpreter)
    assert 200 * mib <= mem.peak_pss_gb <= 240 * mib  # the 200 MiB once
