"""Every entry point answers --help, and a user error exits with a one-line message (no traceback)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENTRY_POINTS = sorted(str(p.relative_to(ROOT)) for p in [*ROOT.glob("recipes/*.py"), *ROOT.glob("scripts/*.py")])
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.mark.parametrize("script", ENTRY_POINTS)
def test_help(script):
    out = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage" in out.stdout.lower() and "--" in out.stdout


def test_user_error_is_one_clear_line(tmp_path):
    out = subprocess.run([sys.executable, "recipes/run.py", "--method", "fedavgg", "--output_dir", str(tmp_path)],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert "unknown method 'fedavgg'" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run([sys.executable, "recipes/run.py", "--dataset", "nosuchdata", "--output_dir", str(tmp_path)],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "nosuchdata" in out.stderr and "Traceback" not in out.stderr
