"""The pretraining loops of the tiny LDM on the broad public pool (:mod:`hfpfl.fedbip.pool`): the VAE, the text tower
(LiT, against a frozen image CNN), then the UNet under the frozen text tower."""

from __future__ import annotations

import numpy as np
import torch

from ...runtime import configure_determinism
from ..ldm import build_tiny_ldm, digit_prompt
from ..pool import build_pool, pool_to_tensor
from ..publish import LDM_RECIPE_VERSION
from ..quality import train_judge
from .config import PretrainConfig, ldm_config, resolve_pretrain_config


def text_separation(te, tok) -> dict:
    """How differently the text encoder encodes captions that differ only in the digit word: mean cosine between
    digits of the mean-pooled output, and at the first padding position (1 = identical)."""
    import torch.nn.functional as F

    prompts = [digit_prompt(d) for d in range(10)]
    ids = tok(prompts, padding="max_length", max_length=tok.model_max_length, truncation=True,
              return_tensors="pt").input_ids
    with torch.no_grad():
        h = te(ids.to(te.device))[0].float().cpu()
    off = ~torch.eye(10, dtype=torch.bool)
    pooled = F.normalize(h.mean(1), dim=-1)
    last = int((ids[0] != tok.pad_token_id).sum()) + 1  # first position after the EOS
    pad = F.normalize(h[:, min(last, h.shape[1] - 1)], dim=-1)
    return {"pooled_cosine_between_digits": float((pooled @ pooled.T)[off].mean()),
            "padding_cosine_between_digits": float((pad @ pad.T)[off].mean())}


def pretrain_text_tower(te, tok, image_features: torch.Tensor, ids: torch.Tensor, captions, cfg, g,
                        log=print) -> dict:
    """CLIP's text tower in miniature, trained as in LiT (Zhai et al. 2022, "locked-image tuning"): the text encoder
    ``te`` learns the symmetric contrastive loss against a *frozen* pretrained image tower (``image_features``: the
    judge CNN's pooled features of the pool images; a trainable linear head on each side). Captions that are equal
    count as positives of each other. The text embedding is the projected mean over all token positions, so that
    every position (also the padding after the EOS) carries the caption. ``te`` ends frozen.

    Tried first: a from-scratch two-tower CLIP (``CLIPModel`` with a tiny ``CLIPVisionModel``) for 300 steps stayed
    at chance (loss 4.52 vs log(128) = 4.85) and left the digits' pooled text cosine at 0.994."""
    import torch.nn.functional as F

    d, dev = te.config.hidden_size, te.device
    text_head = torch.nn.Linear(d, d, bias=False).to(dev)
    image_head = torch.nn.Linear(image_features.shape[1], d, bias=False).to(dev)
    logit_scale = torch.nn.Parameter(torch.tensor(float(np.log(1 / 0.07)), device=dev))
    ids, image_features = ids.to(dev), image_features.to(dev)
    before = text_separation(te, tok)
    cap_ids = {c: i for i, c in enumerate(dict.fromkeys(captions))}
    cap = torch.as_tensor([cap_ids[c] for c in captions], device=dev)
    te.train().requires_grad_(True)
    params = list(te.parameters()) + list(text_head.parameters()) + list(image_head.parameters()) + [logit_scale]
    opt = torch.optim.AdamW(params, lr=cfg.clip_lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, cfg.clip_steps)
    n, loss_ema = len(cap), None
    for _ in range(cfg.clip_steps):
        idx = torch.randint(0, n, (cfg.clip_batch_size,), generator=g).to(dev)
        t = F.normalize(text_head(te(ids[idx])[0].mean(1)), dim=-1)
        v = F.normalize(image_head(image_features[idx]), dim=-1)
        logits = logit_scale.exp().clamp(max=100) * t @ v.T
        pos = (cap[idx][:, None] == cap[idx][None, :]).float()
        target = pos / pos.sum(1, keepdim=True)
        loss = 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
    te.eval().requires_grad_(False)
    out = {"recipe": "LiT: contrastive against a frozen image CNN's features", "steps": cfg.clip_steps,
           "contrastive_loss_ema": loss_ema, "chance_loss": float(np.log(cfg.clip_batch_size))}
    out.update({"before_" + k: v for k, v in before.items()})
    out.update(text_separation(te, tok))
    log(f"[pretrain] text tower ({cfg.clip_steps} LiT steps): loss {loss_ema:.3f} (chance {out['chance_loss']:.2f}); "
        + ", ".join(f"{k} {v:.3f}" for k, v in out.items() if "cosine" in k))
    return out


def pretrain_tiny_ldm(cfg: PretrainConfig | None = None, log=print, pool: dict | None = None, probe=None):
    """Pretrain the tiny LDM on the broad public pool (:mod:`hfpfl.fedbip.pool`): VAE (MSE + small KL), then UNet +
    text encoder on the caption-conditioned denoising loss over unit-variance VAE latents. Returns the components
    dict (PNDM scheduler), the stats, and the pool (for the quality report).

    ``pool``: a pool built beforehand (default: ``build_pool(cfg.seed, ...)`` here). ``probe``: a callable
    ``probe(components) -> dict`` run every ``cfg.probe_every`` UNet steps (and after the last) on the EMA weights in
    eval mode, e.g. the judge's plain-prompt fidelity on a small fixed set, so that the stats hold the training curve
    (``stats["curve"]``); its CPU time is excluded from the time budget and reported as ``probe_cpu_seconds``."""
    import time

    import torch.nn.functional as F
    from diffusers import DDPMScheduler
    from tqdm.auto import tqdm


    cfg = resolve_pretrain_config(cfg or PretrainConfig())
    dev = torch.device(cfg.device)
    torch.set_num_threads(cfg.num_threads)
    if dev.type == "cuda":  # same seed, same weights on this GPU (cuDNN/TF32 defaults are not)
        configure_determinism(dev)
    t_start = time.time()
    cpu_start = time.process_time()
    g = torch.Generator().manual_seed(cfg.seed)
    if pool is None:
        pool = build_pool(cfg.seed, copies=cfg.pool_copies, font_masks=cfg.pool_font_masks)
    n = len(pool["labels"])
    if cfg.max_images is not None and n > cfg.max_images:
        keep = np.sort(np.random.default_rng(cfg.seed).permutation(n)[: cfg.max_images])
        pool = {k: (v[keep] if isinstance(v, np.ndarray) else [v[i] for i in keep]) for k, v in pool.items()}
        n = len(keep)
    x_cpu = pool_to_tensor(pool["images"], cfg.image_size)
    x_all = x_cpu.to(dev)
    log(f"[pretrain] broad pool: {n} images, {len(set(pool['styles']))} styles, "
        f"{len(set(pool['captions']))} distinct captions (built in {time.time() - t_start:.0f}s); training on {dev}")
    comps = build_tiny_ldm(cfg.image_size, seed=cfg.seed,
                           config=ldm_config(cfg))
    vae, unet, te, tok = comps["vae"], comps["unet"], comps["text_encoder"], comps["tokenizer"]
    if cfg.token_embedding_std:
        with torch.no_grad():
            te.get_input_embeddings().weight.normal_(0.0, cfg.token_embedding_std, generator=g)
    for m in (vae, unet, te):
        m.to(dev)

    def randn(shape):  # every draw from the one CPU generator (same batches and noise on any device)
        return torch.randn(shape, generator=g).to(dev)

    # ---- VAE ----------------------------------------------------------------------------------------------
    if cfg.vae_logvar_init is not None and vae.quant_conv is not None:
        with torch.no_grad():
            vae.quant_conv.bias[vae.config.latent_channels :] += cfg.vae_logvar_init
    vae.train()
    opt = torch.optim.AdamW(vae.parameters(), lr=cfg.vae_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, cfg.vae_steps)
    bar = tqdm(range(cfg.vae_steps), desc="VAE", mininterval=5)
    for step in bar:
        idx = torch.randint(0, n, (cfg.vae_batch_size,), generator=g)
        x = x_all[idx.to(dev)]
        post = vae.encode(x).latent_dist
        rec = vae.decode(post.mean + post.std * randn(post.mean.shape)).sample  # = post.sample(generator=g)
        mse = F.mse_loss(rec, x)
        loss = mse + cfg.kl_weight * post.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        bar.set_postfix(mse=f"{mse.item():.4f}")
    vae.eval().requires_grad_(False)
    t_vae = time.time() - t_start

    # latents of the whole pool: keep posterior mean/std, sample per step; unit-variance scaling (as Stable Diffusion's VAE scaling)
    with torch.no_grad():
        means, stds = [], []
        for i in range(0, n, 256):
            d = vae.encode(x_all[i : i + 256]).latent_dist
            means.append(d.mean)
            stds.append(d.std)
        mean, std = torch.cat(means), torch.cat(stds)
        sf = float(1.0 / (mean + std * randn(mean.shape)).std())
        rec_mse = F.mse_loss(vae.decode(mean[:256]).sample, x_all[:256]).item()
    vae.register_to_config(scaling_factor=sf)
    log(f"[pretrain] VAE done in {t_vae:.0f}s, recon mse {rec_mse:.4f}, scaling_factor {sf:.4f}")

    # ---- text tower: LiT-style contrastive pretraining against a frozen image CNN, then frozen ---------------
    enc = lambda texts: tok(list(texts), padding="max_length", max_length=tok.model_max_length,  # noqa: E731
                            truncation=True, return_tensors="pt").input_ids
    ids_all = enc(pool["captions"])
    t_clip0 = time.time()
    clip_stats = {}
    if cfg.clip_steps:
        # the image tower: a CNN trained on the pool's digit labels (its own seed: not the judge that measures
        # the LDM's fidelity afterwards)
        tower, tower_acc = train_judge(x_cpu, torch.as_tensor(pool["labels"]), epochs=cfg.image_tower_epochs,
                                       seed=cfg.seed + 1, device=dev)
        with torch.no_grad():
            feats = torch.cat([tower.features(x_all[i : i + 512]).mean((2, 3)) for i in range(0, n, 512)])
        clip_stats = pretrain_text_tower(te, tok, feats, ids_all.to(dev), pool["captions"], cfg, g, log)
        clip_stats["image_tower_heldout_accuracy"] = tower_acc
    t_clip = time.time() - t_clip0

    # ---- UNet (+ text encoder if cfg.train_text_encoder) -----------------------------------------------------
    empty_ids = enc([""])[0].to(dev)
    ids_all = ids_all.to(dev)
    noise_sched = DDPMScheduler.from_config(comps["scheduler"].config)
    params = list(unet.parameters()) + (list(te.parameters()) if cfg.train_text_encoder else [])
    unet.train()
    te.train(cfg.train_text_encoder).requires_grad_(cfg.train_text_encoder)
    h_all = h_empty = None
    if not cfg.train_text_encoder:  # the frozen text tower's output per caption, computed once
        with torch.no_grad():
            h_all = torch.cat([te(ids_all[i : i + 512])[0] for i in range(0, n, 512)])
            h_empty = te(empty_ids[None])[0][0]
    opt = torch.optim.AdamW(params, lr=cfg.unet_lr, weight_decay=1e-4)
    warm = max(1, cfg.unet_warmup_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(  # linear warm-up, then cosine decay to 0 at unet_steps
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + np.cos(np.pi * min(s, cfg.unet_steps) / cfg.unet_steps)))
    bar = tqdm(range(cfg.unet_steps), desc="UNet", mininterval=5)
    t_unet0 = time.time()
    ema = None
    ema_params = [p.detach().clone() for p in params] if cfg.ema_decay else None
    snr = (noise_sched.alphas_cumprod / (1 - noise_sched.alphas_cumprod)).to(dev)
    noise_sched.alphas_cumprod = noise_sched.alphas_cumprod.to(dev)  # add_noise on the device, no copy per step
    curve, probe_cpu, probe_wall = [], 0.0, 0.0

    def run_probe(step_done):
        nonlocal probe_cpu, probe_wall
        c0, w0 = time.process_time(), time.time()
        live = [p.detach().clone() for p in params]
        with torch.no_grad():
            for e, p in zip(ema_params or params, params):
                p.copy_(e)
        unet.eval()
        te.eval()
        res = dict(probe(comps))
        with torch.no_grad():
            for b, p in zip(live, params):
                p.copy_(b)
        unet.train()
        te.train(cfg.train_text_encoder)
        probe_cpu += time.process_time() - c0
        probe_wall += time.time() - w0
        res.update(unet_step=step_done, images_seen=step_done * cfg.unet_batch_size, loss_ema=ema,
                   train_cpu_seconds=time.process_time() - cpu_start - probe_cpu)
        curve.append(res)
        log("[pretrain] probe " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                            for k, v in res.items()))

    for step in bar:
        idx = torch.randint(0, n, (cfg.unet_batch_size,), generator=g).to(dev)
        z0 = (mean[idx] + std[idx] * randn(mean[idx].shape)) * sf
        drop = (torch.rand(len(idx), generator=g) < cfg.cond_dropout).to(dev)
        if h_all is not None:
            h = torch.where(drop[:, None, None], h_empty, h_all[idx])  # (a masked assignment waits for the GPU)
        else:
            ids = torch.where(drop[:, None], empty_ids, ids_all[idx])
            h = te(ids)[0]
        eps = randn(z0.shape)
        t = torch.randint(0, noise_sched.config.num_train_timesteps, (len(idx),), generator=g).to(dev)
        zt = noise_sched.add_noise(z0, eps, t)
        per = F.mse_loss(unet(zt, t, h).sample, eps, reduction="none").mean((1, 2, 3))
        if cfg.min_snr_gamma:  # eps-prediction weight min(SNR, gamma) / SNR
            per = per * (snr[t].clamp(max=cfg.min_snr_gamma) / snr[t]).float()
        loss = per.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if ema_params is not None:
            dec = min(cfg.ema_decay, (1 + step) / (10 + step))
            with torch.no_grad():  # e <- dec * e + (1 - dec) * p, two calls over all tensors
                torch._foreach_mul_(ema_params, dec)
                torch._foreach_add_(ema_params, [p.detach() for p in params], alpha=1 - dec)
        if dev.type == "cpu" or (step + 1) % 50 == 0 or step + 1 == cfg.unet_steps:  # a GPU is not waited for
            # every step (the logged loss is then an EMA over every 50th step)
            ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
            bar.set_postfix(loss=f"{ema:.4f}")
        last = step + 1 == cfg.unet_steps
        over = bool(cfg.time_budget_s) and time.process_time() - cpu_start - probe_cpu > cfg.time_budget_s
        if probe is not None and cfg.probe_every and ((step + 1) % cfg.probe_every == 0 or last or over):
            run_probe(step + 1)
        if over:
            log(f"[pretrain] time budget reached at UNet step {step + 1}")
            break
    if ema_params is not None:
        with torch.no_grad():
            for e, p in zip(ema_params, params):
                p.copy_(e)
    unet.eval().requires_grad_(False)
    te.eval().requires_grad_(False)
    if dev.type != "cpu":
        torch.cuda.synchronize(dev)
    from collections import Counter

    stats = dict(recipe_version=LDM_RECIPE_VERSION, pool="hfpfl.fedbip.pool.build_pool (broad public pool)", n_images=n,
                 pool_styles=dict(Counter(pool["styles"])), vae_seconds=t_vae, vae_recon_mse=rec_mse,
                 scaling_factor=sf, clip_seconds=t_clip, text_tower=clip_stats,
                 unet_seconds=time.time() - t_unet0 - probe_wall, unet_steps=step + 1, unet_loss_ema=ema,
                 total_seconds=time.time() - t_start - probe_wall,
                 total_cpu_seconds=time.process_time() - cpu_start - probe_cpu, probe_cpu_seconds=probe_cpu,
                 curve=curve, num_threads=cfg.num_threads, device=str(dev),
                 config={k: getattr(cfg, k) for k in cfg.__dataclass_fields__})
    log(f"[pretrain] UNet done: {stats['unet_steps']} steps in {stats['unet_seconds']:.0f}s, loss(ema) {ema:.4f}")
    return comps, stats, pool

