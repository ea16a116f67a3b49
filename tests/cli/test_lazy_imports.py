"""The imports the library keeps inside functions, and why: each module below is imported by something that must stay
light (a recipe parsing its options, a process that only builds data), so the heavy libraries it needs for one job
load on first use. A fresh interpreter imports the module and lists which of them it loaded: none may appear."""
import os
import subprocess
import sys

import pytest


def _loaded(modules: str, heavy: tuple[str, ...]) -> str:
    code = f"import sys, {modules}\nprint([m for m in {heavy!r} if m in sys.modules])"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env.pop("PYTHONSTARTUP", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.splitlines()[-1]


@pytest.mark.parametrize("modules, heavy", [
    # the training loop is torch only: Arrow is for a datasets split (TensorData.from_dataset)
    ("hfpfl.training", ("pyarrow", "datasets")),
    # the data package draws and edits images only when a source is built: PIL, scikit-image's photos, scikit-learn's
    # fallback (seconds), scipy.ndimage (0.4 s), fontTools and the easy-vqa package load then
    ("hfpfl.data, hfpfl.data.vqa, hfpfl.data.ood, hfpfl.data.benchmarks",
     ("PIL", "skimage", "sklearn", "scipy.ndimage", "fontTools", "easy_vqa")),
    # recipes read the VQA backbones' names while parsing options: no model code, peft, datasets or accelerate then
    ("hfpfl.models.vqa", ("hfpfl.models.builders", "transformers.modeling_utils", "peft", "datasets", "accelerate",
                          "hfpfl.data.vqa")),
])
def test_heavy_libraries_load_on_first_use(modules, heavy):
    assert _loaded(modules, heavy) == "[]"
