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

import numpy as np
import torch

from pipelines.pipeline_fedbip import placeholder_tokens  # noqa: F401  (the one definition of the token strings)

from .pool import pool_to_tensor

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
    "colorful", "blurry",
)

MAX_PLACEHOLDERS = 8  # per kind, in the tiny vocab; the pipeline adds more to any tokenizer at run time if needed


def digit_prompt(label: int) -> str:
    """Plain pretraining caption of a digit, e.g. ``"a photo of the digit seven"``."""
    return f"a photo of the digit {DIGIT_NAMES[int(label)]}"


# --------------------------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------------------------
def _bpe(word_syms: list[str], ranks: dict) -> list[str]:
    """CLIP's BPE on one pre-split word (lowest-rank adjacent pair merged first, all its occurrences at once)."""
    word = list(word_syms)
    while len(word) > 1:
        pairs = {(a, b) for a, b in zip(word, word[1:])}
        best = min(pairs, key=lambda p: ranks.get(p, float("inf")))
        if best not in ranks:
            break
        out, i = [], 0
        while i < len(word):
            if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                out.append(word[i] + word[i + 1])
                i += 2
            else:
                out.append(word[i])
                i += 1
        word = out
    return word


def write_clip_bpe_files(folder: str, words=BASE_WORDS + DIGIT_NAMES, n_placeholders: int = MAX_PLACEHOLDERS):
    """Write ``vocab.json`` + ``merges.txt`` for a byte-level BPE CLIP tokenizer over a closed word list.

    Every lowercase letter / digit / punctuation mark is in the vocab (alone and with the ``</w>`` end-of-word
    suffix), and the merges make every listed word a single ``word</w>`` token. BPE applies merges by *rank*, not
    left to right, so a naive left-to-right chain per word breaks words whose pairs another word merges earlier
    ("three" became ``th re e``, "nine" ``n in e``). Fixed by simulating CLIP's BPE: while a word still ends in
    several pieces, append merges that join its pieces (a merge appended last never changes a word that already
    ends as one token, so the loop converges).
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
    merges: list[tuple[str, str]] = []
    ranks: dict[tuple[str, str], int] = {}

    def add_merge(a, b):
        if (a, b) not in ranks:
            ranks[(a, b)] = len(merges)
            merges.append((a, b))
            add(a + b)

    uniq = list(dict.fromkeys(w.lower() for w in words))  # ordered, unique
    for w in uniq:  # left-to-right chains first (most words end as one token with these alone)
        syms = list(w[:-1]) + [w[-1] + "</w>"]
        cur = syms[0]
        for s in syms[1:]:
            add_merge(cur, s)
            cur = cur + s
    for _ in range(100):
        broken = [(w, p) for w in uniq if len(p := _bpe(list(w[:-1]) + [w[-1] + "</w>"], ranks)) > 1]
        if not broken:
            break
        for _, pieces in broken:
            cur = pieces[0]
            for s in pieces[1:]:
                add_merge(cur, s)
                cur = cur + s
    else:  # pragma: no cover
        raise RuntimeError(f"BPE merges did not converge for {[w for w, _ in broken]}")
    s_toks, v_toks = placeholder_tokens(n_placeholders, n_placeholders)
    for t in s_toks + v_toks:
        add(t)
    with open(os.path.join(folder, "vocab.json"), "w") as f:
        json.dump(vocab, f)
    with open(os.path.join(folder, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n" + "\n".join(f"{a} {b}" for a, b in merges) + "\n")
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
    # per UNet level (same length as unet_channels): a cross-attention block (CrossAttnDown/UpBlock2D) or a plain
    # ResNet one; None = every level but the lowest (whose resolution the cross-attention mid block covers). With
    # 16x16 latents, (32, 64, 64) and (False, True, False) is the shipped 8x8 UNet with a plain ResNet level on top:
    # attention stays at 8x8 and 4x4, where it is on the shipped model (SD attends at 64/32/16, not at its coarsest
    # 8). Measured on one CPU thread (batch 32): 2.4x the shipped UNet's forward, against 5.2x for (32, 64) with
    # attention at 16x16 (CHANGELOG.md).
    unet_attention: tuple | None = None
    cross_attention_dim: int = 32
    text_hidden: int = 32
    text_layers: int = 2
    text_heads: int = 4
    max_length: int = 16
    # A global text path beside cross-attention: diffusers' ``addition_embed_type="text"`` (TextTimeEmbedding:
    # attention-pools the encoder's hidden states and adds them to the timestep embedding that every ResNet block
    # reads; the DeepFloyd-IF / UnCLIP path). Measured: with cross-attention alone the tiny UNet's
    # denoising loss stayed equal for the right, a wrong and the empty caption at the CPU budget; the digit word
    # changes one of 16 encoder tokens, which softmax cross-attention at init weighs 1/16.
    text_time_embedding: bool = True
    text_time_heads: int = 4

    @classmethod
    def for_latent_size(cls, image_size: int = 32, latent_size: int | None = None) -> "TinyLDMConfig":
        """The config whose VAE maps an ``image_size`` image to a ``latent_size`` latent: one VAE block per
        downsampling plus one, channels (16, 32, 32, ...) as the default's. None = ``image_size // 4`` (factor 4,
        what every image size got before the option existed); for 32x32 images 8 (factor 4) is the shipped model's;
        16 (factor 2) keeps 4x as many latent pixels: why that matters for FedBiP's instance level is in
        CHANGELOG.md ("Resolution-matched noising": a feature spanning 1/8 of the image averages latent_side^2/64
        latent pixels, so at a given timestep its SNR grows with the latent's area, as on SD's 64 x 64 latents)."""
        if latent_size is None:
            latent_size = max(1, image_size // 4)
        factor = image_size // latent_size if latent_size > 0 else 0
        if factor < 1 or image_size % latent_size or factor & (factor - 1):
            raise ValueError(f"latent_size must divide image_size {image_size} by a power of two (1, 2, 4, ...), "
                             f"got {latent_size}")
        n_blocks = factor.bit_length()  # factor 4 -> 3 blocks (2 downsamplings), 2 -> 2, 1 -> 1
        return cls(image_size=image_size, vae_channels=((16,) + (32,) * (n_blocks - 1)))

    def unet_block_types(self) -> tuple[tuple, tuple]:
        """(down_block_types, up_block_types) of the UNet: cross-attention at the levels ``unet_attention`` names
        (default: all but the lowest); up blocks mirror the down blocks."""
        n = len(self.unet_channels)
        attn = tuple(self.unet_attention) if self.unet_attention is not None else (True,) * (n - 1) + (False,)
        if len(attn) != n:
            raise ValueError(f"unet_attention needs one entry per UNet level ({n}, as unet_channels), got {len(attn)}")
        down = tuple("CrossAttnDownBlock2D" if a else "DownBlock2D" for a in attn)
        up = tuple("CrossAttnUpBlock2D" if a else "UpBlock2D" for a in reversed(attn))
        return down, up


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
    down_blocks, up_blocks = cfg.unet_block_types()
    unet = UNet2DConditionModel(
        sample_size=latent_size,
        in_channels=cfg.latent_channels,
        out_channels=cfg.latent_channels,
        layers_per_block=1,
        block_out_channels=tuple(cfg.unet_channels),
        down_block_types=down_blocks,
        up_block_types=up_blocks,
        cross_attention_dim=cfg.cross_attention_dim,
        attention_head_dim=8,
        norm_num_groups=min(32, cfg.unet_channels[0]),
        **(dict(addition_embed_type="text", addition_embed_type_num_heads=cfg.text_time_heads)
           if cfg.text_time_embedding else {}),
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
# pretraining on the broad public pool (hfpfl.fedbip.pool)
# --------------------------------------------------------------------------------------------------------------
@dataclass
class PretrainConfig:
    image_size: int = 32
    # side of the VAE latent (TinyLDMConfig.for_latent_size): None = image_size // 4 (factor 4: 8 for 32x32 images,
    # the shipped hfpfl/tiny-ldm-digits-broad); 16 for 32x32 = factor 2, 4x the latent pixels, closer to SD's 64 x 64
    # (measured in CHANGELOG.md)
    latent_size: int | None = None
    # the UNet's levels (TinyLDMConfig.unet_channels / unet_attention): None = the shipped (32, 64), attention on all
    # but the lowest level
    unet_channels: tuple | None = None
    unet_attention: tuple | None = None
    max_images: int | None = None
    pool_copies: int = 2  # procedural renderings per public digit shape (see hfpfl.fedbip.pool)
    pool_font_masks: int = 1500
    # None = the budget of the device the run resolves to (:data:`PRETRAIN_BUDGETS`)
    vae_steps: int | None = None
    vae_batch_size: int | None = None
    vae_lr: float = 2e-3
    kl_weight: float = 1e-6
    # Initial log-variance of the VAE posterior (the bias of the logvar half of ``quant_conv``). At diffusers' init it
    # is ~0, i.e. posterior std ~1 around means of a similar size: the decoder first learns from latents swamped by
    # sampling noise, and with the tiny KL weight the encoder shrinks the variance only slowly. Measured (batches
    # of 32, 300 held-out pool images, judge 0.82 on the originals): after 266 steps reconstruction MSE 0.082
    # and judge accuracy on reconstructions 0.587 at diffusers' init, 0.062 and 0.593 at -8 (0.597 after 400 steps):
    # a faster decoder, but the VAE's keeping of the digit, not its noise, bounds fidelity. None = diffusers' init.
    vae_logvar_init: float | None = -8.0
    unet_steps: int | None = None
    unet_batch_size: int | None = None
    # SD trains its UNet under a *frozen* text encoder that CLIP pretrained contrastively on image-text pairs. Tried
    # before: a from-scratch tiny CLIP trained jointly with the UNet collapsed; a frozen *random* one (token
    # std 0.02 or 1.0) was not read: its outputs for "...digit three" and "...digit seven" differ only at the digit's
    # own position (cosine 0.16 there, 0.996 at the 10 padding positions, 0.99 mean-pooled), and the UNet's loss
    # stayed equal for the right, a wrong and the empty caption. So, as CLIP before SD, the text tower is first
    # trained contrastively against a tiny CLIPVisionModel on the pool's (image, caption) pairs (transformers
    # ``CLIPModel``), then frozen for the UNet. The contrastive embedding is the mean over *all* token positions, so
    # that every position (also the padding after the EOS) carries the caption.
    train_text_encoder: bool = False  # jointly with the UNet (collapsed; kept for the record)
    token_embedding_std: float = 1.0
    clip_steps: int = 600  # contrastive text-tower pretraining steps (0 = a frozen random text encoder)
    clip_batch_size: int = 128
    clip_lr: float = 3e-3
    image_tower_epochs: int = 3  # the frozen image CNN of the LiT stage (trained on the pool's digit labels)
    unet_lr: float = 2e-3
    min_snr_gamma: float | None = 5.0  # min-SNR loss weighting (Hang et al. 2023): faster convergence per step
    unet_warmup_steps: int = 100
    probe_every: int = 500  # UNet steps between calls of pretrain_tiny_ldm's ``probe`` (0 = never)
    # the quality judge's training images: "public" = the pool's real public splits only ("a judge trained on
    # real public images"), "all" = the whole pool with the procedural styles (recipe v4 published its numbers so)
    judge_pool: str = "public"
    ema_decay: float = 0.995  # the published UNet / text encoder are EMA weights (None/0 = last weights)
    cond_dropout: float = 0.1  # empty caption this often, so classifier-free guidance works
    seed: int = 0
    num_threads: int = 1
    # where the VAE, text tower, UNet and judge train: "auto" = the accelerator (CUDA) when there is one, else "cpu".
    # Random draws (batches, noise, timesteps, dropout) come from one CPU generator either way, so a seed draws the
    # same batches on any device; the weights then differ only by the device's arithmetic.
    device: str = "auto"
    # stop the UNet phase once the run has used this much CPU time (process time, so that a busy shared machine
    # does not shorten training: 1 thread => CPU seconds == seconds on one free core)
    time_budget_s: float | None = None  # None = exactly unet_steps (deterministic per seed)


# Training budgets per device kind: the CPU budget is what fits the first run on 2 cores (~30 min measured, recipe
# v4); on an accelerator the budget the H100 diagnostic measured (CHANGELOG.md): a 7.5x-step, 2x-batch
# VAE raised the judge's accuracy on VAE reconstructions (the fidelity ceiling) from 0.65 to 0.80, and 13x the UNet
# images (10,000 steps of 128) raised plain-prompt fidelity at guidance 5 from ~0.6 to 0.87-0.89; with this VAE the
# 50-image guidance-3 probe reached 0.82 after 4,000 steps of 128 and stayed at 0.78-0.84 up to 6,000 (one H100 run),
# so the accelerator budget stops at 4,000 (~5 min of UNet there).
PRETRAIN_BUDGETS = {
    "cpu": dict(vae_steps=400, vae_batch_size=32, unet_steps=3000, unet_batch_size=32),
    "accelerator": dict(vae_steps=3000, vae_batch_size=64, unet_steps=4000, unet_batch_size=128),
}


def ldm_config(cfg: PretrainConfig) -> TinyLDMConfig:
    """The model config a pretraining config builds: its latent side and UNet levels (ValueError when they do
    not fit together)."""
    import dataclasses

    model = TinyLDMConfig.for_latent_size(cfg.image_size, cfg.latent_size)
    if cfg.unet_channels is not None:
        model = dataclasses.replace(model, unet_channels=tuple(cfg.unet_channels))
    if cfg.unet_attention is not None:
        model = dataclasses.replace(model, unet_attention=tuple(bool(a) for a in cfg.unet_attention))
    groups = min(32, model.unet_channels[0])
    if any(c < 1 or c % groups for c in model.unet_channels):
        raise ValueError(f"unet_channels must be positive multiples of {groups} (GroupNorm groups), got "
                         f"{list(model.unet_channels)}")
    model.unet_block_types()  # one attention flag per level
    return model


def resolve_pretrain_config(cfg: PretrainConfig) -> PretrainConfig:
    """``cfg`` with ``device`` resolved ("auto" -> "cuda" when available, else "cpu") and every budget field left at
    None filled from :data:`PRETRAIN_BUDGETS` for that device kind. Idempotent."""
    import dataclasses

    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={cfg.device!r}: CUDA is not available here; use device='cpu' or 'auto'")
    budget = PRETRAIN_BUDGETS["cpu" if torch.device(device).type == "cpu" else "accelerator"]
    return dataclasses.replace(cfg, device=device, **{k: v for k, v in budget.items() if getattr(cfg, k) is None})


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

    from .pool import build_pool

    cfg = resolve_pretrain_config(cfg or PretrainConfig())
    dev = torch.device(cfg.device)
    torch.set_num_threads(cfg.num_threads)
    if dev.type == "cuda":  # same seed, same weights on this GPU (cuDNN/TF32 defaults are not)
        from hfpfl.runtime import configure_determinism

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
        from .quality import train_judge

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


# v2: broad pool + fixed BPE tokenizer; a new id so that caches holding the MNIST-only v1 model are not reused
DEFAULT_LDM_REPO = "hfpfl/tiny-ldm-digits-broad"
# The pretraining recipe's version, written to the snapshot's pretrain_stats.json: a cached copy of an older recipe
# is retrained on first use. 3: LiT-pretrained frozen text tower + the UNet's global text path. 4: VAE
# posterior log-variance initialised at -8, 400 VAE steps of 32, 3,000 UNet steps of 32 with warm-up, a fidelity
# curve during training.
LDM_RECIPE_VERSION = 4


def snapshot_recipe_version(path: str) -> int | None:
    """``recipe_version`` of a pretrained tiny-LDM snapshot (None for snapshots older than version 3)."""
    import json as _json

    try:
        with open(os.path.join(path, "pretrain_stats.json")) as f:
            return _json.load(f).get("recipe_version")
    except (OSError, ValueError):
        return None


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
    import json as _json

    try:
        with open(os.path.join(path, SHIPPED_MARKER)) as f:
            return _json.load(f).get("fingerprint")
    except (OSError, ValueError):
        return None


def publish_shipped_ldm(repo_id: str = DEFAULT_LDM_REPO, cache_dir=None, log=print) -> str:
    """Publish the snapshot shipped with hfpfl for ``repo_id`` into the local Hub cache, its float16 weights upcast to
    float32 (what ``save_pretrained`` of the trained float32 model wrote), and return the snapshot path."""
    import json as _json
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
            _json.dump({"fingerprint": shipped_fingerprint(src), "source": "the snapshot shipped with hfpfl",
                        "stored_as": "float16, upcast to float32 when published"}, f, indent=1)
        snap = push_folder_to_cache(folder, repo_id, cache_dir=cache_dir)
    log(f"[ldm] published the snapshot shipped with hfpfl ({src}; pretrained on an accelerator, see its README.md) "
        f"as {repo_id} -> {snap}; retrain it with recipes/pretrain_ldm.py --force")
    return str(snap)


def ensure_pretrained_ldm(repo_id: str = DEFAULT_LDM_REPO, cache_dir=None, force: bool = False,
                          config: PretrainConfig | None = None, output_dir: str | None = None,
                          sample_grid: bool = True, log=print) -> str:
    """Return the local snapshot path of the pretrained tiny LDM ``repo_id``. If it is not cached (or a cached copy is
    of an older recipe, or was published from a shipped snapshot other than this hfpfl's), publish it to the local Hub cache first: the snapshot shipped with hfpfl when there is one
    for ``repo_id`` and neither ``force`` nor a ``config`` asks for training, else pretrain it here. Afterwards
    ``StableDiffusionPipeline.from_pretrained(repo_id)`` and ``FedBiPPipeline.from_pretrained(repo_id)`` load it
    offline like ``CompVis/stable-diffusion-v1-4``."""
    from filelock import FileLock
    from huggingface_hub.constants import HF_HUB_CACHE

    def stale(path):  # why a cached copy of the default repo id must be replaced, or None when it is current
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

    if not force:
        path = cached_snapshot(repo_id, cache_dir)
        if path is not None and stale(path) is None:
            return path
        if path is not None:
            log(f"[pretrain] cached {repo_id} {stale(path)}: replacing it")
    # one trainer at a time per repo id (several processes of a simulation may ask at once)
    lock_dir = os.path.join(str(cache_dir or HF_HUB_CACHE), ".locks")
    os.makedirs(lock_dir, exist_ok=True)
    with FileLock(os.path.join(lock_dir, "hfpfl-pretrain-" + repo_id.replace("/", "--") + ".lock")):
        if not force:
            path = cached_snapshot(repo_id, cache_dir)
            if path is not None and stale(path) is None:
                return path
        if not force and config is None and repo_id in SHIPPED_LDM_DIRS:
            if os.path.isfile(os.path.join(SHIPPED_LDM_DIRS[repo_id], "model_index.json")):
                return publish_shipped_ldm(repo_id, cache_dir, log=log)
            # an install without the package data (e.g. a wheel built without it): train here, and say so
            log(f"[pretrain] the snapshot shipped for {repo_id} is missing ({SHIPPED_LDM_DIRS[repo_id]}): pretraining "
                "it here instead (about 30 min on 2 CPU cores; reinstall hfpfl with its package data to skip this)")
        return _pretrain_and_publish(repo_id, cache_dir, config, output_dir, sample_grid, log)


def _pretrain_and_publish(repo_id, cache_dir, config, output_dir, sample_grid, log) -> str:
    import json as _json

    from diffusers import StableDiffusionPipeline

    import time

    from .pool import build_pool

    cfg = resolve_pretrain_config(config or PretrainConfig())
    pool = build_pool(cfg.seed, copies=cfg.pool_copies, font_masks=cfg.pool_font_masks)
    judge = probe = None
    if sample_grid:  # the judge first (its cost is the quality report's, not the LDM's), so that a probe can
        # measure plain-prompt fidelity during UNet training (the curve in pretrain_stats.json)
        from .quality import judge_train_mask, make_fidelity_probe, train_judge

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
        from .quality import measure_ldm

        stats["quality"] = measure_ldm(pipe, pool, folder, log=log, judge=judge)
        stats["quality"] = {k: (os.path.basename(v) if isinstance(v, str) else v)
                            for k, v in stats["quality"].items()}
    with open(os.path.join(folder, "pretrain_stats.json"), "w") as f:
        _json.dump(stats, f, indent=2)
    with open(os.path.join(folder, "README.md"), "w") as f:
        f.write(model_card(repo_id, stats))
    snap = push_folder_to_cache(folder, repo_id, cache_dir=cache_dir)
    log(f"[pretrain] published {repo_id} -> {snap}")
    return str(snap)


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
{stats.get('config', {}).get('vae_batch_size')}: the budget of `hfpfl.fedbip.ldm.PRETRAIN_BUDGETS` for that device).

**Quality**: class fidelity of plain prompts "a photo of the digit d" judged by a CNN trained on
{JUDGE_POOL_TEXT.get(q.get('judge_pool', 'all'), q.get('judge_pool'))} (held-out accuracy
{q.get('judge_heldout_accuracy', float('nan')):.3f}): {fid or 'not measured'}. The same
judge on VAE reconstructions of its held-out images (the ceiling of fidelity with this VAE):
{q.get('judge_on_vae_reconstructions', float('nan')):.3f}. Fidelity during UNet training (50 images, guidance 3):
{', '.join(f"{c.get('fidelity_g3', float('nan')):.2f} after {c['images_seen']} images" for c in stats.get('curve', []))
 or 'not measured'}.
Grids: `samples_per_style.png` (generated, one row per caption word), `pool_per_style.png` (training images).
"""


def resolve_ldm(ldm: str) -> str:
    """Local folder of the LDM: a folder as is; the default tiny repo id published (the shipped snapshot) on first use;
    any other repo id from the Hub cache (offline) or downloaded. Clear error when offline and not cached."""
    if os.path.isdir(ldm):
        return ldm
    if ldm == DEFAULT_LDM_REPO:
        return ensure_pretrained_ldm(ldm)
    path = cached_snapshot(ldm)
    if path is not None:
        return path
    from huggingface_hub.constants import HF_HUB_OFFLINE

    if HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "0").upper() in ("1", "ON", "YES", "TRUE"):
        raise OSError(f"LDM {ldm!r} is not a local folder and not in the local Hub cache, and HF_HUB_OFFLINE=1: "
                      f"download it once online (huggingface-cli download {ldm}), pass a local folder, or use "
                      f"the default {DEFAULT_LDM_REPO!r}")
    from huggingface_hub import snapshot_download

    return snapshot_download(ldm)
