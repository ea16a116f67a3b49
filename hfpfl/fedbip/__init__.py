"""FedBiP (one-shot FL with a personalized latent diffusion model; Chen et al., CVPR 2025; dissertation ch. 5), one
method package laid out like a peft tuner:

* :mod:`.config`     :class:`FedBiPConfig`, the options and what each personalization level uploads
* :mod:`.method`     :class:`FedBiP`, the engine plug-in (registered as ``fedbip``)
* :mod:`.client`     the one-shot upload: :mod:`.latents` (instance level, Eq. 3) and :mod:`.concepts` (Eq. 4)
* :mod:`.protocol`   the noising timestep, the concepts' step sizes, the synthetic set
* :mod:`.privacy`    membership inference and nearest-neighbour distances of the synthetic set
* :mod:`.quality`    judges that never saw a client image, and what they read off a run's synthetic set
* :mod:`.grid`       real vs synthetic images per client and class
* :mod:`.sweep`      choosing the noising timestep without client test data
* :mod:`.ldm`        the tiny SD-architecture LDM (:mod:`.tokenizer`: its BPE tokenizer) and where a run finds an LDM
* :mod:`.publish`    the LDM shipped with hfpfl, published into the local Hub cache on first use
* :mod:`.pool`       the broad public pretraining pool (the LAION stand-in)
* :mod:`.pretraining`  the LDM's pretraining: the recipe side (``recipes/pretrain_ldm.py``), never imported by a run
* :class:`hfpfl.pipelines.pipeline_fedbip.FedBiPPipeline`  server-side synthesis (a diffusers pipeline)

The names below are loaded on first use: importing the package (the method's registration does) loads no model code.
"""
import importlib

_EXPORTS = {
    "client": ("UPLOAD_KEYS", "client_upload"),
    "latents": ("class_average_latents", "encode_images", "images_to_tensor", "instance_level_latents",
                "interpolate_latents", "noise_to_max_timestep", "sample_gamma", "sample_partners",
                "sampler_start_timestep"),
    "concepts": ("ConceptResult", "concept_denoising_loss", "concept_space_scale", "init_concepts", "train_concepts"),
    "config": ("FedBiPConfig",),
    "method": ("FedBiP", "load_ldm"),
    "ldm": ("TinyLDMConfig", "build_tiny_ldm", "digit_prompt", "make_scheduler", "resolve_ldm", "state_checksum"),
    "tokenizer": ("DIGIT_NAMES", "build_tiny_tokenizer"),
    "publish": ("DEFAULT_LDM_REPO", "ensure_pretrained_ldm"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name):
    if name in _MODULE_OF:
        return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
