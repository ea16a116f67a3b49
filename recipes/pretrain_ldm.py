"""Pretrain the tiny text-conditioned LDM used by FedBiP on the broad public digit-style pool and publish it to the
local Hub cache.

    HF_HUB_OFFLINE=1 python recipes/pretrain_ldm.py --output_dir runs/tiny_ldm
    # --device auto (default): on a CUDA machine the judge, VAE, text tower and UNet train there, with the
    # accelerator budget (hfpfl.fedbip.pretraining.PRETRAIN_BUDGETS: VAE 3000 x 64, UNet 4000 x 128; ~7 min on one H100)
    # afterwards, offline:  StableDiffusionPipeline.from_pretrained("hfpfl/tiny-ldm-digits-broad")
    #                        FedBiPPipeline.from_pretrained("hfpfl/tiny-ldm-digits-broad")

The pool is ``hfpfl.fedbip.pool.build_pool``: the public splits of every Digits domain plus procedural styles
(fonts, colours, photo backgrounds/textures, inversions, strokes, blur, noise), captioned "a photo of the digit seven"
or "a {generic style word} photo of the digit seven" (the LAION stand-in). Afterwards a judge CNN (trained on the
pool's real public images, --judge_pool public; or the whole pool) measures the class fidelity of plain prompts and
grids per style are written (pretrain_stats.json, README.md).
Stage 1 trains the AutoencoderKL (MSE + small KL); stage 2 the CLIPTextModel as CLIP's text tower, contrastively
against a frozen image CNN trained on the pool's labels (LiT), then freezes it; stage 3 the UNet2DConditionModel
(cross-attention + the global text path ``addition_embed_type="text"``) on the text-conditioned denoising loss over
unit-variance VAE latents (10% empty captions for classifier-free guidance).
The pipeline is saved as a ``StableDiffusionPipeline`` (safety_checker=None), PNDM scheduler with SD-v1 betas.
If the repo id is already cached, nothing is trained unless ``--force``; ``--measure_only`` measures the cached
model under both judges (judges.json) without training it.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field


from hfpfl.fedbip.ldm import TinyLDMConfig  # noqa: E402
from hfpfl.fedbip.pretraining import PretrainConfig, ldm_config, measure_cached_ldm, pretrain_ldm  # noqa: E402
from hfpfl.fedbip.publish import DEFAULT_LDM_REPO  # noqa: E402
from hfpfl.hub import cached_snapshot  # noqa: E402


@dataclass
class PretrainArguments:
    repo_id: str = field(default=DEFAULT_LDM_REPO, metadata={"help": "Repo id to publish to the local Hub cache."})
    output_dir: str | None = field(default=None, metadata={"help": "Where the saved pipeline, pretrain_stats.json "
                                                                   "and samples_grid.png go (default: a temp dir)."})
    cache_dir: str | None = field(default=None, metadata={"help": "Hub cache dir (default: the HF_HUB_CACHE)."})
    force: bool = field(default=False, metadata={"help": "Retrain even if the repo id is already cached."})
    image_size: int = field(default=32, metadata={"help": "Image resolution (MNIST 28x28 is padded to 32)."})
    latent_size: int | None = field(default=None, metadata={
        "help": "Side of the VAE latent (default: image_size / 4, i.e. 8 for 32x32 images, the shipped "
                "hfpfl/tiny-ldm-digits-broad). 16 for 32x32 images = factor 2: 4x the latent pixels, ~5x the UNet's "
                "CPU cost; measured on an H100 in CHANGELOG.md, not shipped. Needs its own --repo_id (as do --image_size and --unet_channels / --unet_attention other than the shipped model's)."})
    unet_channels: list[int] | None = field(default=None, metadata={
        "help": "Channels per UNet level, e.g. 32 64 64 (default: 32 64, the shipped model's)."})
    unet_attention: list[int] | None = field(default=None, metadata={
        "help": "Per UNet level, 1 = a cross-attention block, 0 = plain ResNet blocks, e.g. 0 1 0 (default: 1 on "
                "every level but the lowest). With --latent_size 16, --unet_channels 32 64 64 --unet_attention 0 1 0 "
                "is the shipped UNet with a plain 16x16 level on top (~2.4x its CPU cost)."})
    max_images: int | None = field(default=None, metadata={"help": "Cap on public images used (default: all)."})
    device: str = field(default="auto", metadata={
        "help": "Where to train: auto (CUDA when available, else cpu), cpu, cuda, cuda:N. The step and batch "
                "defaults below are the device's budget (hfpfl.fedbip.pretraining.PRETRAIN_BUDGETS)."})
    vae_steps: int | None = field(default=None, metadata={"help": "VAE optimisation steps (default: 400 on the CPU, "
                                                                   "3000 on an accelerator)."})
    vae_batch_size: int | None = field(default=None, metadata={
        "help": "VAE batch size (default: 32 CPU, 64 accelerator)."})
    vae_lr: float = field(default=2e-3, metadata={"help": "VAE AdamW learning rate (cosine decay)."})
    kl_weight: float = field(default=1e-6, metadata={"help": "Weight of the VAE KL term."})
    clip_steps: int = field(default=600, metadata={"help": "Contrastive (LiT) text-tower steps; 0 = a frozen random "
                                                           "text encoder (the UNet then ignores captions)."})
    unet_steps: int | None = field(default=None, metadata={
        "help": "UNet optimisation steps (default: 3000 on the CPU, 4000 of a 4x batch on an accelerator)."})
    unet_batch_size: int | None = field(default=None, metadata={"help": "UNet batch size (default: 32 CPU, 128 "
                                                                         "accelerator)."})
    unet_lr: float = field(default=2e-3, metadata={"help": "UNet AdamW learning rate (cosine decay)."})
    unet_warmup_steps: int = field(default=100, metadata={"help": "Linear learning-rate warm-up steps of the UNet."})
    probe_every: int = field(default=500, metadata={
        "help": "Measure plain-prompt fidelity (the judge, 50 images) every this many UNet steps: the training curve in "
                "pretrain_stats.json (0 = never; its time is not counted as pretraining time)."})
    cond_dropout: float = field(default=0.1, metadata={"help": "Fraction of empty captions (classifier-free guidance)."})
    judge_pool: str = field(default="public", metadata={
        "help": "Training images of the quality judge: public = the pool's real public splits only (mnist / usps / "
                "mnistm / syn public images, 'judge trained on real public images'); all = the whole pool "
                "(public + procedural styles, recipe v4's judge)."})
    measure_only: bool = field(default=False, metadata={
        "help": "Train nothing: measure the cached --repo_id under both judges (held-out accuracy, plain-prompt "
                "fidelity of the same 100 images per guidance scale) and write judges.json to --output_dir."})
    seed: int = field(default=0, metadata={"help": "Random seed."})
    num_threads: int = field(default=1, metadata={"help": "torch CPU threads (1 is fastest on a shared 2-core box)."})
    time_budget_s: float | None = field(default=None, metadata={
        "help": "Stop UNet training once the run has used this much CPU time (s); None = exactly unet_steps "
                "(same seed, same weights)."})

    def __post_init__(self):
        at_least = {"vae_steps": 1, "vae_batch_size": 1, "unet_steps": 1, "unet_batch_size": 1, "num_threads": 1,
                    "image_size": 8, "clip_steps": 0, "unet_warmup_steps": 0, "probe_every": 0}
        for name, low in at_least.items():
            if getattr(self, name) is not None and getattr(self, name) < low:
                raise ValueError(f"--{name} must be >= {low}, got {getattr(self, name)}; pass --{name} {low} or more")
        for name in ("vae_lr", "unet_lr"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"--{name} must be a positive finite learning rate, got {getattr(self, name)}")
        if not 0 <= self.cond_dropout < 1:
            raise ValueError(f"--cond_dropout must be in [0, 1), got {self.cond_dropout}")
        if self.judge_pool not in ("public", "all"):
            raise ValueError(f"--judge_pool must be public or all, got {self.judge_pool!r}")
        if self.measure_only and not self.output_dir:
            raise ValueError("--measure_only needs --output_dir (where judges.json goes)")
        import torch

        try:
            dev = torch.device("cpu" if self.device == "auto" else self.device)
        except RuntimeError:
            raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {self.device!r}") from None
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {self.device}: CUDA is not available on this machine; pass --device cpu "
                             "(or auto)")
        try:
            TinyLDMConfig.for_latent_size(self.image_size, self.latent_size)
        except ValueError:
            raise ValueError(latent_size_advice(self.image_size, self.latent_size)) from None
        if self.unet_attention is not None and any(a not in (0, 1) for a in self.unet_attention):
            raise ValueError(f"--unet_attention takes 0 or 1 per UNet level, got {self.unet_attention}")
        try:
            model = ldm_config(PretrainConfig(image_size=self.image_size, latent_size=self.latent_size,
                                              unet_channels=self.unet_channels, unet_attention=self.unet_attention))
        except ValueError as e:
            raise ValueError(f"--{e}; e.g. --unet_channels 32 64 64 --unet_attention 0 1 0") from None
        if self.repo_id == DEFAULT_LDM_REPO and not self.measure_only:
            # another architecture under the default id would be skipped when the shipped model is cached (nothing
            # trained) or, when it is not, become the LDM every FedBiP run loads by default, without a word
            def shape(m):
                return m.image_size, tuple(m.vae_channels), tuple(m.unet_channels), m.unet_block_types()

            if shape(model) != shape(ldm_config(PretrainConfig())):
                raise ValueError(f"--image_size / --latent_size / --unet_channels / --unet_attention build a model "
                                 f"other than the shipped {DEFAULT_LDM_REPO}; pass --repo_id <org>/<name> to publish "
                                 "it under its own id (load it with recipes/fedbip.py --ldm <org>/<name>)")
        if self.max_images is not None and self.max_images < 1:
            raise ValueError(f"--max_images must be >= 1 (or None for all), got {self.max_images}")



RECIPE_OPTIONS = PretrainArguments  # this recipe's options (docs/reference/options.md lists them)

def latent_size_advice(image_size: int, latent_size: int | None) -> str:
    """The error for a latent side that does not divide ``image_size`` by a power of two, with only values
    :meth:`TinyLDMConfig.for_latent_size` accepts as advice (factor 4, the default's, first)."""
    valid = []
    for factor in (4, 2, 8, 1):
        if image_size % factor == 0:
            try:
                TinyLDMConfig.for_latent_size(image_size, image_size // factor)
                valid.append(image_size // factor)
            except ValueError:
                pass
    choices = " or ".join(str(v) for v in valid[:2])
    if latent_size is None:
        return (f"--image_size {image_size} has no default latent side (image_size / 4 is not whole); pass "
                f"--latent_size {choices}, or an --image_size divisible by 4 (e.g. {4 * round(image_size / 4) or 4})")
    return (f"--latent_size must divide --image_size {image_size} by a power of two (1, 2, 4, ...), got "
            f"{latent_size}; pass --latent_size {choices}" + (", or leave it out" if image_size % 4 == 0 else ""))


def main(argv=None):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from hfpfl.cli import fail
    from hfpfl.arguments import make_parser

    try:
        (args,) = make_parser([PretrainArguments], prog="recipes/pretrain_ldm.py").parse_args_into_dataclasses(
            args=argv)
    except ValueError as e:  # a bad value: one line naming the option, exit code 2, nothing trained or written
        fail(e)
    if args.measure_only:
        import torch

        path = cached_snapshot(args.repo_id, cache_dir=args.cache_dir, required_file="model_index.json")
        if path is None:
            fail(ValueError(f"--measure_only: {args.repo_id} is not in the Hub cache; run without --measure_only to "
                            "pretrain it first"))
        torch.set_num_threads(args.num_threads)
        os.makedirs(args.output_dir, exist_ok=True)
        measure_cached_ldm(path, args.output_dir, seed=args.seed)
        print(os.path.join(args.output_dir, "judges.json"))
        return path
    d = asdict(args)
    cfg = PretrainConfig(**{k: d[k] for k in PretrainConfig.__dataclass_fields__ if k in d})
    path = pretrain_ldm(args.repo_id, cfg, cache_dir=args.cache_dir, force=args.force, output_dir=args.output_dir)
    print(path)
    return path


if __name__ == "__main__":
    main()
