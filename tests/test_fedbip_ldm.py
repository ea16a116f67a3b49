"""The tiny foundation LDM's pool and quality (DESIGN "honest stand-ins": measure it before measuring FedBiP on it)."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import hashlib  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def _hashes(images):
    return {hashlib.sha1(np.ascontiguousarray(im).tobytes()).hexdigest() for im in images}


def test_pool_shares_nothing_with_client_splits():
    """The pool's real images are public-split images: none is in a train or test split of the data seed clients use
    (the FedBiP recipe keeps data_seed 0), and no caption names a client domain."""
    from hfpfl.data.sources import load_source
    from hfpfl.fedbip.pool import POOL_SPLIT_SEED, STYLE_WORDS, build_pool

    pool = build_pool(0, copies=1, font_masks=50)
    pool_h = _hashes(pool["images"])
    for d in ("mnist", "usps", "mnistm", "syn"):
        for split in ("train", "test"):
            ds = load_source(d, split=split, seed=POOL_SPLIT_SEED).with_format(None)
            client_h = _hashes(np.asarray(im.convert("RGB"), dtype=np.uint8) for im in ds["image"])
            assert not (pool_h & client_h), (d, split)
    words = {w for c in pool["captions"] for w in c.split()}
    assert not words & {"usps", "mnistm", "syn", "mnist", "svhn"}
    assert {"public-usps", "public-mnistm", "public-syn", "photo-blend", "colored"} <= set(pool["styles"])
    assert all(len(v) >= 1 for v in STYLE_WORDS.values())


@pytest.mark.slow
@pytest.mark.xfail(strict=False, reason="issue 8: the broad-pool tiny LDM has not learned text conditioning at this CPU "
                   "budget (measured plain-prompt fidelity 0.09 at guidance 1 and 3; target >= 0.9)")
def test_pretrained_ldm_plain_prompt_fidelity():
    """The published tiny LDM renders the digit a plain prompt names: the judge (trained on the public pool, shipped
    in the snapshot) labels >= 80% of 40 plain-prompt images correctly (measured on 100/class at publishing).
    Needs the model in the local Hub cache (``python recipes/pretrain_ldm.py`` or one FedBiP run publishes it);
    ``HFPFL_TEST_PRETRAIN_LDM=1`` pretrains it here (minutes: too long for CI by default)."""
    from diffusers import StableDiffusionPipeline

    from hfpfl.fedbip.ldm import DEFAULT_LDM_REPO, cached_snapshot, ensure_pretrained_ldm
    from hfpfl.fedbip.quality import Judge, plain_prompt_fidelity

    if cached_snapshot(DEFAULT_LDM_REPO) is None and os.environ.get("HFPFL_TEST_PRETRAIN_LDM") != "1":
        pytest.skip(f"{DEFAULT_LDM_REPO} is not in the local Hub cache (set HFPFL_TEST_PRETRAIN_LDM=1 to pretrain)")
    path = ensure_pretrained_ldm(DEFAULT_LDM_REPO)
    pipe = StableDiffusionPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    judge = Judge()
    judge.load_state_dict(torch.load(os.path.join(path, "judge.pt")))
    judge.eval()
    acc, images, labels = plain_prompt_fidelity(pipe, judge, per_class=4, guidance_scale=3.0, seed=1)
    assert images.shape == (40, 3, 32, 32)
    assert acc >= 0.8
    for m in (pipe.unet, pipe.vae, pipe.text_encoder):
        assert not any(p.requires_grad for p in m.parameters()) or not m.training
