"""FedBiP client side: bi-level personalization of a frozen pretrained LDM (dissertation ch. 5, Sec. 4.2, Alg. 1).

* Instance level (Eq. 3, no optimisation): z_i(T) = delta(T, gamma E(x_i) + (1-gamma) E(x_i')), with a random
  same-class partner i' != i, gamma ~ N(0.5, 0.1^2) clipped to [0, 1], and delta the forward noising (Eq. 1)
  to the maximum timestep T = num_train_timesteps - 1 (999 for SD v1).
* Concept level (Eq. 4): domain concept S (n_s x d_w) and class concepts V (C x n_v x d_w) trained with the LDM
  denoising loss on the client's real (non-interpolated) images, every LDM weight frozen; Adam, lr 0.1,
  betas (0.9, 0.999) (paper App. A).
* Upload: exactly {"latents", "labels", "domain_concept", "class_concepts"}; the names match the arguments of
  ``FedBiPPipeline.__call__`` so the server can call ``pipe(**upload)``.

Decisions where the paper (dissertation ch. 5) is silent or its code differs:
* A class with a single image has no partner (Eq. 3 requires i' != i): we raise a ValueError instead of the
  fallback i' = i, which would upload an un-interpolated latent. ``class_average=True`` (the paper's
  stricter-privacy "categorical prototype" variant, Sec. 5.6 / future work) needs no partner.
* Latents use the VAE posterior mean for the instance level (E(x) as a deterministic encoder) and posterior samples
  for concept training (as in SD / textual-inversion training); both are multiplied by ``vae.config.scaling_factor``.
* Concept training length: ``num_epochs`` (default 50, the paper's Sec. 5.1; App. A says 30) or ``num_steps``; batch 8 (the authors' code).
* Random init (the paper): N(0, s^2) with s the std of the text encoder's token-embedding table (input space) or of
  its output states (output space), so random concepts sit at the scale of real tokens. ``init="words"`` initialises
  from real words (textual-inversion initializer tokens / the authors' code for the output space).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ..pipelines.pipeline_fedbip import encode_concept_prompt, expand_template, tokenize_concept_template

UPLOAD_KEYS = ("latents", "labels", "domain_concept", "class_concepts")


# ---------------------------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------------------------
def images_to_tensor(images, image_size: int | None = None) -> torch.Tensor:
    """PIL list / uint8 array or tensor (N,H,W[,3]) / float tensor (N,3,H,W) in [-1,1] -> float (N,3,S,S) in [-1,1]."""
    if isinstance(images, (list, tuple)) and len(images) and hasattr(images[0], "convert"):
        images = np.stack([np.asarray(im.convert("RGB")) for im in images])
    x = torch.as_tensor(images)
    if x.dtype == torch.uint8:
        x = x.float() / 127.5 - 1.0
        if x.ndim == 3:
            x = x[:, None].expand(-1, 3, -1, -1)
        elif x.shape[-1] in (1, 3):
            x = x.permute(0, 3, 1, 2).expand(-1, 3, -1, -1)
    x = x.float()
    if x.ndim != 4 or x.shape[1] != 3:
        raise ValueError(f"images must be (N, 3, H, W) floats in [-1, 1] (or PIL / uint8), got {tuple(x.shape)}")
    if image_size is not None and x.shape[-1] != image_size:
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
    return x.contiguous()


def _vae_size(vae) -> int:
    s = vae.config.sample_size
    return s if isinstance(s, int) else s[0]


@torch.no_grad()
def encode_posterior(vae, images: torch.Tensor, batch_size: int = 32):
    """VAE posterior (mean, std) of every image, *unscaled*."""
    means, stds = [], []
    for i in range(0, len(images), batch_size):
        d = vae.encode(images[i : i + batch_size].to(vae.device, vae.dtype)).latent_dist
        means.append(d.mean.float().cpu())
        stds.append(d.std.float().cpu())
    return torch.cat(means), torch.cat(stds)


@torch.no_grad()
def encode_images(vae, images: torch.Tensor, batch_size: int = 32) -> torch.Tensor:
    """z(0) = E(x) * scaling_factor (posterior mean)."""
    return encode_posterior(vae, images, batch_size)[0] * vae.config.scaling_factor


# ---------------------------------------------------------------------------------------------------------------
# instance level (Eq. 3)
# ---------------------------------------------------------------------------------------------------------------
def sample_gamma(n: int, mean: float = 0.5, std: float = 0.1, generator: torch.Generator | None = None):
    """gamma ~ N(mean, std^2), clipped to [0, 1]."""
    return (mean + std * torch.randn(n, generator=generator)).clamp_(0.0, 1.0)


def sample_partners(labels: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """For each i a uniformly random i' != i with labels[i'] == labels[i]. ValueError for single-image classes."""
    labels = torch.as_tensor(labels).long()
    partners = torch.empty_like(labels)
    for c in labels.unique().tolist():
        idx = (labels == c).nonzero().flatten()
        if len(idx) < 2:
            raise ValueError(
                f"class {c} has a single image on this client: instance-level interpolation (Eq. 3) needs a "
                f"same-class partner i' != i. Drop the class, give it more images, or use class_average=True."
            )
        # uniform over the other members: draw from len-1 slots and skip self
        r = torch.randint(0, len(idx) - 1, (len(idx),), generator=generator)
        r = r + (r >= torch.arange(len(idx))).long()
        partners[idx] = idx[r]
    return partners


def interpolate_latents(z0, labels, gamma_mean: float = 0.5, gamma_std: float = 0.1, generator=None):
    """z_bar_i(0) = gamma_i z_i(0) + (1 - gamma_i) z_i'(0). Returns (z_bar, gamma, partners)."""
    partners = sample_partners(labels, generator)
    gamma = sample_gamma(len(z0), gamma_mean, gamma_std, generator)
    g = gamma.view(-1, *([1] * (z0.ndim - 1))).to(z0.dtype)
    return g * z0 + (1 - g) * z0[partners], gamma, partners


def class_average_latents(z0, labels) -> torch.Tensor:
    """z_bar_i(0) = mean of the client's class-y_i latents (categorical prototypes, the stricter-privacy variant)."""
    labels = torch.as_tensor(labels).long()
    out = torch.empty_like(z0)
    for c in labels.unique().tolist():
        m = labels == c
        out[m] = z0[m].mean(0, keepdim=True)
    return out


def max_timestep(noise_scheduler) -> int:
    return int(noise_scheduler.config.num_train_timesteps) - 1


def sampler_timesteps(scheduler, num_inference_steps: int) -> list[int]:
    """The timesteps the server's sampler visits with ``num_inference_steps``, computed on a copy (the scheduler is
    not touched)."""
    import copy

    sched = copy.deepcopy(scheduler)
    sched.set_timesteps(num_inference_steps)
    return [int(t) for t in sched.timesteps]


def sampler_start_timestep(scheduler, num_inference_steps: int) -> int:
    """The first timestep the server's sampler denoises at (PNDM, 10 steps, leading spacing, steps_offset=1: 901;
    trailing spacing: 999). Clients noise their latents to exactly this timestep (see ``FedBiPConfig.noise_timestep``)
    so that the instance signal enters at the SNR the sampler assumes."""
    return sampler_timesteps(scheduler, num_inference_steps)[0]


def noise_to_max_timestep(z, noise_scheduler, generator=None, timestep: int | None = None) -> torch.Tensor:
    """delta(T, z) = sqrt(alpha_bar_T) z + sqrt(1 - alpha_bar_T) eps (Eq. 1) at T = num_train_timesteps - 1.

    ``noise_scheduler`` is any diffusers scheduler with ``alphas_cumprod`` (the LDM's schedule; PNDM/DDIM/DDPM share
    it). The paper noises to the *maximum* timestep (not an SDEdit strength); ``timestep`` overrides it for experiments.
    """
    t = max_timestep(noise_scheduler) if timestep is None else int(timestep)
    a = noise_scheduler.alphas_cumprod[t].to(torch.float32)
    eps = torch.randn(z.shape, generator=generator, dtype=torch.float32)
    return (a.sqrt() * z.float() + (1 - a).sqrt() * eps).to(z.dtype)


def instance_level_latents(
    vae,
    noise_scheduler,
    images,
    labels,
    latents_per_image: int = 1,
    class_average: bool = False,
    gamma_mean: float = 0.5,
    gamma_std: float = 0.1,
    generator: torch.Generator | None = None,
    batch_size: int = 32,
    timestep: int | None = None,
):
    """Instance-level personalization (Eq. 3): returns (z(T) [N*M, c, h, w], labels [N*M]).

    ``timestep``: the noising timestep (default the maximum, T = num_train_timesteps - 1; FedBiP passes the
    sampler's first timestep, :func:`sampler_start_timestep`).

    ``latents_per_image`` M > 1 gives M independent draws (new partner, gamma and noise) per image: how FedBiP-S/M/L
    (2x/5x/10x synthetic data) are produced here (one reading of Sec. 5.1's 2x/5x/10x).
    """
    x = images_to_tensor(images, _vae_size(vae))
    labels = torch.as_tensor(labels).long()
    z0 = encode_images(vae, x, batch_size)
    zs, ys = [], []
    for _ in range(latents_per_image):
        zbar = class_average_latents(z0, labels) if class_average else \
            interpolate_latents(z0, labels, gamma_mean, gamma_std, generator)[0]
        zs.append(noise_to_max_timestep(zbar, noise_scheduler, generator, timestep))
        ys.append(labels.clone())
    return torch.cat(zs), torch.cat(ys)


# ---------------------------------------------------------------------------------------------------------------
# concept level (Eq. 4)
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class ConceptResult:
    domain_concept: torch.Tensor  # S (n_s, d_w)
    class_concepts: torch.Tensor  # V (C, n_v, d_w)
    losses: list = field(default_factory=list)  # training loss per step
    init_domain_concept: torch.Tensor | None = None
    init_class_concepts: torch.Tensor | None = None


def _freeze(*modules):
    flags = [[p.requires_grad for p in m.parameters()] for m in modules]
    for m in modules:
        m.requires_grad_(False)
    return flags


def _restore(modules, flags):
    for m, fl in zip(modules, flags):
        for p, f in zip(m.parameters(), fl):
            p.requires_grad_(f)


@torch.no_grad()
def init_concepts(pipe, num_classes: int, n_s: int = 1, n_v: int = 1, prompt_template: str = "A [S] style of a [V]",
                  init: str = "random", init_std: float | None = None, domain_word: str | None = None,
                  class_words: list[str] | None = None, concept_space: str = "input", generator=None):
    """Initial S (n_s, d_w), V (C, n_v, d_w). ``init="random"`` (the paper) or ``"words"`` (real words' embeddings)."""
    te, tok = pipe.text_encoder, pipe.tokenizer
    d = te.config.hidden_size
    table = te.get_input_embeddings().weight
    if init == "random":
        if init_std is None:
            if concept_space == "input":
                init_std = float(table.std())
            else:
                ids, _, _ = tokenize_concept_template(tok, prompt_template, n_s, n_v)
                init_std = float(te(ids.to(te.device))[0].std())
        S = init_std * torch.randn(n_s, d, generator=generator)
        V = init_std * torch.randn(num_classes, n_v, d, generator=generator)
        return S, V
    if init != "words":
        raise ValueError(f"init must be 'random' or 'words', got {init!r}")
    if domain_word is None or class_words is None or len(class_words) != num_classes:
        raise ValueError("init='words' needs domain_word and one class word per class")

    def word_ids(w, n):
        ids = tok(w, add_special_tokens=False).input_ids or [tok.bos_token_id]
        return [ids[i % len(ids)] for i in range(n)]  # cycle / truncate to n tokens

    if concept_space == "input":
        S = table[word_ids(domain_word, n_s)].detach().float().cpu().clone()
        V = torch.stack([table[word_ids(w, n_v)] for w in class_words]).detach().float().cpu().clone()
        return S, V
    # output space (the authors' code): encoder outputs of the template with the real words at the placeholder positions
    ids, s_pos, v_pos = tokenize_concept_template(tok, prompt_template, n_s, n_v)
    S_acc, V = None, []
    for w in class_words:
        row = ids.clone()
        row[0, s_pos] = torch.tensor(word_ids(domain_word, n_s))
        row[0, v_pos] = torch.tensor(word_ids(w, n_v))
        h = te(row.to(te.device))[0][0].float().cpu()
        S_acc = h[s_pos] if S_acc is None else S_acc + h[s_pos]
        V.append(h[v_pos])
    return S_acc / len(class_words), torch.stack(V)


@torch.no_grad()
def concept_space_scale(text_encoder, tokenizer, prompt_template: str = "A [S] style of a [V]",
                        concept_space: str = "input", n_s: int = 1, n_v: int = 1) -> float:
    """std(space the concepts act in) / std(text-encoder output states).

    The paper's Adam lr 0.1 and perturbation sigma 0.1 come from the authors' code, where the concepts replace the
    text encoder's *output* states (the authors' code); Adam's step size and an additive sigma are absolute, so in the token-
    embedding (input) space, whose scale is the embedding table's std, the same numbers are far too large (measured
    on the MNIST-only tiny LDM: a domain concept 35x the norm of a real token after 40 steps, a perturbation 4x the
    initial concept). Multiplying lr and sigma by this ratio keeps them relative to the space they act in
    (1.0 in output space)."""
    if concept_space == "output":
        return 1.0
    if concept_space != "input":
        raise ValueError(f"concept_space must be 'input' or 'output', got {concept_space!r}")
    ids, _, _ = tokenize_concept_template(tokenizer, prompt_template, n_s, n_v)
    out_std = float(text_encoder(ids.to(text_encoder.device))[0].float().std())
    return float(text_encoder.get_input_embeddings().weight.float().std()) / out_std


def concept_denoising_loss(pipe, noise_scheduler, z0, labels, domain_concept, class_concepts, timesteps, noise,
                           prompt_template: str = "A [S] style of a [V]", concept_space: str = "input"):
    """L_g (Eq. 4) for given latents z(0), timesteps and noise draws (differentiable w.r.t. the concepts)."""
    labels = torch.as_tensor(labels).long()
    zt = noise_scheduler.add_noise(z0, noise, timesteps)
    cond = encode_concept_prompt(pipe.text_encoder, pipe.tokenizer, prompt_template, domain_concept,
                                 class_concepts[labels], concept_space)
    pred = pipe.unet(zt.to(pipe.unet.dtype), timesteps, encoder_hidden_states=cond.to(pipe.unet.dtype)).sample
    return F.mse_loss(pred.float(), noise.float())


def train_concepts(
    pipe,
    images,
    labels,
    num_classes: int,
    n_s: int = 1,
    n_v: int = 1,
    prompt_template: str = "A [S] style of a [V]",
    num_epochs: int = 50,
    num_steps: int | None = None,
    batch_size: int = 8,
    lr: float = 0.1,
    betas: tuple = (0.9, 0.999),
    init: str = "random",
    init_std: float | None = None,
    domain_word: str | None = None,
    class_words: list[str] | None = None,
    init_domain_concept: torch.Tensor | None = None,
    init_class_concepts: torch.Tensor | None = None,
    concept_space: str = "input",
    noise_scheduler=None,
    generator: torch.Generator | None = None,
    progress: bool = False,
    train_domain: bool = True,
    train_class: bool = True,
) -> ConceptResult:
    """Concept-level personalization: optimise only S and V on Eq. 4; the UNet, VAE and text encoder stay frozen
    (their parameters get requires_grad=False for the duration and are never written).

    ``train_domain=False`` / ``train_class=False`` keep S / V at their initial value (the "V only" / "S only"
    ablations of the paper's Table 3 pass the real words' embeddings as the fixed part)."""
    from diffusers import DDPMScheduler

    expand_template(prompt_template, n_s, n_v)
    noise_scheduler = noise_scheduler or DDPMScheduler.from_config(pipe.scheduler.config)
    x = images_to_tensor(images, _vae_size(pipe.vae))
    labels = torch.as_tensor(labels).long()
    if len(labels) != len(x):
        raise ValueError(f"{len(x)} images but {len(labels)} labels")
    if len(labels) and labels.max() >= num_classes:
        raise ValueError(f"label {int(labels.max())} >= num_classes={num_classes}")
    mean, std = encode_posterior(pipe.vae, x)
    sf = pipe.vae.config.scaling_factor
    if init_domain_concept is None or init_class_concepts is None:
        S0, V0 = init_concepts(pipe, num_classes, n_s, n_v, prompt_template, init, init_std, domain_word,
                               class_words, concept_space, generator)
    else:
        S0, V0 = init_domain_concept.float().cpu(), init_class_concepts.float().cpu()
    dev = pipe.unet.device
    S = torch.nn.Parameter(S0.clone().to(dev))
    V = torch.nn.Parameter(V0.clone().to(dev))
    modules = [pipe.unet, pipe.vae, pipe.text_encoder]
    flags = _freeze(*modules)
    S.requires_grad_(train_domain)
    V.requires_grad_(train_class)
    trainable = [p for p, on in ((S, train_domain), (V, train_class)) if on]
    if not trainable:
        raise ValueError("train_concepts: nothing to train (train_domain and train_class are both False)")
    opt = torch.optim.Adam(trainable, lr=lr, betas=betas)
    steps = num_steps if num_steps is not None else num_epochs * math.ceil(len(x) / batch_size)
    T = noise_scheduler.config.num_train_timesteps
    losses = []
    perm, pos = torch.randperm(len(x), generator=generator), 0
    it = range(steps)
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc="concepts")
    try:
        for _ in it:
            if pos + batch_size > len(x) and pos > 0:  # epoch-style shuffling, last partial batch folded over
                perm, pos = torch.randperm(len(x), generator=generator), 0
            idx = perm[pos : pos + batch_size]
            pos += batch_size
            z0 = (mean[idx] + std[idx] * torch.randn(mean[idx].shape, generator=generator)) * sf
            t = torch.randint(0, T, (len(idx),), generator=generator)
            eps = torch.randn(z0.shape, generator=generator)
            loss = concept_denoising_loss(pipe, noise_scheduler, z0.to(dev), labels[idx].to(dev), S, V, t.to(dev),
                                          eps.to(dev), prompt_template, concept_space)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        _restore(modules, flags)
    return ConceptResult(S.detach().cpu().clone(), V.detach().cpu().clone(), losses, S0, V0)


# ---------------------------------------------------------------------------------------------------------------
# one-shot upload
# ---------------------------------------------------------------------------------------------------------------
def client_upload(
    pipe,
    images,
    labels,
    num_classes: int,
    n_s: int = 1,
    n_v: int = 1,
    prompt_template: str = "A [S] style of a [V]",
    num_epochs: int = 50,
    num_steps: int | None = None,
    batch_size: int = 8,
    lr: float = 0.1,
    latents_per_image: int = 1,
    class_average: bool = False,
    gamma_mean: float = 0.5,
    gamma_std: float = 0.1,
    concept_space: str = "input",
    init: str = "random",
    domain_word: str | None = None,
    class_words: list[str] | None = None,
    seed: int = 0,
    timestep: int | None = None,
) -> dict[str, torch.Tensor]:
    """Run both personalization levels on one client's data and return the one-shot upload:
    exactly {"latents": z_i(T), "labels": y_i, "domain_concept": S, "class_concepts": V} -- no images, no z(0),
    no z_bar(0), no weights. ``pipe`` is any object with vae / unet / text_encoder / tokenizer / scheduler
    (a ``FedBiPPipeline`` or ``StableDiffusionPipeline``)."""
    from diffusers import DDPMScheduler

    g = torch.Generator().manual_seed(seed)
    noise_scheduler = DDPMScheduler.from_config(pipe.scheduler.config)
    x = images_to_tensor(images, _vae_size(pipe.vae))
    labels = torch.as_tensor(labels).long()
    latents, ys = instance_level_latents(pipe.vae, noise_scheduler, x, labels, latents_per_image, class_average,
                                         gamma_mean, gamma_std, g, timestep=timestep)
    res = train_concepts(pipe, x, labels, num_classes, n_s, n_v, prompt_template, num_epochs, num_steps, batch_size,
                         lr, init=init, domain_word=domain_word, class_words=class_words,
                         concept_space=concept_space, noise_scheduler=noise_scheduler, generator=g)
    return {"latents": latents, "labels": ys, "domain_concept": res.domain_concept,
            "class_concepts": res.class_concepts}
