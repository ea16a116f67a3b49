"""FedBiP (one-shot FL with a personalized latent diffusion model): engine-independent pieces.

* :mod:`hfpfl.fedbip.ldm`     tiny SD-architecture LDM, its pretraining on the broad pool, publishing to the Hub cache
* :mod:`hfpfl.fedbip.pool`    the broad public pretraining pool (the LAION stand-in)
* :mod:`hfpfl.fedbip.quality` judge classifier, plain-prompt class fidelity, per-style grids
* :mod:`hfpfl.fedbip.client`  instance-level latents, concept training, the one-shot upload
* ``pipelines.pipeline_fedbip.FedBiPPipeline``  server-side synthesis
"""

from .client import (
    UPLOAD_KEYS,
    ConceptResult,
    class_average_latents,
    client_upload,
    concept_denoising_loss,
    concept_space_scale,
    encode_images,
    images_to_tensor,
    init_concepts,
    instance_level_latents,
    interpolate_latents,
    noise_to_max_timestep,
    sample_gamma,
    sample_partners,
    sampler_start_timestep,
    train_concepts,
)
from .ldm import (
    DEFAULT_LDM_REPO,
    DIGIT_NAMES,
    PretrainConfig,
    TinyLDMConfig,
    build_tiny_ldm,
    build_tiny_tokenizer,
    digit_prompt,
    ensure_pretrained_ldm,
    make_scheduler,
    pretrain_tiny_ldm,
    state_checksum,
)
