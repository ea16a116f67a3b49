"""Pretrain the tiny text-conditioned LDM used by FedBiP on the public MNIST pool and publish it to the local Hub cache.

    HF_HUB_OFFLINE=1 python recipes/pretrain_ldm.py --output_dir runs/tiny_ldm
    # afterwards, offline:  StableDiffusionPipeline.from_pretrained("hfpfl/tiny-ldm-digits")
    #                        FedBiPPipeline.from_pretrained("hfpfl/tiny-ldm-digits")

The pool is MNIST ``train`` + ``public`` (4,250 digits; no FedBiP client holds MNIST; ``test`` is held out to measure
the LDM's class conditioning), captioned with varied prompts naming the digit ("a photo of the digit seven",
"a mnist style of a seven", ...), 30% of them from an augmented view (bold / blurry / inverted / colored / noisy digits,
the style named in the caption). Stage 1 trains the AutoencoderKL on clean + augmented digits (MSE + small KL),
stage 2 the UNet2DConditionModel (cross-attention in every block + pooled-text time embedding) and CLIPTextModel on
the denoising loss over unit-variance VAE latents (10% empty captions for classifier-free guidance, EMA weights),
within a CPU-time budget. The pipeline is saved as a ``StableDiffusionPipeline`` (safety_checker=None), PNDM
scheduler with SD-v1 betas, plus ``hfpfl_ldm.json`` (the config fingerprint).
If the repo id is cached with the same fingerprint, nothing is trained unless ``--force``; a cached LDM
of another config or format version (e.g. v1) is retrained.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformers import HfArgumentParser  # noqa: E402

from hfpfl.fedbip.ldm import DEFAULT_LDM_REPO, PretrainConfig, ensure_pretrained_ldm  # noqa: E402

_D = PretrainConfig()


@dataclass
class PretrainArguments:
    repo_id: str = field(default=DEFAULT_LDM_REPO, metadata={"help": "Repo id to publish to the local Hub cache."})
    output_dir: str | None = field(default=None, metadata={"help": "Where the saved pipeline, pretrain_stats.json "
                                                                   "and samples_grid.png go (default: a temp dir)."})
    cache_dir: str | None = field(default=None, metadata={"help": "Hub cache dir (default: the HF_HUB_CACHE)."})
    force: bool = field(default=False, metadata={"help": "Retrain even if the repo id is already cached."})
    image_size: int = field(default=32, metadata={"help": "Image resolution (MNIST 28x28 is padded to 32)."})
    max_images: int | None = field(default=None, metadata={"help": "Cap on MNIST images used (default: all)."})
    splits: list[str] = field(default_factory=lambda: list(_D.splits),
                              metadata={"help": "MNIST splits to pretrain on (no FedBiP client holds MNIST; default "
                                                "train+public, test held out for evaluation)."})
    vae_steps: int = field(default=_D.vae_steps, metadata={"help": "VAE optimisation steps."})
    vae_batch_size: int = field(default=_D.vae_batch_size, metadata={"help": "VAE batch size."})
    vae_lr: float = field(default=_D.vae_lr, metadata={"help": "VAE AdamW learning rate (cosine decay)."})
    kl_weight: float = field(default=_D.kl_weight, metadata={"help": "Weight of the VAE KL term."})
    vae_augment_prob: float = field(default=_D.vae_augment_prob,
                                    metadata={"help": "Fraction of augmented digits in VAE batches."})
    unet_steps: int = field(default=_D.unet_steps, metadata={"help": "Max UNet + text-encoder steps (the CPU "
                                                                     "budget usually stops first)."})
    unet_batch_size: int = field(default=_D.unet_batch_size, metadata={"help": "UNet batch size."})
    unet_lr: float = field(default=_D.unet_lr, metadata={"help": "UNet AdamW peak lr (warmup, cosine over the "
                                                                  "steps or the CPU budget, whichever ends first)."})
    unet_warmup_steps: int = field(default=_D.unet_warmup_steps, metadata={"help": "Linear lr warmup steps."})
    augment_prob: float = field(default=_D.augment_prob, metadata={"help": "Fraction of UNet samples from the "
                                                                            "augmented view (style in the caption)."})
    cond_dropout: float = field(default=_D.cond_dropout,
                                metadata={"help": "Fraction of empty captions (classifier-free guidance)."})
    ema_decay: float = field(default=_D.ema_decay, metadata={"help": "EMA decay of the saved weights (0: off)."})
    seed: int = field(default=_D.seed, metadata={"help": "Random seed."})
    num_threads: int = field(default=1, metadata={"help": "torch CPU threads (1 is fastest on a shared 2-core box)."})
    time_budget_s: float | None = field(default=_D.time_budget_s,
                                        metadata={"help": "Stop UNet training once the run has used this much CPU "
                                                          "time (s); None = no cap."})


def main(argv=None):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    (args,) = HfArgumentParser(PretrainArguments).parse_args_into_dataclasses(args=argv)
    d = asdict(args)
    d["splits"] = tuple(d["splits"])
    cfg = PretrainConfig(**{k: d[k] for k in PretrainConfig.__dataclass_fields__})
    path = ensure_pretrained_ldm(args.repo_id, cache_dir=args.cache_dir, force=args.force, config=cfg,
                                 output_dir=args.output_dir)
    print(path)
    return path


if __name__ == "__main__":
    main()
