"""A redirected log (stdout and stderr to a file, as ``python recipes/fedbip.py > log.txt 2>&1``) holds hfpfl's own
lines and real warnings only: no library progress bars (diffusers' "Loading pipeline components...", transformers'
"Loading weights" / "Writing model shards", datasets' "Map:") and no "requires torchvision ... falling back" notice.
Each run writes to a file, so stderr is not a terminal there."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOISE = ("Loading pipeline components", "Loading weights", "Writing model shards", "Map", "torchvision", "\r")

# the loading paths of a FedBiP run, in the order a run meets them; "quiet": with hfpfl's logging set-up (and the LDM
# loaded by hfpfl's loader, as `recipes/run.py --method fedbip` does), "plain": the same library calls without it
LOADING_PATHS = textwrap.dedent("""
    import logging
    import sys

    ldm_dir, mode, tmp = sys.argv[1:4]
    if mode == "quiet":
        from hfpfl.logs import setup_logging
        setup_logging()
        from hfpfl.fedbip.method import load_ldm
        load_ldm(ldm_dir)
    else:
        from hfpfl.pipelines.pipeline_fedbip import FedBiPPipeline
        FedBiPPipeline.from_pretrained(ldm_dir)
    from diffusers import StableDiffusionPipeline  # noqa: F401  (imports transformers' CLIPImageProcessor)
    import datasets
    datasets.Dataset.from_dict({"x": list(range(64))}).map(lambda row: {"y": row["x"] + 1})
    from transformers import ResNetConfig, ResNetForImageClassification
    ResNetForImageClassification(ResNetConfig(hidden_sizes=[8], depths=[1], embedding_size=8)).save_pretrained(tmp)
    import transformers
    transformers.utils.logging.get_logger("transformers.modeling_utils").warning("a real transformers warning")
    print("hfpfl: done", flush=True)
""")


def _run_redirected(argv, log: Path, timeout=300, **env_extra) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": str(ROOT), **env_extra}
    env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    with open(log, "w") as f:
        proc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT), timeout=timeout)
    with open(log, newline="") as f:  # keep "\r": a progress bar redraws its line with it
        text = f.read()
    assert proc.returncode == 0, text[-3000:]
    return text


@pytest.fixture(scope="module")
def tiny_ldm_dir(tmp_path_factory):
    from hfpfl.fedbip import build_tiny_ldm
    from hfpfl.pipelines.pipeline_fedbip import FedBiPPipeline

    path = tmp_path_factory.mktemp("tiny_ldm")
    FedBiPPipeline(**build_tiny_ldm(image_size=16, seed=0)).save_pretrained(str(path))
    return str(path)


@pytest.mark.slow  # a subprocess that imports torch, transformers and peft/diffusers
def test_redirected_loading_paths_carry_no_library_noise(tiny_ldm_dir, tmp_path):
    """The loading paths of a FedBiP run (LDM pipeline, diffusers' Stable Diffusion import, a datasets map, a
    save_pretrained), redirected to a file: without hfpfl's set-up the log has every kind of noise (so the check can
    see it); with it, none -- and a real transformers warning still gets through (the filter is not a mute)."""
    plain = _run_redirected([sys.executable, "-c", LOADING_PATHS, tiny_ldm_dir, "plain", str(tmp_path / "a")],
                            tmp_path / "plain.log")
    for noise in NOISE:
        assert noise in plain, f"the unsilenced run shows no {noise!r}: the check below could not see it"
    quiet = _run_redirected([sys.executable, "-c", LOADING_PATHS, tiny_ldm_dir, "quiet", str(tmp_path / "b")],
                            tmp_path / "quiet.log")
    for noise in NOISE:
        assert noise not in quiet, (noise, quiet[-2000:])
    assert "a real transformers warning" in quiet and "hfpfl: done" in quiet


@pytest.mark.slow
def test_redirected_fedbip_recipe_log_is_plain_lines(tiny_ldm_dir, tmp_path):
    """``recipes/fedbip.py ... > log.txt 2>&1`` with the smallest settings that run (one variant on the tiny random
    LDM, 2 shots per class, 12x12 images, two processes): the log holds the run header, the round line and the
    table, and no library noise."""
    log = _run_redirected(
        [sys.executable, str(ROOT / "recipes" / "fedbip.py"), "--ldm", tiny_ldm_dir, "--output_dir",
         str(tmp_path / "out"), "--max_per_domain", "80", "--image_size", "12", "--test_fraction", "0.3",
         "--shots_per_class", "2", "--concept_steps", "2", "--num_inference_steps", "2", "--classifier_steps", "1",
         "--baseline_rounds", "1", "--variants", "prompt_only", "--num_processes", "2"], tmp_path / "log.txt",
        timeout=600)
    for noise in (*NOISE, "OMP_NUM_THREADS", "warnings.warn"):   # a forked worker's accelerate notice included
        assert noise not in log, (noise, log[-2000:])
    assert "round 1/1 |" in log and "prompt only" in log and "wall time" in log


def test_library_use_keeps_the_users_progress_bars(monkeypatch):
    """hfpfl imported as a library (a notebook: stderr is no terminal there either, and hfpfl's command-line set-up
    never ran) leaves the libraries' progress bars on where the user has them on."""
    import datasets
    import transformers.utils.logging

    from hfpfl import logs

    monkeypatch.setattr(logs, "_REDIRECTED_LOG", False)
    saved = (transformers.utils.logging.is_progress_bar_enabled(), datasets.is_progress_bar_enabled())
    transformers.utils.logging.enable_progress_bar()
    datasets.enable_progress_bars()
    try:
        assert logs.quiet_library_progress_bars(diffusers=False) is False
        assert transformers.utils.logging.is_progress_bar_enabled() and datasets.is_progress_bar_enabled()
    finally:  # leave the process as it was
        if not saved[0]:
            transformers.utils.logging.disable_progress_bar()
        if not saved[1]:
            datasets.disable_progress_bars()
