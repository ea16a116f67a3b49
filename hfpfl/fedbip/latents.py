"""FedBiP's instance level (dissertation ch. 5, Sec. 4.2.1, Eq. 3, no optimisation): z_i(T) = delta(T, gamma E(x_i)
+ (1-gamma) E(x_i')), with a random same-class partner i' != i, gamma ~ N(0.5, 0.1^2) clipped to [0, 1], and delta
the forward noising (Eq. 1) to the maximum timestep T = num_train_timesteps - 1 (999 for SD v1); the client's images
as LDM inputs and their VAE latents; the timesteps the server's sampler visits.

Decisions where the paper (dissertation ch. 5) is silent or its code differs:
* A class with a single image has no partner (Eq. 3 requires i' != i): we raise a ValueError instead of the
  fallback i' = i, which would upload an un-interpolated latent. ``class_average=True`` (the paper's
  stricter-privacy "categorical prototype" variant, Sec. 5.6 / future work) needs no partner.
* Latents use the VAE posterior mean for the instance level (E(x) as a deterministic encoder) and posterior samples
  for concept training (as in SD / textual-inversion training); both are multiplied by ``vae.config.scaling_factor``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


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
