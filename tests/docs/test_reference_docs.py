"""docs/reference/options.md is generated from the option dataclasses and is up to date."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_options_reference_is_generated_and_current():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "reference_docs.py"), "--check"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr


def test_options_reference_lists_every_method_and_run_option():
    # the registry is read in a fresh process: tests may register their own methods in this one
    code = ("from hfpfl.algorithms import REGISTRY, load_builtin_methods; from hfpfl.config import RunArguments; "
            "load_builtin_methods(); print(' '.join(sorted(REGISTRY))); print(' '.join(RunArguments.__dataclass_fields__))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    methods, run_options = (line.split() for line in out.stdout.strip().splitlines())
    page = (ROOT / "docs" / "reference" / "options.md").read_text()
    assert len(methods) >= 20
    for name in methods:
        assert f"`--method {name}`" in page, name
    for f in run_options:
        assert f"`--{f}`" in page, f
