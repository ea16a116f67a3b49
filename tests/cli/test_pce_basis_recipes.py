"""recipes/fedpce.py and recipes/fedbasis.py end to end (tiny settings): two processes give the same results as one,
and results.json's bytes per client are exactly what the method sends (counted by hand from the parameter counts)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import CPU_PROCESSES, LAUNCH_TWO

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["--image_size", "16", "--num_rounds", "3", "--local_steps", "2", "--batch_size", "8",
          "--new_client_steps", "2", "--widths", "4,4,8,8", "--depths", "1,1,1,1", "--progress", "false",
          "--checkpoint_every", "0"]
RECIPES = {
    # 3 groups x (1 collaborative + 1 new) clients; the paper's noise / jitter levels
    "fedpce": ["--num_clients", "3", "--num_new_clients", "3", "--max_per_domain", "120", "--embedding_dim", "4",
               "--mlp_hidden", "8"],
    # 4 domains x (1 collaborative + 1 new); K = 2; 3 rounds = 1 warm-start round (k-means) + 2 FedBasis rounds
    "fedbasis": ["--num_clients", "1", "--num_new_clients", "1", "--max_per_domain", "60", "--num_bases", "2"],
}


def _in_process(recipe, out):
    """The one-process reference runs inside pytest (saves an interpreter start: imports dominate on a busy box)."""
    from conftest import load_script

    mod = load_script(f"recipes/{recipe}.py", f"_recipe_{recipe}")
    mod.main([*COMMON, *RECIPES[recipe], "--output_dir", str(out)])
    return json.loads((out / "results.json").read_text())


def _run(recipe, out, launcher):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.update(CPU_PROCESSES)
    cmd = launcher + [str(ROOT / "recipes" / f"{recipe}.py"), *COMMON, *RECIPES[recipe],
                                            "--output_dir", str(out)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return json.loads((out / "results.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["fedpce", "fedbasis"])
def test_two_processes_same_results_and_exact_bytes(tmp_path, recipe):
    # the reference on the CPU too (in a process of its own where pytest's process sees a GPU)
    one = (_run(recipe, tmp_path / "one", launcher=[sys.executable]) if torch.cuda.is_available()
           else _in_process(recipe, tmp_path / "one"))
    two = _run(recipe, tmp_path / "two", launcher=LAUNCH_TWO)
    assert one["world_size"] == 1 and two["world_size"] == 2
    for key in ("final", "per_client_accuracy", "new_client_accuracy", "communication", "parameters"):
        assert one[key] == two[key], key
    # bytes per client, by hand: every client takes part in each of the 3 rounds; float32 tensors
    g = one["parameters"]["global_state_elements"]
    per = one["communication"]["per_client"]
    assert len(per) == one["num_clients"]
    if recipe == "fedpce":
        assert one["parameters"]["private_state_elements"] == 4       # E = 4: the embedding alone stays home
        up = down = 3 * 4 * g
        assert set(one["communication"]["by_part"]) == {"model"}
        assert (tmp_path / "two" / "embeddings_pca.png").stat().st_size > 0
    else:
        assert one["parameters"]["private_state_elements"] == 5 * 2    # 5 groups x K coefficients
        up = 4 * (g // 3) + 2 * 4 * g      # warm round: the major basis v' alone (1 of K + 1 = 3); then all bases
        down = 3 * 4 * g                   # the server sends every basis each round
        assert 0 < one["final"]["alpha_entropy"] <= 1 and "basis_update_cosine" in one["final"]
    assert all(v == {"bytes_up": up, "bytes_down": down} for v in per.values()), (per, up, down)
