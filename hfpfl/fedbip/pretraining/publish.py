"""Pretrain the tiny LDM and publish it into the local Hub cache (through :func:`hfpfl.hub.ensure_published`): what
``recipes/pretrain_ldm.py`` runs."""

from __future__ import annotations

import json
import os
import tempfile
import time

import torch

from ...hub import ensure_published, push_folder_to_cache
from ..pool import build_pool, pool_to_tensor
from ..publish import DEFAULT_LDM_REPO, stale_reason
from ..quality import judge_train_mask, train_judge
from .config import PretrainConfig, resolve_pretrain_config
from .loops import pretrain_tiny_ldm
from .report import make_fidelity_probe, measure_ldm, model_card


def pretrain_ldm(repo_id: str = DEFAULT_LDM_REPO, config: PretrainConfig | None = None, cache_dir=None,
                 force: bool = False, output_dir: str | None = None, sample_grid: bool = True, log=print) -> str:
    """The local snapshot path of ``repo_id``, pretrained here (:func:`pretrain_and_publish`) unless a current copy is
    cached (:func:`hfpfl.fedbip.publish.stale_reason`) and not ``force``. Afterwards
    ``StableDiffusionPipeline.from_pretrained(repo_id)`` and ``FedBiPPipeline.from_pretrained(repo_id)`` load it
    offline like ``CompVis/stable-diffusion-v1-4``."""
    return ensure_published(
        repo_id, lambda: pretrain_and_publish(repo_id, cache_dir, config, output_dir, sample_grid, log),
        stale=lambda path: stale_reason(repo_id, path), force=force, cache_dir=cache_dir,
        required_file="model_index.json", log=log)


def pretrain_and_publish(repo_id, cache_dir, config, output_dir, sample_grid, log) -> str:
    """Pretrain the tiny LDM (:func:`~hfpfl.fedbip.pretraining.loops.pretrain_tiny_ldm`; with ``sample_grid`` the judge
    first, its fidelity curve during training, and the quality report afterwards), save it as a
    ``StableDiffusionPipeline`` to ``output_dir`` (a temporary folder when None) with its stats and model card, and
    publish it as ``repo_id`` into the local Hub cache. Returns the snapshot path."""
    from diffusers import StableDiffusionPipeline

    cfg = resolve_pretrain_config(config or PretrainConfig())
    pool = build_pool(cfg.seed, copies=cfg.pool_copies, font_masks=cfg.pool_font_masks)
    judge = probe = None
    if sample_grid:  # the judge first (its cost is the quality report's, not the LDM's), so that a probe can
        # measure plain-prompt fidelity during UNet training (the curve in pretrain_stats.json)

        torch.set_num_threads(cfg.num_threads)
        t0, c0 = time.time(), time.process_time()
        rep: dict = {"judge_pool": cfg.judge_pool}
        judge = (*train_judge(pool_to_tensor(pool["images"], cfg.image_size), torch.as_tensor(pool["labels"]),
                              seed=cfg.seed, styles=pool["styles"], report=rep,
                              train_mask=judge_train_mask(pool["styles"], cfg.judge_pool), device=cfg.device), rep)
        rep.update(seconds=time.time() - t0, cpu_seconds=time.process_time() - c0)
        log(f"[ldm-quality] judge ({cfg.judge_pool} images) held-out accuracy {judge[1]:.3f} "
            f"({rep['seconds']:.0f}s)")
        probe = make_fidelity_probe(judge[0]) if cfg.probe_every else None
    comps, stats, pool = pretrain_tiny_ldm(cfg, log=log, pool=pool, probe=probe)
    pipe = StableDiffusionPipeline(**comps, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    folder = output_dir or tempfile.mkdtemp(prefix="hfpfl_tiny_ldm_")
    pipe.save_pretrained(folder)
    if sample_grid:  # quality report: plain-prompt fidelity, per-style grids (judge.pt travels along)
        stats["quality"] = measure_ldm(pipe, pool, folder, log=log, judge=judge)
        stats["quality"] = {k: (os.path.basename(v) if isinstance(v, str) else v)
                            for k, v in stats["quality"].items()}
    with open(os.path.join(folder, "pretrain_stats.json"), "w") as f:
        json.dump(stats, f, indent=2)
    with open(os.path.join(folder, "README.md"), "w") as f:
        f.write(model_card(repo_id, stats))
    snap = push_folder_to_cache(folder, repo_id, cache_dir=cache_dir)
    log(f"[pretrain] published {repo_id} -> {snap}")
    return str(snap)
