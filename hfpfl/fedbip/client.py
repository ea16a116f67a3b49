"""FedBiP client side: bi-level personalization of a frozen pretrained LDM (dissertation ch. 5, Sec. 4.2, Alg. 1).

* Instance level (Eq. 3, no optimisation): :mod:`hfpfl.fedbip.latents`.
* Concept level (Eq. 4): :mod:`hfpfl.fedbip.concepts`.
* Upload: exactly {"latents", "labels", "domain_concept", "class_concepts"}; the names match the arguments of
  ``FedBiPPipeline.__call__`` so the server can call ``pipe(**upload)``.
"""

from __future__ import annotations

import torch

from .concepts import train_concepts
from .latents import _vae_size, images_to_tensor, instance_level_latents

UPLOAD_KEYS = ("latents", "labels", "domain_concept", "class_concepts")


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
