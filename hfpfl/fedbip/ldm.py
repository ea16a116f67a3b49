"""Tiny text-conditioned latent diffusion model built from real diffusers / transformers classes, and where a run
finds an LDM (:func:`resolve_ldm`).

The components are exactly the classes of ``CompVis/stable-diffusion-v1-4`` (``AutoencoderKL``,
``UNet2DConditionModel``, ``CLIPTextModel`` + ``CLIPTokenizer``, a PNDM scheduler with the SD v1 betas), only with
tiny configs, so that everything written against them also runs against the real checkpoint. The tokenizer is
:mod:`hfpfl.fedbip.tokenizer`'s; pretraining on the broad public pool is :mod:`hfpfl.fedbip.pretraining` (the
recipe side: ``recipes/pretrain_ldm.py``); the snapshot shipped with hfpfl is published by
:mod:`hfpfl.fedbip.publish`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..hub import cached_snapshot, is_offline
from .publish import DEFAULT_LDM_REPO, ensure_pretrained_ldm
from .tokenizer import DIGIT_NAMES, build_tiny_tokenizer


def digit_prompt(label: int) -> str:
    """Plain pretraining caption of a digit, e.g. ``"a photo of the digit seven"``."""
    return f"a photo of the digit {DIGIT_NAMES[int(label)]}"


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
    if is_offline():
        raise OSError(f"LDM {ldm!r} is not a local folder and not in the local Hub cache, and HF_HUB_OFFLINE=1: "
                      f"download it once online (huggingface-cli download {ldm}), pass a local folder, or use "
                      f"the default {DEFAULT_LDM_REPO!r}")
    from huggingface_hub import snapshot_download

    return snapshot_download(ldm)
