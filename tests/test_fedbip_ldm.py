"""Tiny-LDM pretraining for FedBiP (hfpfl/fedbip/ldm.py): captions, CFG prompt dropout, augmentations, a few real
pretraining steps, and the local Hub cache being reused / invalidated by the config fingerprint. No full pretraining."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from hfpfl.fedbip import ldm  # noqa: E402
from hfpfl.fedbip.ldm import (  # noqa: E402
    AUGMENTATIONS,
    DIGIT_NAMES,
    INFO_FILE,
    PretrainConfig,
    augment_digits,
    build_tiny_ldm,
    caption_table,
    ensure_pretrained_ldm,
    ldm_fingerprint,
    sample_caption_ids,
)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def comps():
    return build_tiny_ldm(seed=0)


def test_model_has_text_conditioning_paths(comps):
    unet = comps["unet"]
    assert unet.config.addition_embed_type == "text"  # pooled prompt -> timestep embedding
    assert all(t.startswith("CrossAttn") for t in unet.config.down_block_types)
    assert unet.config.cross_attention_dim == comps["text_encoder"].config.hidden_size == 64
    z = torch.randn(2, 4, 8, 8)
    h1, h2 = torch.randn(2, 16, 64), torch.randn(2, 16, 64)
    with torch.no_grad():
        assert not torch.allclose(unet(z, 500, h1).sample, unet(z, 500, h2).sample)


def test_captions_name_the_digit_and_cfg_dropout_rate(comps):
    tok = comps["tokenizer"]
    tables = caption_table(tok)
    clean, aug, empty, (clean_caps, aug_caps) = tables
    assert clean.shape[1] == 10 and aug.shape[1:3] == (len(AUGMENTATIONS), 10)
    assert any(row[7] == "a photo of the digit seven" for row in clean_caps)
    assert any(row[3] == "a handwritten style of a three" for row in clean_caps)  # the FedBiP template, real words
    digit_ids = torch.tensor([tok.convert_tokens_to_ids(w + "</w>") for w in DIGIT_NAMES])
    aug_word_ids = torch.tensor([tok.convert_tokens_to_ids(w + "</w>") for w in AUGMENTATIONS])
    assert tok.unk_token_id not in digit_ids.tolist() + aug_word_ids.tolist()  # all single tokens
    g = torch.Generator().manual_seed(0)
    n = 20000
    y = torch.randint(0, 10, (n,), generator=g)
    kinds = torch.randint(0, len(AUGMENTATIONS), (n,), generator=g)
    use_aug = torch.rand(n, generator=g) < 0.3
    for rate in (0.1, 0.5):
        ids, drop = sample_caption_ids(tables, y, kinds, use_aug, rate, torch.Generator().manual_seed(1))
        assert abs(drop.float().mean().item() - rate) < 0.015
        assert (ids[drop] == empty).all()
        kept = ~drop
        # every kept caption contains its own digit word and no other digit word
        has = (ids[kept][:, :, None] == digit_ids[None, None]).any(1)
        assert torch.equal(has.float().argmax(1), y[kept]) and (has.sum(1) == 1).all()
        # augmented captions name their style
        m = kept & use_aug
        assert (ids[m] == aug_word_ids[kinds[m]][:, None]).any(1).all()
    ids0, drop0 = sample_caption_ids(tables, y[:100], kinds[:100], use_aug[:100], 0.0)
    assert not drop0.any()


def test_augmentations_shape_range_and_effect():
    x = torch.full((10, 3, 32, 32), -1.0)
    x[:, :, 10:22, 14:18] = 1.0  # a bar "digit"
    kinds = torch.arange(10) % len(AUGMENTATIONS)
    xa = augment_digits(x, kinds, torch.Generator().manual_seed(0))
    assert xa.shape == x.shape and xa.min() >= -1 and xa.max() <= 1
    for k, name in enumerate(AUGMENTATIONS):
        assert not torch.allclose(xa[k], x[k]), name
    assert torch.allclose(xa[AUGMENTATIONS.index("inverted")], -x[0])
    bold = xa[AUGMENTATIONS.index("bold")]
    assert (bold > 0).sum() > (x[0] > 0).sum()


def test_few_pretraining_steps_lower_the_denoising_loss():
    """A real (tiny) run of pretrain_tiny_ldm: 200 digits, a few VAE and UNet steps; the held-out-noise denoising
    loss of the trained UNet is below that of the same initial weights."""
    from diffusers import DDPMScheduler

    cfg = PretrainConfig(max_images=200, vae_steps=6, vae_batch_size=16, unet_steps=40, unet_batch_size=16,
                         unet_lr=3e-3, unet_warmup_steps=5, time_budget_s=None, ema_decay=0.9)
    trained, stats = ldm.pretrain_tiny_ldm(cfg, log=lambda *a: None)
    assert stats["unet_steps"] == 40 and stats["n_images"] == 200
    assert 0.0 < stats["cond_dropout_rate"] < 0.25 and 0.1 < stats["augment_rate"] < 0.5
    init = build_tiny_ldm(seed=cfg.seed)
    imgs, labels, _ = ldm.load_public_digits(64, seed=1, splits=("test",))
    x = ldm.digits_to_tensor(imgs)
    vae = trained["vae"]
    ns = DDPMScheduler.from_config(trained["scheduler"].config)
    g = torch.Generator().manual_seed(123)
    with torch.no_grad():
        z0 = vae.encode(x).latent_dist.mean * vae.config.scaling_factor
        t = torch.randint(0, 1000, (len(x),), generator=g)
        eps = torch.randn(z0.shape, generator=g)
        zt = ns.add_noise(z0, eps, t)
        tok = trained["tokenizer"]
        ids = tok([ldm.digit_prompt(int(c)) for c in labels], padding="max_length",
                  max_length=tok.model_max_length, return_tensors="pt").input_ids

        def loss(c):
            return torch.nn.functional.mse_loss(c["unet"](zt, t, c["text_encoder"](ids)[0]).sample, eps).item()

        before, after = loss(init), loss(trained)
    assert after < 0.8 * before, (before, after)


def test_cache_reused_and_invalidated_by_config(tmp_path, monkeypatch):
    calls = []

    def fake_pretrain(cfg=None, log=print):  # no training: the cache logic is what is tested here
        calls.append(cfg)
        return build_tiny_ldm(seed=0), {"fake": True}

    monkeypatch.setattr(ldm, "pretrain_tiny_ldm", fake_pretrain)
    hub, repo = tmp_path / "hub", "hfpfl-test/ldm-cache"
    cfg_a = PretrainConfig(unet_steps=10)
    p1 = ensure_pretrained_ldm(repo, cache_dir=hub, config=cfg_a, sample_grid=False, log=lambda *a: None)
    assert len(calls) == 1
    with open(os.path.join(p1, INFO_FILE)) as f:
        assert json.load(f)["sha256"] == ldm_fingerprint(cfg_a)["sha256"]
    # same config (num_threads does not count): reused, no training
    same = PretrainConfig(unet_steps=10, num_threads=2)
    assert ensure_pretrained_ldm(repo, cache_dir=hub, config=same, log=lambda *a: None) == p1 and len(calls) == 1
    # another config: retrained, new snapshot
    msgs = []
    p2 = ensure_pretrained_ldm(repo, cache_dir=hub, config=PretrainConfig(unet_steps=11), sample_grid=False,
                               log=msgs.append)
    assert len(calls) == 2 and p2 != p1 and any("another config" in m for m in msgs)
    # force: retrained even if matching
    ensure_pretrained_ldm(repo, cache_dir=hub, config=PretrainConfig(unet_steps=11), force=True, sample_grid=False,
                          log=lambda *a: None)
    assert len(calls) == 3
    # a stale snapshot without a fingerprint (an LDM of the previous version) is not reused silently
    from diffusers import StableDiffusionPipeline

    old = tmp_path / "v1"
    StableDiffusionPipeline(**build_tiny_ldm(seed=0), safety_checker=None, feature_extractor=None,
                            requires_safety_checker=False).save_pretrained(old)
    ldm.push_folder_to_cache(old, repo, cache_dir=hub)
    assert ldm.cached_snapshot(repo, hub) is not None and ldm.snapshot_fingerprint(ldm.cached_snapshot(repo, hub)) is None
    ensure_pretrained_ldm(repo, cache_dir=hub, sample_grid=False, log=lambda *a: None)
    assert len(calls) == 4 and calls[-1] is None


def test_fingerprint_tracks_version_and_config(monkeypatch):
    a = ldm_fingerprint()["sha256"]
    assert a == ldm_fingerprint(PretrainConfig())["sha256"]
    assert a != ldm_fingerprint(PretrainConfig(cond_dropout=0.2))["sha256"]
    monkeypatch.setattr(ldm, "LDM_FORMAT_VERSION", ldm.LDM_FORMAT_VERSION + 1)
    assert ldm_fingerprint()["sha256"] != a
