# FedBiP server-side synthesis pipeline (diffusers one-file style, inference only).
#
# Paper: H. Chen, "FedBiP: Heterogeneous One-Shot Federated Learning with Personalized Latent Diffusion Models"
# (CVPR 2025; dissertation ch. 5, Eq. 3-5, Algorithm 1). Method card: docs/methods/fedbip.md.
#
# The server receives, per client, the noised instance latents z_i(T) with labels y_i, a domain concept
# S (n_s x d_w) and class concepts V (C x n_v x d_w). For every z_i(T) it perturbs S -> S^ = S + eta,
# eta ~ N(0, sigma^2), encodes the prompt "A [S^] style of a [V_{y_i}]" with the concept vectors inserted at the
# placeholder positions, and runs the reverse diffusion *starting from the uploaded z_i(T)* (not from fresh noise),
# then decodes with the VAE (Eq. 5).
#
# Decisions (paper the paper vs spec / authors' code the authors' code):
# * Concept placement: the paper "specific tokens in the textual template P are substituted with the concept vectors"
#   -- textual inversion: the vectors replace the *input token embeddings* of placeholder tokens
#   (concept_space="input", default). The authors' code replaces positions of the text encoder's *output* hidden states
#   (concept_space="output", option). Insertion uses a temporary forward hook on the token-embedding module, because
#   transformers 5 CLIPTextModel.forward takes no `inputs_embeds`; the LDM weights are never modified (no
#   embedding-table resize, so a real SD checkpoint is untouched).
# * Perturbation: a fresh eta per generated image (Eq. 5 read per sample; the authors' code perturbs once per client run).
#   sigma is a standard deviation, default 0.1 (paper App. A).
# * Sampler: PNDM (paper App. A) is what `from_pretrained` of an SD-v1 checkpoint gives; DDIM / DDPM via
#   `set_sampler`. Steps default 50 and guidance 1.0 (pure conditional Eq. 5); neither is stated in the paper.
# * Template: "A [S] style of a [V]" (Algorithm 1). Table 5 spellings "[STY]" / "[CLS]" are accepted as aliases.

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import PIL.Image
import torch
from diffusers import AutoencoderKL, DiffusionPipeline, PNDMScheduler, UNet2DConditionModel
from diffusers.image_processor import VaeImageProcessor
from diffusers.schedulers import KarrasDiffusionSchedulers
from diffusers.utils import BaseOutput
from diffusers.utils.torch_utils import randn_tensor
from transformers import CLIPTextModel, CLIPTokenizer

DOMAIN_MARKERS = ("[S]", "[STY]")
CLASS_MARKERS = ("[V]", "[CLS]")
PLACEHOLDER_S = "<fedbip-s{}>"
PLACEHOLDER_V = "<fedbip-v{}>"
SAMPLERS = {"pndm": "PNDMScheduler", "ddim": "DDIMScheduler", "ddpm": "DDPMScheduler"}

EXAMPLE_DOC_STRING = """
    Examples:
        ```py
        >>> from hfpfl.pipelines import FedBiPPipeline
        >>> pipe = FedBiPPipeline.from_pretrained("hfpfl/tiny-ldm-digits-broad")  # or "CompVis/stable-diffusion-v1-4"
        >>> out = pipe(**upload, num_inference_steps=20, generator=torch.Generator().manual_seed(0))
        >>> out.images, out.labels
        ```
"""


@dataclass
class FedBiPPipelineOutput(BaseOutput):
    """
    Args:
        images (`list[PIL.Image.Image]`, `np.ndarray` (N, H, W, 3) or `torch.Tensor` (N, 3, H, W), values in [0, 1];
            for `output_type="latent"` the denoised latents z~(0)).
        labels (`torch.Tensor` (N,)): the class label of each image (the uploaded y_i, in input order).
    """

    images: list[PIL.Image.Image] | np.ndarray | torch.Tensor
    labels: torch.Tensor


def placeholder_tokens(n_s: int, n_v: int) -> tuple[list[str], list[str]]:
    return [PLACEHOLDER_S.format(i) for i in range(n_s)], [PLACEHOLDER_V.format(i) for i in range(n_v)]


def expand_template(template: str, n_s: int, n_v: int) -> str:
    """Replace the domain marker ([S] / [STY]) by n_s placeholder tokens and the class marker ([V] / [CLS]) by n_v.

    Raises ValueError unless the template holds exactly one domain marker and one class marker.
    """
    n_dom = sum(template.count(m) for m in DOMAIN_MARKERS)
    n_cls = sum(template.count(m) for m in CLASS_MARKERS)
    if n_dom != 1 or n_cls != 1:
        raise ValueError(
            f"prompt_template must contain exactly one domain placeholder {DOMAIN_MARKERS} and one class placeholder "
            f"{CLASS_MARKERS}; got {template!r} ({n_dom} domain, {n_cls} class)"
        )
    s_toks, v_toks = placeholder_tokens(n_s, n_v)
    out = template
    for m in DOMAIN_MARKERS:
        out = out.replace(m, " ".join(s_toks))
    for m in CLASS_MARKERS:
        out = out.replace(m, " ".join(v_toks))
    return out


def tokenize_concept_template(tokenizer, template: str, n_s: int, n_v: int, vocab_size: int | None = None):
    """Token ids (1, L) of the expanded template and the positions of the domain / class placeholder tokens.

    Placeholder tokens are added to the tokenizer if it lacks them (tokenizer-only change). Placeholder ids (which may
    lie outside the text encoder's embedding table for a real checkpoint) are replaced by the BOS id; their
    embeddings (or outputs) are overwritten by the concept vectors anyway.
    """
    s_toks, v_toks = placeholder_tokens(n_s, n_v)
    missing = [t for t in s_toks + v_toks if t not in tokenizer.get_vocab()]
    if missing:
        tokenizer.add_tokens(missing)
    prompt = expand_template(template, n_s, n_v)
    ids = tokenizer(prompt, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                    return_tensors="pt").input_ids
    s_ids = tokenizer.convert_tokens_to_ids(s_toks)
    v_ids = tokenizer.convert_tokens_to_ids(v_toks)
    s_pos = torch.cat([(ids[0] == i).nonzero().flatten() for i in s_ids])
    v_pos = torch.cat([(ids[0] == i).nonzero().flatten() for i in v_ids])
    if len(s_pos) != n_s or len(v_pos) != n_v:
        raise ValueError(
            f"template {template!r} expanded to {prompt!r} does not fit in {tokenizer.model_max_length} tokens "
            f"(found {len(s_pos)}/{n_s} domain and {len(v_pos)}/{n_v} class placeholder tokens)"
        )
    ids = ids.clone()
    ids[0, torch.cat([s_pos, v_pos])] = tokenizer.bos_token_id
    return ids, s_pos, v_pos


def encode_concept_prompt(
    text_encoder,
    tokenizer,
    prompt_template: str,
    domain_concept: torch.Tensor,
    class_concepts: torch.Tensor,
    concept_space: Literal["input", "output"] = "input",
) -> torch.Tensor:
    """Prompt embeddings (B, L, d) with concept vectors at the placeholder positions. Differentiable w.r.t. the
    concepts (the client trains S and V through this function); the text encoder is only read.

    Args:
        domain_concept: (n_s, d_w) shared, or (B, n_s, d_w) per sample (e.g. perturbed S^).
        class_concepts: (B, n_v, d_w), the class concept V_{y_b} of each sample.
        concept_space: "input" = replace token embeddings (the paper, textual inversion); "output" = replace the text
            encoder's last hidden states (the authors' code).
    """
    if class_concepts.ndim != 3:
        raise ValueError(f"class_concepts per sample must be (B, n_v, d_w), got {tuple(class_concepts.shape)}")
    bsz, n_v, _ = class_concepts.shape
    if domain_concept.ndim == 2:
        domain_concept = domain_concept[None].expand(bsz, -1, -1)
    n_s = domain_concept.shape[1]
    ids, s_pos, v_pos = tokenize_concept_template(tokenizer, prompt_template, n_s, n_v)
    device = text_encoder.device
    ids = ids.to(device).expand(bsz, -1)

    def insert(h):
        h = h.clone()
        h[:, s_pos.to(h.device)] = domain_concept.to(h.dtype)
        h[:, v_pos.to(h.device)] = class_concepts.to(h.dtype)
        return h

    if concept_space == "input":
        handle = text_encoder.get_input_embeddings().register_forward_hook(lambda m, i, o: insert(o))
        try:
            return text_encoder(ids)[0]
        finally:
            handle.remove()
    if concept_space == "output":
        return insert(text_encoder(ids)[0])
    raise ValueError(f"concept_space must be 'input' or 'output', got {concept_space!r}")


class FedBiPPipeline(DiffusionPipeline):
    r"""
    FedBiP server-side synthesis: reverse diffusion from uploaded instance latents z_i(T), conditioned on a prompt
    carrying the client's learned (and perturbed) domain concept and the class concept of each label.

    Args:
        vae ([`AutoencoderKL`]), text_encoder ([`~transformers.CLIPTextModel`]),
        tokenizer ([`~transformers.CLIPTokenizer`]), unet ([`UNet2DConditionModel`]),
        scheduler ([`SchedulerMixin`]): the frozen pretrained LDM, e.g. loaded with
            `FedBiPPipeline.from_pretrained("CompVis/stable-diffusion-v1-4")` (a Stable Diffusion folder's extra
            `safety_checker` / `feature_extractor` entries are ignored).
    """

    model_cpu_offload_seq = "text_encoder->unet->vae"
    _optional_components = []

    def __init__(
        self,
        vae: AutoencoderKL,
        text_encoder: CLIPTextModel,
        tokenizer: CLIPTokenizer,
        unet: UNet2DConditionModel,
        scheduler: KarrasDiffusionSchedulers,
    ):
        super().__init__()
        self.register_modules(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler)
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1) if getattr(self, "vae", None) else 8
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor)

    # ---------------------------------------------------------------------------------------------------------------
    def set_sampler(self, name: str = "pndm", **overrides):
        """Swap the sampler, keeping the model's noise schedule: "pndm" (paper), "ddim" or "ddpm". ``overrides``
        (e.g. ``timestep_spacing``) apply to the checkpoint's scheduler config, not to an earlier call's: a pipeline
        shared by several runs in one process does not carry one run's overrides into the next."""
        import diffusers

        if name.lower() not in SAMPLERS:
            raise ValueError(f"unknown sampler {name!r}; choose one of {sorted(SAMPLERS)}")
        if not hasattr(self, "_checkpoint_scheduler_config"):
            self._checkpoint_scheduler_config = dict(self.scheduler.config)
        cls = getattr(diffusers, SAMPLERS[name.lower()])
        self.register_modules(scheduler=cls.from_config(self._checkpoint_scheduler_config, **overrides))
        return self

    def encode_concept_prompt(self, prompt_template, domain_concept, class_concepts, concept_space="input"):
        return encode_concept_prompt(self.text_encoder, self.tokenizer, prompt_template, domain_concept,
                                     class_concepts, concept_space)

    def timesteps_from(self, start_timestep: int) -> torch.Tensor:
        """The set sampler's timesteps from ``start_timestep`` down (call after ``scheduler.set_timesteps``).

        PNDM (PLMS, ``skip_prk_steps``) evaluates its second timestep twice: the first step is redone with the
        average of two noise predictions (a Heun-like warm-up), and its ``step`` expects that repeat. Cutting its
        schedule as the img2img pipelines do would drop the repeat and denoise a sample one step off its timestep
        from the third step on, so the repeat is rebuilt at the new second timestep."""
        full = self.scheduler.timesteps
        if full is None:
            raise ValueError("timesteps_from: call scheduler.set_timesteps(num_inference_steps) first")
        kept = full[full <= start_timestep]
        if isinstance(self.scheduler, PNDMScheduler):
            if not self.scheduler.config.skip_prk_steps:
                raise ValueError("start_timestep needs PNDM with skip_prk_steps=True (PLMS only), as SD v1 ships it")
            kept = torch.unique_consecutive(kept)
            if len(kept) > 1:
                kept = torch.cat([kept[:2], kept[1:]])
        if len(kept) == 0:
            raise ValueError(f"start_timestep {start_timestep} is below every timestep of the sampler's schedule "
                             f"(lowest {int(full.min())})")
        return kept

    def latent_shape(self) -> tuple[int, int, int]:
        size = self.unet.config.sample_size
        h, w = (size, size) if isinstance(size, int) else tuple(size)
        return self.unet.config.in_channels, h, w

    def check_inputs(self, latents, labels, domain_concept, class_concepts, prompt_template, concept_noise_sigma,
                     batch_size, concept_space, start_timestep=None):
        expand_template(prompt_template, 1, 1)  # raises on a bad template
        if concept_space not in ("input", "output"):
            raise ValueError(f"concept_space must be 'input' or 'output', got {concept_space!r}")
        exp = self.latent_shape()
        if not torch.is_tensor(latents) or latents.ndim != 4 or tuple(latents.shape[1:]) != exp:
            shape = tuple(latents.shape) if torch.is_tensor(latents) else type(latents).__name__
            raise ValueError(f"latents have shape {shape} but the UNet expects (N, {exp[0]}, {exp[1]}, {exp[2]}) "
                             f"(unet.config.in_channels={exp[0]}, sample_size={self.unet.config.sample_size})")
        if len(latents) == 0:
            raise ValueError("latents is empty: nothing to generate")
        labels = torch.as_tensor(labels)
        if labels.ndim != 1 or len(labels) != len(latents):
            raise ValueError(f"labels must be (N,) = ({len(latents)},), got {tuple(labels.shape)}")
        d = self.text_encoder.config.hidden_size
        if domain_concept.ndim != 2 or domain_concept.shape[1] != d:
            raise ValueError(f"domain_concept must be (n_s, {d}), got {tuple(domain_concept.shape)}")
        if class_concepts.ndim != 3 or class_concepts.shape[2] != d:
            raise ValueError(f"class_concepts must be (C, n_v, {d}), got {tuple(class_concepts.shape)}")
        if len(labels) and (labels.min() < 0 or labels.max() >= class_concepts.shape[0]):
            raise ValueError(f"labels must lie in [0, {class_concepts.shape[0]}) (rows of class_concepts)")
        if concept_noise_sigma < 0:
            raise ValueError(f"concept_noise_sigma must be >= 0, got {concept_noise_sigma}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        T = int(self.scheduler.config.num_train_timesteps)
        if start_timestep is not None and not 0 <= int(start_timestep) < T:
            raise ValueError(f"start_timestep must be a timestep of the schedule, 0 to {T - 1}, got {start_timestep}")

    def prepare_extra_step_kwargs(self, generator, eta):
        import inspect

        params = set(inspect.signature(self.scheduler.step).parameters.keys())
        kw = {}
        if "eta" in params:
            kw["eta"] = eta
        if "generator" in params:
            kw["generator"] = generator
        return kw

    # ---------------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(
        self,
        latents: torch.Tensor,
        labels: torch.Tensor,
        domain_concept: torch.Tensor,
        class_concepts: torch.Tensor,
        prompt_template: str = "A [S] style of a [V]",
        concept_noise_sigma: float = 0.1,
        num_inference_steps: int = 50,
        guidance_scale: float = 1.0,
        negative_prompt: str = "",
        batch_size: int = 16,
        eta: float = 0.0,
        generator: torch.Generator | None = None,
        output_type: Literal["pil", "np", "pt", "latent"] = "pil",
        concept_space: Literal["input", "output"] = "input",
        start_timestep: int | None = None,
        return_dict: bool = True,
    ):
        r"""
        Generate one image per uploaded latent.

        Args:
            latents (`torch.Tensor` (N, c, h, w)): the uploaded z_i(T) (already noised to the max timestep by the
                client); denoising starts from them.
            labels (`torch.Tensor` (N,)): y_i, selects the class concept of each image.
            domain_concept (`torch.Tensor` (n_s, d_w)): S. class_concepts (`torch.Tensor` (C, n_v, d_w)): V.
            prompt_template (`str`): must contain one domain ([S]/[STY]) and one class ([V]/[CLS]) placeholder.
            concept_noise_sigma (`float`): std of eta in S^ = S + eta, drawn per image (0 disables).
            num_inference_steps, guidance_scale, negative_prompt, eta: sampler settings (CFG when scale > 1).
            batch_size (`int`): images denoised together.
            generator (`torch.Generator`): drives eta and stochastic samplers; same seed -> same images.
            output_type: "pil", "np", "pt" (images in [0, 1]) or "latent".
            concept_space: "input" (paper, token embeddings) or "output" (authors' code, encoder outputs).
            start_timestep (`int`, *optional*): the latents are noised to this timestep; denoising runs only the
                schedule's timesteps <= it (as the img2img pipelines do for their strength). Default: the whole
                schedule, i.e. latents at the sampler's first timestep.
        Returns:
            [`FedBiPPipelineOutput`] (images, labels) or a tuple.
        """
        self.check_inputs(latents, labels, domain_concept, class_concepts, prompt_template, concept_noise_sigma,
                          batch_size, concept_space, start_timestep)
        device = self._execution_device
        dtype = self.unet.dtype
        labels = torch.as_tensor(labels, dtype=torch.long).cpu()
        domain_concept = domain_concept.detach().to(device=device, dtype=torch.float32)
        class_concepts = class_concepts.detach().to(device=device, dtype=torch.float32)
        do_cfg = guidance_scale > 1.0
        if do_cfg:
            neg_ids = self.tokenizer(negative_prompt, padding="max_length", max_length=self.tokenizer.model_max_length,
                                     truncation=True, return_tensors="pt").input_ids.to(device)
            neg_embeds = self.text_encoder(neg_ids)[0].to(dtype)
        extra_step_kwargs = self.prepare_extra_step_kwargs(generator, eta)

        outputs = []
        n = len(latents)
        with self.progress_bar(total=(n + batch_size - 1) // batch_size) as progress_bar:
            for start in range(0, n, batch_size):
                z = latents[start : start + batch_size].to(device=device, dtype=dtype)
                y = labels[start : start + batch_size].to(device)
                # S^ = S + eta, eta ~ N(0, sigma^2), a fresh draw per image (Eq. 5)
                s_hat = domain_concept[None].expand(len(z), -1, -1)
                if concept_noise_sigma > 0:
                    s_hat = s_hat + concept_noise_sigma * randn_tensor(
                        s_hat.shape, generator=generator, device=device, dtype=s_hat.dtype)
                embeds = encode_concept_prompt(self.text_encoder, self.tokenizer, prompt_template, s_hat,
                                               class_concepts[y], concept_space).to(dtype)
                if do_cfg:
                    embeds = torch.cat([neg_embeds.expand(len(z), -1, -1), embeds])
                # every batch restarts the sampler (PNDM keeps a multistep history)
                self.scheduler.set_timesteps(num_inference_steps, device=device)
                timesteps = self.scheduler.timesteps
                if start_timestep is not None:
                    timesteps = self.timesteps_from(start_timestep)
                z = z * self.scheduler.init_noise_sigma
                for t in timesteps:
                    model_in = torch.cat([z] * 2) if do_cfg else z
                    model_in = self.scheduler.scale_model_input(model_in, t)
                    noise_pred = self.unet(model_in, t, encoder_hidden_states=embeds, return_dict=False)[0]
                    if do_cfg:
                        uncond, cond = noise_pred.chunk(2)
                        noise_pred = uncond + guidance_scale * (cond - uncond)
                    z = self.scheduler.step(noise_pred, t, z, **extra_step_kwargs, return_dict=False)[0]
                if output_type == "latent":
                    outputs.append(z)
                else:
                    outputs.append(self.vae.decode(z / self.vae.config.scaling_factor, return_dict=False)[0])
                progress_bar.update()

        image = torch.cat(outputs)
        if output_type != "latent":
            image = self.image_processor.postprocess(image, output_type=output_type)
        self.maybe_free_model_hooks()
        if not return_dict:
            return image, labels
        return FedBiPPipelineOutput(images=image, labels=labels)
