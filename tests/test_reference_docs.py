"""docs/reference/options.md is generated from the option dataclasses and is up to date."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_options_reference_is_generated_and_current():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "reference_docs.py"), "--check"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr


def test_options_reference_lists_every_method_and_run_option():
    from hfpfl.algorithms import REGISTRY, load_builtin_methods
    from hfpfl.config import RunArguments

    load_builtin_methods()
    page = (ROOT / "docs" / "reference" / "options.md").read_text()
    for name in REGISTRY:
        assert f"`--method {name}`" in page, name
    for f in RunArguments.__dataclass_fields__:
        assert f"`--{f}`" in page, f
