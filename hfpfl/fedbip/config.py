"""FedBiP's options (:class:`FedBiPConfig`, each with its check) and what each personalization level uploads (the
paper's Table 3). Light to import: the pipeline module is read only when an option is checked."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ..options import Check, at_least, non_negative, one_of, positive, validate

UPLOAD = "fedbip"  # the one upload part: latents, labels, domain_concept, class_concepts

PERSONALIZATION_LEVELS = ("full", "instance", "concept", "domain", "class", "none")
UPLOAD_KEYS_BY_LEVEL = {
    "full": ("latents", "labels", "domain_concept", "class_concepts"),
    "instance": ("latents", "labels"),
    "concept": ("labels", "domain_concept", "class_concepts"),
    "domain": ("labels", "domain_concept"),  # the paper's Table 3 "S^ only": learned S, real class words
    "class": ("labels", "class_concepts"),  # the paper's Table 3 "V only": real domain word, learned V
    "none": ("labels",),
}
NOISE_TIMESTEPS = ("resolution_matched", "sampler_start", "max")
DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def _template_ok(template) -> bool:
    from ..pipelines.pipeline_fedbip import expand_template

    try:
        expand_template(str(template), 1, 1)
    except ValueError:
        return False
    return True


def _sampler_ok(name) -> bool:
    from ..pipelines.pipeline_fedbip import SAMPLERS

    return str(name).lower() in SAMPLERS


_TEMPLATE = Check(_template_ok, "a prompt with exactly one domain placeholder ([S] or [STY]) and one class "
                                "placeholder ([V] or [CLS]), e.g. 'A [S] style of a [V]'")
_SAMPLER = Check(_sampler_ok, "one of pndm, ddim, ddpm")
_NOISE_TIMESTEP = Check(lambda v: v in NOISE_TIMESTEPS or str(v).isdigit(),
                        f"one of {', '.join(NOISE_TIMESTEPS)} or a whole number >= 0")
_WORDS = Check(lambda v: all(w.strip() for w in str(v).split(",")),
               "comma-separated words, none of them empty (e.g. 'usps,mnist')")


@dataclass
class FedBiPConfig:
    ldm: str = field(default="hfpfl/tiny-ldm-digits-broad", metadata={
        "help": "Frozen pretrained latent diffusion model: a Hub repo id or a local folder, loaded with "
                "FedBiPPipeline.from_pretrained (e.g. CompVis/stable-diffusion-v1-4). The default tiny LDM is "
                "pretrained on a broad public digit-style pool (hfpfl.fedbip.pool); it ships with hfpfl and is "
                "published to the local Hub cache on first use."})
    multiplier: int = field(default=2, metadata={
        "help": "Synthetic images per real client image: 2 / 5 / 10 = FedBiP-S / -M / -L (paper §5.1).",
        "check": at_least(1)._replace(allowed=">= 1 (2/5/10 = FedBiP-S/M/L)")})
    personalization: str = field(default="full", metadata={
        "help": "full (FedBiP: instance + concept level) | instance (latents + real-word prompt) | concept (learned "
                "S and V, random latents) | domain (learned S only) | class (learned V only) | none (prompt only "
                "with real words, random latents) (paper Table 3).", "check": one_of(*PERSONALIZATION_LEVELS)})
    n_s: int = field(default=1, metadata={"help": "Domain-concept tokens n_s (paper Table 5: 1 for style datasets).",
                                          "check": at_least(1)})
    n_v: int = field(default=1, metadata={"help": "Tokens per class concept n_v (n_c in the paper's Table 5).",
                                          "check": at_least(1)})
    concept_epochs: int = field(default=50, metadata={
        "help": "Concept-training epochs over the client's data (paper §5.1: 50; App. A: 30).", "check": at_least(1)})
    concept_steps: int | None = field(default=None, metadata={
        "help": "Exact concept-training steps (overrides concept_epochs).", "check": at_least(1)})
    concept_lr: float = field(default=0.1, metadata={"help": "Adam learning rate of the concepts (paper App. A: 0.1).",
                                                     "check": positive()})
    concept_batch_size: int = field(default=8, metadata={"help": "Concept-training batch size (the authors' code: 8).",
                                                         "check": at_least(1)})
    concept_init: str = field(default="random", metadata={
        "help": "random (the paper: N(0, s^2) at the scale of the token embeddings) | words (from the real domain/class "
                "words, as the authors' code).", "check": one_of("random", "words")})
    concept_space: str = field(default="input", metadata={
        "help": "input: concepts replace token embeddings (the paper, textual inversion) | output: replace the text "
                "encoder's output states (the authors' code).", "check": one_of("input", "output")})
    prompt_template: str = field(default="A [S] style of a [V]", metadata={
        "help": "Prompt with one domain placeholder ([S] or [STY]) and one class placeholder ([V] or [CLS]) "
                "(paper Algorithm 1).", "check": _TEMPLATE})
    concept_noise_sigma: float = field(default=0.1, metadata={
        "help": "Std of the perturbation eta of the domain concept, S^ = S + eta, per image (paper App. A: 0.1); in "
                "output-space units when concept_scale=auto.", "check": non_negative()})
    concept_scale: str = field(default="auto", metadata={
        "help": "auto: concept_lr and concept_noise_sigma are the authors' output-space settings and are "
                "multiplied by std(token embeddings)/std(encoder outputs) when the concepts live in the input space "
                "(1.0 in output space) | none: use them literally in whatever space the concepts live.",
        "check": one_of("auto", "none")})
    noise_timestep: str = field(default="sampler_start", metadata={
        "help": "Timestep clients noise their latents to: sampler_start (the server sampler's first timestep, so the "
                "instance signal enters at the SNR the sampler assumes; 901 for PNDM with 10 leading steps) | "
                "resolution_matched (the paper's T scaled to the LDM's latent size, so that as much of each image "
                "survives, scale for scale, as SD v1's 64x64 latent keeps at T=999; the sampler starts there: 551 "
                "for the tiny LDM's 8x8 latents with 20 PNDM steps, sampler_start on SD itself. More style reaches "
                "the synthetics, but on the tiny LDM they come closer to the client's images than its own test "
                "images are, with a 5-9x membership-inference gap: CHANGELOG.md) | max "
                "(num_train_timesteps-1 = 999, the paper's literal T; with leading spacing the sampler then starts at a "
                "lower timestep than the noise level) | an integer (the first sampler timestep at or above it: clients noise "
                "there and the sampler starts there; scripts/fedbip_noise_sweep.py measures style against closeness per "
                "timestep, CHANGELOG.md).", "check": _NOISE_TIMESTEP})
    timestep_spacing: str | None = field(default=None, metadata={
        "help": "Sampler timestep spacing override: leading (the SD-v1 config) | trailing (the first step is T=999, "
                "so sampler_start and max coincide) | linspace; default: the LDM's scheduler config.",
        "check": one_of("leading", "trailing", "linspace")})
    sampler: str = field(default="pndm", metadata={"help": "Server sampler: pndm (paper App. A) | ddim | ddpm.",
                                                   "check": _SAMPLER})
    num_inference_steps: int = field(default=50, metadata={"help": "Reverse-diffusion steps (not stated in the paper).",
                                                           "check": at_least(1)})
    guidance_scale: float = field(default=1.0, metadata={
        "help": "Classifier-free guidance scale; 1.0 = the pure conditional Eq. 5 (not stated in the paper).",
        "check": at_least(1)._replace(allowed=">= 1 (1 = no guidance)")})
    class_average: bool = field(default=False, metadata={
        "help": "Instance level from class-average latents (categorical prototypes, the paper's §5.6 stricter privacy) "
                "instead of pairwise interpolation."})
    singleton_classes: str = field(default="error", metadata={
        "help": "A class with one image on a client has no same-class partner for Eq. 3: error (default: the paper "
                "requires i' != i) | self (fallback i' = i: that latent is not interpolated, only noised; "
                "logged) | drop (no latent for it; its concepts are still trained). Label-skew (Dirichlet) splits "
                "need self or drop, or class_average.", "check": one_of("error", "self", "drop")})
    gamma_std: float = field(default=0.1, metadata={
        "help": "Std of the interpolation weight gamma ~ N(0.5, std^2) clipped to [0, 1] (paper Eq. 3: 0.1).",
        "check": non_negative()})
    classifier_epochs: int = field(default=50, metadata={
        "help": "Server classifier epochs on the synthetic set (paper App. A: 50); optimizer, lr, momentum and batch "
                "size come from --optimizer/--lr/--momentum/--batch_size.", "check": at_least(1)})
    classifier_steps: int | None = field(default=None, metadata={
        "help": "Exact server classifier steps (overrides --classifier_epochs): a budget that does not grow with the "
                "synthetic set, so rows of different amounts (2x / 5x / 10x) and the real-data baselines can be "
                "matched step for step.", "check": at_least(1)})
    synthesis_batch_size: int = field(default=64, metadata={"help": "Latents denoised together on the server.",
                                                            "check": at_least(1)})
    domain_words: str | None = field(default=None, metadata={
        "help": "Comma-separated real domain word per client for the real-word prompts (default: the word the tiny "
                "LDM's pretraining captions gave the public images of the client's domain, usps -> handwritten, "
                "mnistm -> textured, syn -> printed, mnist -> handwritten; else the domain name; 'image' when a "
                "client holds several domains).", "check": _WORDS})
    class_words: str | None = field(default=None, metadata={
        "help": "Comma-separated real class words (default: digit names for digit labels, else the label names).",
        "check": _WORDS})
    save_grid: bool = field(default=True, metadata={
        "help": "Write synthetic_grid.png (real vs synthetic images per client and class) to --output_dir."})
    grid_per_class: int = field(default=3, metadata={"help": "Images per class and client in the grid.",
                                                     "check": at_least(1)})
    privacy_metrics: bool = field(default=True, metadata={
        "help": "Report membership-inference gaps and synthetic-to-real nearest-neighbour distances."})
    reuse_concepts: bool = field(default=True, metadata={
        "help": "Memoise identical concept trainings within the process (same LDM, client data, seed, settings)."})

    #: the options that set the step size of what this method trains (named when training diverges; --lr, which
    #: trains the server classifier, always is)
    STEP_SIZES: ClassVar[dict[str, str]] = {"concept_lr": "lower"}

    def __post_init__(self):
        validate(self)

    @property
    def upload_keys(self) -> tuple[str, ...]:
        return UPLOAD_KEYS_BY_LEVEL[self.personalization]

