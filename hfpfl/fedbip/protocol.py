"""FedBiP protocol settings shared by the engine plug-in (:mod:`hfpfl.fedbip.method`) and the tests: the noising
timestep, the concept-space scale of lr / sigma, the mixed (learned + real-word) concepts of the "S only" / "V only"
ablations, and the synthetic set gathered from the clients' uploads."""

from __future__ import annotations

import logging

import torch

from .latents import sampler_timesteps

logger = logging.getLogger("hfpfl")


# SD v1's latents are 64 x 64 (512 px images, VAE factor 8): the LDM the paper's "maximum timestep" refers to
REFERENCE_LATENT_SIDE = 64


def resolution_matched_timestep(scheduler, latent_side: int, reference_side: int = REFERENCE_LATENT_SIDE) -> int:
    """The timestep at which a ``latent_side``-wide latent keeps as much of its image as SD v1's 64 x 64 latent keeps
    at the maximum timestep T, scale for scale.

    A feature spanning a fixed fraction of the image covers (side/k)^2 latent pixels; averaging them divides the
    noise variance by that count, so its SNR is SNR(t) * (side/k)^2. SD v1 at T = 999 (alpha_bar 0.0047, SNR 0.0047)
    therefore keeps an image's colours and layout (the known low-frequency leak of its schedule, Lin et al., WACV
    2024), which is what lets FedBiP's instance latents carry a client's style; an 8 x 8 latent at the same timestep
    keeps 64x less SNR at every scale and loses them. Matching SNR(t) = SNR_SD(T) * (reference_side / latent_side)^2
    is the resolution shift of Hoogeboom et al. (simple diffusion, ICML 2023): t = 535 for 8 x 8 latents, 999 for
    64 x 64. Returns the largest t whose SNR is at least the target."""
    ab = scheduler.alphas_cumprod.double()
    snr = ab / (1 - ab)
    target = snr[-1] * (reference_side / latent_side) ** 2
    return int((snr >= target).nonzero().max())


def noising_timestep(pipe, config) -> tuple[int, int]:
    """(t clients noise to, t the server's sampler starts at) for ``config.noise_timestep``.

    The paper noises to "the maximum timestep T"; with SD-v1's PNDM (leading spacing, steps_offset=1) and 10 steps the
    sampler's first step is t=901, not 999, so latents noised to 999 (alpha_bar 0.0047) would be denoised as if at
    901 (alpha_bar 0.0140): the instance signal enters at the wrong SNR. ``sampler_start``: noise to the sampler's
    first timestep (with ``timestep_spacing=trailing`` that *is* T = 999, the paper's literal choice).
    ``resolution_matched``: the first schedule timestep at or above :func:`resolution_matched_timestep` (at least as
    much noise as SD's T at every image scale), and the sampler starts there (an integer: the first schedule timestep
    at or above it, likewise); for a 64 x 64 latent (SD v1) that is
    ``sampler_start``, the paper's setting. Not the default: on the tiny LDM it lifts instance-only above
    prompt-only but its synthetic images sit closer to the clients' train images than their real test images do and
    the membership-inference gap grows 5-9x (CHANGELOG.md), the leak FedBiP's noising exists to
    prevent. The paper (and spec ambiguity 1: "not an intermediate, SDEdit-style strength") noises to the maximum
    T; we follow it by default, and ``resolution_matched`` is an explicit stand-in experiment, not the paper's
    choice."""
    timesteps = sampler_timesteps(pipe.scheduler, config.num_inference_steps)
    t0, T = timesteps[0], int(pipe.scheduler.config.num_train_timesteps)
    choice = str(config.noise_timestep)
    if choice == "sampler_start":
        return t0, t0
    if choice == "max":
        return T - 1, t0
    if choice == "resolution_matched":
        target = resolution_matched_timestep(pipe.scheduler, pipe.latent_shape()[-1])
        above = [t for t in timesteps if t >= target]
        t = min(above) if above else t0
        return t, t
    if not 0 <= int(choice) < T:
        raise ValueError(f"--noise_timestep must be a timestep of the LDM's schedule, 0 to {T - 1} (or "
                         f"sampler_start, resolution_matched, max), got {choice}")
    # an explicit level: the sampler starts where the clients noise (a sampler that assumes more noise than the
    # latents carry denoises the wrong signal-to-noise ratio, a mismatch measured on the tiny LDM)
    above = [t for t in timesteps if t >= int(choice)]
    t = min(above) if above else t0
    return t, t


def concept_settings(pipe, config) -> tuple[float, float, float]:
    """(Adam lr, perturbation sigma, space scale) of the concepts; see :func:`hfpfl.fedbip.concepts.concept_space_scale`.

    lr 0.1 / sigma 0.1 (dissertation ch. 5, App. A) may be read as given in whatever space the concepts live; the authors' code
    applies them in the text encoder's *output* space (the authors' code). The paper (the paper) places the concepts in the input
    (token-embedding) space, which we follow, so ``concept_scale=auto`` converts the two numbers to that space."""
    from .concepts import concept_space_scale

    scale = 1.0
    if config.concept_scale == "auto":
        scale = concept_space_scale(pipe.text_encoder, pipe.tokenizer, config.prompt_template, config.concept_space,
                                    config.n_s, config.n_v)
    return config.concept_lr * scale, config.concept_noise_sigma * scale, scale


def mixed_init(algo, client_id: int, train_s: bool, train_v: bool, seed: int):
    """Initial (S, V) for the "S only" / "V only" ablations: the learned part drawn as ``concept_init`` says, the
    fixed part the embedding of the real words (exactly the real prompt's tokens)."""
    from .concepts import init_concepts

    cfg = algo.config
    S_w, V_w = algo.word_concepts(client_id)
    domain, classes = algo.words(client_id) if cfg.concept_init == "words" else (None, None)
    S_0, V_0 = init_concepts(algo.pipe, algo.ctx.data.num_labels, cfg.n_s, cfg.n_v, cfg.prompt_template,
                             cfg.concept_init, None, domain, classes, cfg.concept_space,
                             torch.Generator().manual_seed(seed))
    return (S_0 if train_s else S_w), (V_0 if train_v else V_w)


def synthetic_set(updates) -> dict:
    """D_syn = every upload's synthetic images (made by ``FedBiP.receive``, one client at a time, each in its own
    seeded generator, on whichever process held the upload), in client order, with each image's client."""
    xs, ys, cs = [], [], []
    for u in sorted(updates, key=lambda u: u.client_id):
        x, y = u.received["synthetic"]
        xs.append(x.cpu())
        ys.append(y.cpu())
        cs.append(torch.full((len(y),), u.client_id, dtype=torch.long))
    return {"images": torch.cat(xs), "labels": torch.cat(ys), "clients": torch.cat(cs)}
