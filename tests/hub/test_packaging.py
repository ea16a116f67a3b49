"""What an install of hfpfl holds: the diffusers pipelines of the repository's top-level ``pipelines/`` folder as
``hfpfl.pipelines`` (pyproject.toml's package-dir, setup.py's package list), no top-level package of their own, and
the tiny LDM snapshot that ships as package data."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_non_editable_install_holds_hfpfl_pipelines_and_no_top_level_pipelines(tmp_path):
    pytest.importorskip("setuptools")  # the build backend, used without build isolation (offline)
    import shutil

    src, target = tmp_path / "src", tmp_path / "site"  # built from a copy: the build leaves build/ and egg-info
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "hfpfl", "pipelines"):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copyfile
        copy(ROOT / name, src / name, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                          if (ROOT / name).is_dir() else {}))
    build = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                            "--no-index", "--target", str(target), str(src)], capture_output=True, text=True,
                           cwd=tmp_path, env={**os.environ, "PIP_NO_INPUT": "1"})
    assert build.returncode == 0, build.stderr[-2000:]
    dist = next(target.glob("hfpfl-*.dist-info"))
    assert (dist / "top_level.txt").read_text().split() == ["hfpfl"]
    assert sorted(p.name for p in target.iterdir() if not p.name.endswith(".dist-info") and p.name != "bin") == \
        ["hfpfl"]
    assert (target / "hfpfl" / "pipelines" / "pipeline_fedbip.py").read_bytes() == \
        (ROOT / "pipelines" / "pipeline_fedbip.py").read_bytes()
    assert (target / "hfpfl" / "fedbip" / "snapshots" / "tiny-ldm-digits-broad" / "model_index.json").is_file()
    # imported from the install, in a folder that holds no checkout
    code = ("import hfpfl.pipelines as p, hfpfl.fedbip.publish as pub, os\n"
            "from hfpfl.pipelines import FedBiPPipeline\n"
            "print(p.__file__); print(FedBiPPipeline.__module__)\n"
            "print(os.path.isfile(os.path.join(pub.SHIPPED_LDM_DIRS[pub.DEFAULT_LDM_REPO], 'model_index.json')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(target), "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(target / "hfpfl" / "pipelines" / "__init__.py"), "hfpfl.pipelines.pipeline_fedbip",
                                  "True"]
