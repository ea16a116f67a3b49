"""The tiny LDM shipped with hfpfl, published into the local Hub cache on first use (through :mod:`hfpfl.hub`), so
that ``StableDiffusionPipeline.from_pretrained(DEFAULT_LDM_REPO)`` and ``FedBiPPipeline.from_pretrained`` load it
offline like ``CompVis/stable-diffusion-v1-4``. Pretraining one here is the recipe's job (``recipes/pretrain_ldm.py``,
:mod:`hfpfl.fedbip.pretraining`); what is cached is checked against the recipe version and the shipped fingerprint.
"""

from __future__ import annotations

import json
import os
import tempfile

from ..hub import ensure_published, push_folder_to_cache

# v2: broad pool + fixed BPE tokenizer; a new id so that caches holding the MNIST-only v1 model are not reused
DEFAULT_LDM_REPO = "hfpfl/tiny-ldm-digits-broad"
# The pretraining recipe's version, written to the snapshot's pretrain_stats.json: a cached copy of an older recipe
# is retrained on first use. 3: LiT-pretrained frozen text tower + the UNet's global text path. 4: VAE
# posterior log-variance initialised at -8, 400 VAE steps of 32, 3,000 UNet steps of 32 with warm-up, a fidelity
# curve during training.
LDM_RECIPE_VERSION = 4


def snapshot_recipe_version(path: str) -> int | None:
    """``recipe_version`` of a pretrained tiny-LDM snapshot (None for snapshots older than version 3)."""
    try:
        with open(os.path.join(path, "pretrain_stats.json")) as f:
            return json.load(f).get("recipe_version")
    except (OSError, ValueError):
        return None


# The default repo id ships with the package: made once by ``recipes/pretrain_ldm.py --device cuda`` on one
# H100 (the accelerator budget: plain-prompt fidelity ~0.9), stored as float16 safetensors (2.6 MB with the judge).
# Two CPU cores cannot reach that quality in the first-run budget (the CPU recipe: ~31 min, fidelity 0.43 at guidance
# 3), so a first run publishes this snapshot, as a user of Stable Diffusion downloads its checkpoint.
SHIPPED_LDM_DIRS = {DEFAULT_LDM_REPO: os.path.join(os.path.dirname(__file__), "snapshots", "tiny-ldm-digits-broad")}


# Written into a published copy of a shipped snapshot: the shipped folder's fingerprint, so that a cache published by
# an older hfpfl (other shipped weights, same recipe version) is replaced, and a snapshot the user pretrained here
# (no marker) is kept.
SHIPPED_MARKER = "shipped_from.json"


def shipped_fingerprint(src: str) -> str:
    """sha256 over the relative paths and bytes of every file under a shipped snapshot folder (~3 MB: milliseconds)."""
    import hashlib

    h = hashlib.sha256()
    for root, dirs, names in sorted(os.walk(src)):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(root, name)
            h.update(os.path.relpath(path, src).replace(os.sep, "/").encode() + b"\0")
            with open(path, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def published_fingerprint(path: str) -> str | None:
    """The shipped fingerprint a cached snapshot was published from, or None (pretrained here, or an older hfpfl)."""
    try:
        with open(os.path.join(path, SHIPPED_MARKER)) as f:
            return json.load(f).get("fingerprint")
    except (OSError, ValueError):
        return None


def publish_shipped_ldm(repo_id: str = DEFAULT_LDM_REPO, cache_dir=None, log=print) -> str:
    """Publish the snapshot shipped with hfpfl for ``repo_id`` into the local Hub cache, its float16 weights upcast to
    float32 (what ``save_pretrained`` of the trained float32 model wrote), and return the snapshot path."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = SHIPPED_LDM_DIRS[repo_id]
    with tempfile.TemporaryDirectory(prefix="hfpfl_shipped_ldm_") as tmp:
        folder = os.path.join(tmp, "snapshot")
        shutil.copytree(src, folder)
        for root, _, names in os.walk(folder):
            for name in names:
                if name.endswith(".safetensors"):
                    path = os.path.join(root, name)
                    tensors = load_file(path)
                    save_file({k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}, path,
                              metadata={"format": "pt"})
        with open(os.path.join(folder, SHIPPED_MARKER), "w") as f:
            json.dump({"fingerprint": shipped_fingerprint(src), "source": "the snapshot shipped with hfpfl",
                        "stored_as": "float16, upcast to float32 when published"}, f, indent=1)
        snap = push_folder_to_cache(folder, repo_id, cache_dir=cache_dir)
    log(f"[ldm] published the snapshot shipped with hfpfl ({src}; pretrained on an accelerator, see its README.md) "
        f"as {repo_id} -> {snap}; retrain it with recipes/pretrain_ldm.py --force")
    return str(snap)



def stale_reason(repo_id: str, path: str) -> str | None:
    """Why a cached snapshot of ``repo_id`` must be replaced, or None when it is current: a copy of the default repo id
    of an older recipe, or one published from a shipped snapshot other than this hfpfl's (a snapshot pretrained here
    carries no marker and is kept)."""
    if repo_id != DEFAULT_LDM_REPO:
        return None
    if snapshot_recipe_version(path) != LDM_RECIPE_VERSION:
        return f"is of recipe version {snapshot_recipe_version(path)}, not {LDM_RECIPE_VERSION}"
    shipped = published_fingerprint(path)
    src = SHIPPED_LDM_DIRS.get(repo_id)
    if shipped is not None and src and os.path.isfile(os.path.join(src, "model_index.json")) and \
            shipped != shipped_fingerprint(src):
        return "was published from another hfpfl's shipped snapshot"
    return None


def ensure_pretrained_ldm(repo_id: str = DEFAULT_LDM_REPO, cache_dir=None, log=print) -> str:
    """The local snapshot path of the pretrained tiny LDM ``repo_id``. If it is not cached (or a cached copy is stale,
    :func:`stale_reason`), the snapshot shipped with hfpfl for ``repo_id`` is published into the local Hub cache
    first. A repo id nothing ships for (or an install without the package data) is pretrained by the recipe,
    ``recipes/pretrain_ldm.py``: the error says so."""
    def publish():
        src = SHIPPED_LDM_DIRS.get(repo_id)
        if src is None or not os.path.isfile(os.path.join(src, "model_index.json")):
            where = (f"the snapshot shipped for it is missing ({src}): reinstall hfpfl with its package data "
                     "(pip install -e . in the repository), or" if src else "no snapshot ships with hfpfl for it:")
            raise OSError(f"LDM {repo_id!r} is not in the local Hub cache and {where} pretrain it with "
                          f"python recipes/pretrain_ldm.py --repo_id {repo_id} (about 30 min on 2 CPU cores)")
        return publish_shipped_ldm(repo_id, cache_dir, log=log)

    return ensure_published(repo_id, publish, stale=lambda path: stale_reason(repo_id, path), cache_dir=cache_dir,
                            required_file="model_index.json", log=log)
