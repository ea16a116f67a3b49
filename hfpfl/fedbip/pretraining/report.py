"""The quality report of a pretrained tiny LDM (measured before FedBiP is measured on it, DESIGN "honest
stand-ins"): class fidelity of plain prompts ``"a photo of the digit {d}"`` under the judge
(:mod:`hfpfl.fedbip.quality`), the judge on VAE reconstructions (the ceiling of fidelity), a sample grid per style
word (one row per caption word of :data:`hfpfl.fedbip.pool.GRID_WORDS`, one column per digit) and of the pool, and
the model card."""

from __future__ import annotations

import os

import numpy as np
import torch

from ..pool import GRID_WORDS, build_pool, caption, pool_to_tensor
from ..quality import (JUDGE_POOLS, Judge, judge_accuracy, judge_split, judge_train_mask, reconstruction_fidelity,
                       train_judge)


def make_fidelity_probe(judge, per_class: int = 5, guidance_scale: float = 3.0, num_inference_steps: int = 20,
                        seed: int = 1234):
    """A probe for :func:`hfpfl.fedbip.pretraining.pretrain_tiny_ldm`: plain-prompt fidelity on a small fixed set (same
    seed every call, so points of the curve differ only by the weights)."""

    def probe(comps):
        from diffusers import StableDiffusionPipeline

        pipe = StableDiffusionPipeline(**comps, safety_checker=None, feature_extractor=None,
                                       requires_safety_checker=False)
        pipe.set_progress_bar_config(disable=True)
        acc, _, _ = plain_prompt_fidelity(pipe, judge, per_class, guidance_scale, num_inference_steps, seed)
        return {f"fidelity_g{guidance_scale:g}": acc}

    return probe



@torch.no_grad()
def generate(pipe, prompts: list[str], num_inference_steps: int = 20, guidance_scale: float = 3.0, seed: int = 0,
             batch_size: int = 100) -> torch.Tensor:
    """Images (N, 3, H, W) in [-1, 1] from plain text prompts with a StableDiffusionPipeline-like ``pipe``."""
    out = []
    g = torch.Generator().manual_seed(seed)
    for i in range(0, len(prompts), batch_size):
        im = pipe(prompt=prompts[i : i + batch_size], num_inference_steps=num_inference_steps,
                  guidance_scale=guidance_scale, generator=g, output_type="pt").images
        out.append(im.float().cpu() * 2 - 1)
    return torch.cat(out)


def plain_prompt_fidelity(pipe, judge, per_class: int = 10, guidance_scale: float = 3.0,
                          num_inference_steps: int = 20, seed: int = 0, word: str | None = None):
    """Judge accuracy on ``per_class`` images per digit generated from ``caption(d, word)``; returns (acc, images,
    labels)."""

    labels = torch.arange(10).repeat(per_class)
    images = generate(pipe, [caption(int(y), word) for y in labels], num_inference_steps, guidance_scale, seed)
    return judge_accuracy(judge, images, labels), images, labels


def save_style_grid(pipe, path: str, words=None, guidance_scale: float = 3.0, num_inference_steps: int = 20,
                    seed: int = 0, scale: int = 3) -> str:
    """One row per caption word (``""`` = plain prompt), one column per digit; the word is written on the left."""
    from PIL import Image, ImageDraw


    words = list(GRID_WORDS if words is None else words)
    prompts = [caption(d, w or None) for w in words for d in range(10)]
    ims = generate(pipe, prompts, num_inference_steps, guidance_scale, seed)
    ims = ((ims.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 1).numpy()
    h, w = ims.shape[1:3]
    margin, pad = 24, 2
    grid = np.full((len(words) * (h + pad), margin + 10 * (w + pad), 3), 255, np.uint8)
    for k, im in enumerate(ims):
        r, c = divmod(k, 10)
        grid[r * (h + pad) : r * (h + pad) + h, margin + c * (w + pad) : margin + c * (w + pad) + w] = im
    img = Image.fromarray(grid).resize((grid.shape[1] * scale, grid.shape[0] * scale), Image.NEAREST)
    draw = ImageDraw.Draw(img)
    for r, wd in enumerate(words):
        draw.text((2, r * (h + pad) * scale + 2), wd or "(plain)", fill=(200, 0, 0))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    img.save(path)
    return path


def save_pool_grid(pool: dict, path: str, per_style: int = 10, scale: int = 3, seed: int = 0) -> str:
    """Real pool images: one row per style, ``per_style`` random images each (what the LDM was trained on)."""
    from PIL import Image, ImageDraw

    styles = sorted(set(pool["styles"]))
    rng = np.random.default_rng(seed)
    st = np.asarray(pool["styles"])
    h, w = pool["images"].shape[1:3]
    margin, pad = 40, 2
    grid = np.full((len(styles) * (h + pad), margin + per_style * (w + pad), 3), 255, np.uint8)
    for r, s in enumerate(styles):
        idx = rng.permutation(np.flatnonzero(st == s))[:per_style]
        for c, i in enumerate(idx):
            grid[r * (h + pad) : r * (h + pad) + h, margin + c * (w + pad) : margin + c * (w + pad) + w] = \
                pool["images"][i]
    img = Image.fromarray(grid).resize((grid.shape[1] * scale, grid.shape[0] * scale), Image.NEAREST)
    draw = ImageDraw.Draw(img)
    for r, s in enumerate(styles):
        draw.text((2, r * (h + pad) * scale + 2), s[:18], fill=(200, 0, 0))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    img.save(path)
    return path


def measure_ldm(pipe, pool: dict, out_dir: str, per_class: int = 10, guidance_scales=(1.0, 3.0, 5.0), seed: int = 0,
                log=print, judge=None, judge_pool: str = "public") -> dict:
    """Train the judge on the pool's ``judge_pool`` images (or take ``judge`` = (judge, held-out accuracy, report)
    trained before), measure plain-prompt fidelity at each guidance scale, write the grids."""
    if judge is None:
        x = pool_to_tensor(pool["images"], pipe.vae.config.sample_size)
        y = torch.as_tensor(pool["labels"])
        jrep: dict = {"judge_pool": judge_pool}
        judge = (*train_judge(x, y, seed=seed, styles=pool["styles"], report=jrep,
                              train_mask=judge_train_mask(pool["styles"], judge_pool)), jrep)
    judge, judge_acc, jrep = judge
    rep = {"judge_heldout_accuracy": judge_acc, "judge_pool": jrep.get("judge_pool", judge_pool), "judge": jrep,
           "plain_prompt_fidelity": {}}
    x = pool_to_tensor(pool["images"], pipe.vae.config.sample_size)
    hold, _ = judge_split(len(x), seed)
    hold = hold[torch.as_tensor(judge_train_mask(pool["styles"], rep["judge_pool"]))[hold]]  # the judge's own kind
    rep["judge_on_vae_reconstructions"] = reconstruction_fidelity(pipe.vae, judge, x[hold],
                                                                  torch.as_tensor(pool["labels"])[hold])
    log(f"[ldm-quality] judge accuracy on VAE reconstructions of its held-out images (an upper bound on "
        f"fidelity): {rep['judge_on_vae_reconstructions']:.3f}")
    for gs in guidance_scales:
        acc, _, _ = plain_prompt_fidelity(pipe, judge, per_class, gs, seed=seed)
        rep["plain_prompt_fidelity"][str(gs)] = acc
        log(f"[ldm-quality] plain-prompt class fidelity (judge) at guidance {gs}: {acc:.3f}")
    rep["style_grid"] = save_style_grid(pipe, os.path.join(out_dir, "samples_per_style.png"), seed=seed)
    rep["pool_grid"] = save_pool_grid(pool, os.path.join(out_dir, "pool_per_style.png"), seed=seed)
    torch.save(judge.state_dict(), os.path.join(out_dir, "judge.pt"))
    log(f"[ldm-quality] judge held-out accuracy on the pool {judge_acc:.3f}; grids: {rep['style_grid']}, "
        f"{rep['pool_grid']}")
    return rep


def measure_cached_ldm(path: str, out_dir: str, judge_pools=JUDGE_POOLS, per_class: int = 10,
                       guidance_scales=(1.0, 3.0, 5.0), seed: int = 0, num_inference_steps: int = 20,
                       log=print) -> dict:
    """Quality of an already published tiny LDM (a snapshot folder) under several judges, without pretraining:
    each judge's held-out accuracy (on its own kind of held-out pool images and on all of them) and the plain-prompt
    fidelity of the *same* generated images under each judge. The snapshot's own ``judge.pt`` is reused for the
    judge pool it was trained on (``quality.judge_pool`` in its ``pretrain_stats.json``; recipe v4: ``"all"``);
    other judges are trained here (:data:`JUDGE_EPOCHS` epochs, seed ``seed``). Writes ``judges.json``."""
    import json
    import time

    from diffusers import StableDiffusionPipeline


    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(path, "pretrain_stats.json")) as f:
        stats = json.load(f)
    cfg = stats.get("config", {})
    pool = build_pool(cfg.get("seed", 0), copies=cfg.get("pool_copies", 2), font_masks=cfg.get("pool_font_masks", 1500))
    pipe = StableDiffusionPipeline.from_pretrained(path, safety_checker=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    size = pipe.vae.config.sample_size
    x, y = pool_to_tensor(pool["images"], size), torch.as_tensor(pool["labels"])
    hold, _ = judge_split(len(x), seed)
    shipped_pool = stats.get("quality", {}).get("judge_pool", "all")
    gens = {}
    for gs in guidance_scales:  # one set of generated images per guidance scale, scored by every judge
        labels = torch.arange(10).repeat(per_class)
        gens[str(gs)] = (generate(pipe, [caption(int(c)) for c in labels], num_inference_steps, gs, seed), labels)
    rep = {"snapshot": path, "n_pool": len(y), "per_class": per_class, "num_inference_steps": num_inference_steps,
           "judges": {}}
    for jp in judge_pools:
        mask = judge_train_mask(pool["styles"], jp)
        t0 = time.time()
        jrep: dict = {"judge_pool": jp}
        if jp == shipped_pool and os.path.exists(os.path.join(path, "judge.pt")):
            judge = Judge()
            judge.load_state_dict(torch.load(os.path.join(path, "judge.pt")))
            judge.eval()
            own = hold[torch.as_tensor(mask)[hold]]
            jrep.update(source="judge.pt of the snapshot", heldout_accuracy=judge_accuracy(judge, x[own], y[own]),
                        n_heldout=len(own), heldout_accuracy_all=judge_accuracy(judge, x[hold], y[hold]),
                        n_heldout_all=len(hold))
            st = np.asarray(pool["styles"])[hold.numpy()]
            with torch.no_grad():
                pred = torch.cat([judge(x[hold][i : i + 256]).argmax(1) for i in range(0, len(hold), 256)])
            ok = (pred == y[hold]).numpy()
            jrep["heldout_accuracy_per_style"] = {s: float(ok[st == s].mean()) for s in sorted(set(st))}
        else:
            judge, _ = train_judge(x, y, seed=seed, styles=pool["styles"], report=jrep, train_mask=mask)
            jrep["source"] = f"trained here ({jrep['epochs']} epochs, seed {seed})"
            torch.save(judge.state_dict(), os.path.join(out_dir, f"judge_{jp}.pt"))
        jrep["seconds"] = time.time() - t0
        own = hold[torch.as_tensor(mask)[hold]]
        jrep["judge_on_vae_reconstructions"] = reconstruction_fidelity(pipe.vae, judge, x[own], y[own])
        jrep["plain_prompt_fidelity"] = {gs: judge_accuracy(judge, im, lab) for gs, (im, lab) in gens.items()}
        rep["judges"][jp] = jrep
        log(f"[ldm-quality] judge '{jp}' ({jrep['source']}): held-out {jrep['heldout_accuracy']:.3f} on its own "
            f"kind ({jrep['n_heldout']} images), {jrep['heldout_accuracy_all']:.3f} on all {jrep['n_heldout_all']}; "
            f"VAE ceiling {jrep['judge_on_vae_reconstructions']:.3f}; plain-prompt fidelity "
            + ", ".join(f"{v:.3f} at guidance {k}" for k, v in jrep["plain_prompt_fidelity"].items()))
    with open(os.path.join(out_dir, "judges.json"), "w") as f:
        json.dump(rep, f, indent=2)
    return rep



JUDGE_POOL_TEXT = {"public": "the pool's real public splits only (public mnist / usps / mnistm / syn)",
                   "all": "the whole labelled pool (public splits and procedural styles)"}


def model_card(repo_id: str, stats: dict) -> str:
    q = stats.get("quality", {})
    fid = ", ".join(f"{v:.3f} at guidance {k}" for k, v in q.get("plain_prompt_fidelity", {}).items())
    return f"""---
library_name: diffusers
tags: [hfpfl, fedbip, tiny, stand-in]
---
# {repo_id}

A tiny text-to-image latent diffusion model with Stable Diffusion v1's component classes (AutoencoderKL,
UNet2DConditionModel, CLIPTextModel + CLIPTokenizer, PNDM with the SD-v1 betas), the offline stand-in for
`CompVis/stable-diffusion-v1-4` in hfpfl's FedBiP.

**Trained on** `hfpfl.fedbip.pool.build_pool`: {stats.get('n_images')} public images, styles {stats.get('pool_styles')}:
the public splits (data seed 0) of the mnist / usps / mnistm / syn digit sources (held by no client of a simulation
with data seed 0) plus procedural styles (fonts, inversions, colours, scikit-image photo backgrounds and textures,
stroke widths, blur, noise, low resolution) on public digit shapes. Captions name the digit and, half of the time,
one generic or partial style word ("a blurry photo of the digit seven"); no caption names a client domain.

**Training** (recipe version {stats.get('recipe_version')}): VAE {stats.get('config', {}).get('vae_steps')} steps; the
CLIPTextModel as CLIP's text tower, {stats.get('config', {}).get('clip_steps')} contrastive steps against a frozen image
CNN trained on the pool's labels (LiT), then frozen (mean-pooled cosine between captions that differ only in the
digit word: {stats.get('text_tower', {}).get('before_pooled_cosine_between_digits', float('nan')):.3f} at random init,
{stats.get('text_tower', {}).get('pooled_cosine_between_digits', float('nan')):.3f} after); the UNet (cross-attention
and the global text path `addition_embed_type="text"`) {stats.get('unet_steps')} steps
({stats.get('total_seconds', 0):.0f} s wall on {stats.get('device', 'cpu')}, {stats.get('total_cpu_seconds', 0):.0f} s CPU,
{stats.get('num_threads', 1)} thread(s); UNet batch {stats.get('config', {}).get('unet_batch_size')}, VAE batch
{stats.get('config', {}).get('vae_batch_size')}: the budget of `hfpfl.fedbip.pretraining.PRETRAIN_BUDGETS` for that device).

**Quality**: class fidelity of plain prompts "a photo of the digit d" judged by a CNN trained on
{JUDGE_POOL_TEXT.get(q.get('judge_pool', 'all'), q.get('judge_pool'))} (held-out accuracy
{q.get('judge_heldout_accuracy', float('nan')):.3f}): {fid or 'not measured'}. The same
judge on VAE reconstructions of its held-out images (the ceiling of fidelity with this VAE):
{q.get('judge_on_vae_reconstructions', float('nan')):.3f}. Fidelity during UNet training (50 images, guidance 3):
{', '.join(f"{c.get('fidelity_g3', float('nan')):.2f} after {c['images_seen']} images" for c in stats.get('curve', []))
 or 'not measured'}.
Grids: `samples_per_style.png` (generated, one row per caption word), `pool_per_style.png` (training images).
"""
