"""FedBiP (Chen et al., CVPR 2025; dissertation ch. 5): one-shot FL with a personalized latent diffusion model.

One round (``one_shot = True``):

* **client** (``client_update``): from its real train split (resized to the LDM resolution) a client computes the
  instance-level latents z_i(T) (Eq. 3: same-class interpolation, noised to the maximum timestep, ``multiplier``
  independent draws per image = FedBiP-S/M/L) and trains its domain concept S and class concepts V (Eq. 4) with
  the LDM frozen. It uploads exactly ``{"latents", "labels", "domain_concept", "class_concepts"}`` (bytes counted
  by the engine); nothing travels down (the LDM is public). The classifier is not touched on clients.
* **server** (``receive``, then ``aggregate``): per client upload, in its own seeded generator (asynchronous per
  client, as the paper allows; the engine runs ``receive`` where the upload is, so several processes synthesise
  several clients at once), ``FedBiPPipeline`` runs the reverse diffusion from each z_i(T) with the prompt
  "A [S^] style of a [V_y]", S^ = S + eta (Eq. 5). The classifier (``sim.model``) is trained on the synthetic set
  only, with the engine's one training loop (``Algorithm.local_train(data=TensorData(...))``), and evaluated by the
  engine on every client's real test data and on the global test set.

The LDM (``FedBiPPipeline``) is loaded once per process and shared by every client and every simulation of the
process (frozen: its weights are never written; see ``tests/fedbip/test_fedbip_algorithm.py``).

Ablations (``personalization``), the paper's Table 3:
  ``full``      instance + concept level (FedBiP);            upload: latents, labels, domain_concept, class_concepts
  ``instance``  z_i(T) + prompt with the real words;           upload: latents, labels
  ``concept``   learned S, V; z(T) ~ N(0, I) drawn by server;  upload: labels, domain_concept, class_concepts
  ``domain``    "S^ only": learned S (perturbed), real class words, z(T) ~ N(0, I);  upload: labels, domain_concept
  ``class``     "V only": real domain word, learned V, z(T) ~ N(0, I);             upload: labels, class_concepts
  ``none``      prompt only, real words, z(T) ~ N(0, I);        upload: labels
"Real words": the client's domain name (e.g. ``usps``) and the class names (digit names for digit labels),
embedded by the LDM's own text encoder (``init_concepts(init="words")``: identical to tokenizing the real prompt).

Choices where the paper (dissertation ch. 5) is silent or its code differs (the paper wins where it says something):
* Concept vectors replace the *input* token embeddings (paper "textual guidance"; ``concept_space``
  switches to the authors'-code output-space variant) and are *randomly* initialised (paper §4.2.2; the authors' code
  initialises from words: ``concept_init=words``).
* Concept training: 50 epochs (paper §5.1; App. A says 30), Adam lr 0.1, batch 8 (the authors' code).
* S/M/L: ``multiplier`` independent z_i(T) per image (paper §5.1 only says 2x/5x/10x).
* Perturbation: a fresh eta per generated image (Eq. 5 read per sample), sigma 0.1 (paper App. A); not applied to the
  real-word ablations (``instance`` / ``none``: the paper's Table 3's prompt rows perturb nothing).
* A class with one image on a client: the paper's Eq. 3 needs a partner i' != i; we raise a clear error (the
  fallback i' = i would upload an un-interpolated latent: ``singleton_classes=self``, or
  ``drop``). ``class_average=True`` (the paper's §5.6 stricter-privacy prototype variant) needs no partner.
* The concepts a client trains depend only on its data and seed, not on ``multiplier`` (the two personalization
  levels draw from separate generators), so FedBiP-S and -L differ only in the amount synthesised. Within one
  process, identical concept trainings are memoised (``reuse_concepts``): a comparison of S/M/L and the
  concept-only ablation trains each client's concepts once.
* Classifier: SGD lr/momentum/batch from the run arguments for every variant (paper: SGD 0.01, momentum 0.9,
  50 epochs on D_syn); synthetic images are resized to the classifier's input size.
"""
from __future__ import annotations

import hashlib
import logging
import os

import torch
import torch.nn.functional as F

from ..federated.protocol import Algorithm, Update
from ..federated.registry import register
from ..federated.state import MODEL
from ..logs import quiet_library_progress_bars
from ..training import TensorData
from .config import DIGIT_WORDS, UPLOAD, FedBiPConfig
from .grid import save_real_vs_synthetic_grid
from .latents import instance_level_latents
from .pool import caption_word
from .privacy import membership_inference_gap, synthetic_nearest_neighbors
from .protocol import concept_settings, mixed_init, noising_timestep, synthetic_set

# The concept level (.concepts), the LDM (.ldm) and the pipeline import diffusers: they are imported where they are
# used, so that registering the method (``import hfpfl.algorithms``) loads no model code (tests/cli/test_footprint.py)

logger = logging.getLogger("hfpfl")

# ---------------------------------------------------------------------------------------------------------------
# the frozen LDM: one per process
# ---------------------------------------------------------------------------------------------------------------
_PIPES: dict[str, object] = {}
_CONCEPTS: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def load_ldm(ldm: str, device=None):
    """The process-wide frozen FedBiPPipeline for ``ldm`` (loaded once per device, shared by clients and
    simulations), on ``device`` (the accelerator's device; CPU when there is none)."""
    from .ldm import resolve_ldm

    path = resolve_ldm(ldm)
    device = torch.device(device or "cpu")
    key = f"{os.path.realpath(path)}@{device}"
    if key not in _PIPES:
        from ..pipelines.pipeline_fedbip import FedBiPPipeline

        quiet_library_progress_bars(diffusers=True)  # a redirected hfpfl log: no "Loading pipeline components" bars
        pipe = FedBiPPipeline.from_pretrained(path)
        for m in (pipe.unet, pipe.vae, pipe.text_encoder):
            m.eval().requires_grad_(False)
        pipe.set_progress_bar_config(disable=True)
        pipe.to(device)
        _PIPES[key] = pipe
        logger.info("FedBiP: loaded LDM %s (%s) on %s", ldm, path, device)
    return _PIPES[key]


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


@register
class FedBiP(Algorithm):
    """FedBiP: one-shot upload of noised latents + learned concepts; server synthesis with a frozen LDM."""

    name = "fedbip"
    aggregation = "gather"
    local_update = "own"
    personal_model = "own"
    Config = FedBiPConfig
    one_shot = True
    # clients fit concepts with the config's Adam (concept_lr); the server trains the classifier with the run's own
    # settings and classifier_epochs; there is no FedOpt step
    uses_server_hparams = frozenset()
    uses_client_hparams = frozenset()
    # a client's concept training + the server's synthesis of its images (``receive``, spread over the processes):
    # 30-40 s each on the main job's tiny LDM, against ~0.1-0.3 s for a small model's client update
    client_update_cost = 100.0

    def __init__(self, sim, config):
        super().__init__(sim, config)
        self.pipe = load_ldm(config.ldm, getattr(sim, "device", None))
        overrides = {"timestep_spacing": config.timestep_spacing} if config.timestep_spacing else {}
        self.pipe.set_sampler(config.sampler, **overrides)
        self.noise_t, self.sampler_t0 = noising_timestep(self.pipe, config)
        self.concept_lr, self.concept_sigma, self.space_scale = concept_settings(self.pipe, config)
        logger.info("FedBiP: clients noise latents to t=%d (noise_timestep=%s); the %s sampler starts at t=%d "
                    "(%d steps, %s spacing)", self.noise_t, config.noise_timestep, config.sampler, self.sampler_t0,
                    config.num_inference_steps, self.pipe.scheduler.config.get("timestep_spacing", "leading"))
        logger.info("FedBiP: concepts in %s space; concept_scale=%s -> Adam lr %.4g, perturbation sigma %.4g "
                    "(space scale %.4g)", config.concept_space, config.concept_scale, self.concept_lr,
                    self.concept_sigma, self.space_scale)
        self.synthetic: dict | None = None  # images / labels / clients of D_syn after aggregate

    # ------------------------------------------------------------------ helpers
    @property
    def ldm_size(self) -> int:
        s = self.pipe.vae.config.sample_size
        return s if isinstance(s, int) else s[0]

    def real_images(self, client_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The client's train split as LDM inputs: (N, 3, S, S) in [-1, 1] at the LDM's resolution, labels."""
        data = self.ctx.train_data(client_id)
        x = data.pixel_values
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        if x.shape[-1] != self.ldm_size:
            x = F.interpolate(x, size=(self.ldm_size, self.ldm_size), mode="bilinear", align_corners=False)
        return x.contiguous(), data.labels

    def words(self, client_id: int) -> tuple[str, list[str]]:
        """Real domain word and class words for the real-word prompts (ablations, concept_init=words)."""
        cfg, data = self.config, self.ctx.data
        if cfg.domain_words:
            doms = [w.strip() for w in cfg.domain_words.split(",")]
            domain = doms[client_id % len(doms)]
        else:
            domain = caption_word(self.ctx.client(client_id).domain) or "image"
        if cfg.class_words:
            classes = [w.strip() for w in cfg.class_words.split(",")]
        elif list(data.label_names) == [str(i) for i in range(10)]:
            classes = list(DIGIT_WORDS)
        else:
            classes = [str(n) for n in data.label_names]
        if len(classes) != data.num_labels:
            raise ValueError(f"class_words has {len(classes)} words but the data has {data.num_labels} classes")
        return domain, classes

    def word_concepts(self, client_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        from .concepts import init_concepts

        domain, classes = self.words(client_id)
        cfg = self.config
        return init_concepts(self.pipe, self.ctx.data.num_labels, cfg.n_s, cfg.n_v, cfg.prompt_template, init="words",
                             domain_word=domain, class_words=classes, concept_space=cfg.concept_space)

    # ------------------------------------------------------------------ client
    def download(self, server_state, client_id):
        return {}  # nothing travels down: the LDM is public, the classifier is trained after the upload

    def init_private_state(self, client_id):
        return {}

    def client_update(self, client_id, down, private, round_idx):
        from diffusers import DDPMScheduler

        cfg, pipe = self.config, self.pipe
        x, y = self.real_images(client_id)
        noise_scheduler = DDPMScheduler.from_config(pipe.scheduler.config)
        upload: dict[str, torch.Tensor] = {"labels": y.clone()}
        try:
            if cfg.personalization in ("full", "instance"):  # Eq. 3, no optimisation
                upload["latents"], upload["labels"] = self.instance_latents(client_id, x, y, round_idx,
                                                                            noise_scheduler)
            if cfg.personalization in ("full", "concept", "domain", "class"):  # Eq. 4, LDM frozen
                S, V = self.train_concepts(client_id, x, y, round_idx, noise_scheduler)
                if cfg.personalization != "class":
                    upload["domain_concept"] = S
                if cfg.personalization != "domain":
                    upload["class_concepts"] = V
        except ValueError as e:
            raise ValueError(f"FedBiP client {client_id}: {e}") from None
        assert set(upload) == set(cfg.upload_keys), (sorted(upload), cfg.upload_keys)
        return Update(client_id, upload={UPLOAD: upload}, num_samples=len(y), private=None,
                      metrics={"num_upload_latents": int(len(upload.get("latents", ())))})

    def instance_latents(self, client_id, x, y, round_idx, noise_scheduler):
        """Eq. 3 for every image, ``multiplier`` draws each; single-image classes per ``singleton_classes``."""
        cfg, pipe = self.config, self.pipe
        g = self.ctx.generator(round_idx, client_id, "fedbip-instance")
        counts = torch.bincount(y, minlength=self.ctx.data.num_labels)
        single = counts[y] == 1
        if cfg.class_average or cfg.singleton_classes == "error" or not bool(single.any()):
            return instance_level_latents(pipe.vae, noise_scheduler, x, y, cfg.multiplier, cfg.class_average, 0.5,
                                          cfg.gamma_std, g, timestep=self.noise_t)  # raises: single-image class
        logger.info("FedBiP client %d: classes %s have a single image (%s)", client_id,
                    sorted(set(y[single].tolist())), "i' = i, not interpolated" if cfg.singleton_classes == "self"
                    else "no latent uploaded for them")
        parts = []
        if bool((~single).any()):
            parts.append(instance_level_latents(pipe.vae, noise_scheduler, x[~single], y[~single], cfg.multiplier,
                                                False, 0.5, cfg.gamma_std, g, timestep=self.noise_t))
        if cfg.singleton_classes == "self":  # the class average of one image is the image itself: i' = i
            parts.append(instance_level_latents(pipe.vae, noise_scheduler, x[single], y[single], cfg.multiplier,
                                                True, 0.5, cfg.gamma_std, g, timestep=self.noise_t))
        if not parts:
            raise ValueError("every class has a single image and singleton_classes=drop: nothing to upload")
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def train_concepts(self, client_id, x, y, round_idx, noise_scheduler):
        from .concepts import train_concepts

        cfg = self.config
        seed = self.ctx.seed_for(round_idx, client_id, "fedbip-concepts")
        domain, classes = self.words(client_id) if cfg.concept_init == "words" else (None, None)
        train_s, train_v = cfg.personalization != "class", cfg.personalization != "domain"
        init_s = init_v = None
        if not (train_s and train_v):  # S only / V only: the other part is the real words' embedding, fixed
            init_s, init_v = mixed_init(self, client_id, train_s, train_v, seed)
        key = "|".join(map(str, (
            id(self.pipe), _digest(x, y), seed, self.ctx.data.num_labels, cfg.n_s, cfg.n_v, cfg.prompt_template,
            cfg.concept_epochs, cfg.concept_steps, cfg.concept_batch_size, self.concept_lr, cfg.concept_init,
            cfg.concept_space, domain, classes, train_s, train_v,
            None if init_s is None else _digest(init_s, init_v))))  # the fixed half's words (S only / V only)
        if cfg.reuse_concepts and key in _CONCEPTS:
            S, V = _CONCEPTS[key]
            return S.clone(), V.clone()
        res = train_concepts(self.pipe, x, y, self.ctx.data.num_labels, cfg.n_s, cfg.n_v, cfg.prompt_template,
                             cfg.concept_epochs, cfg.concept_steps, cfg.concept_batch_size, self.concept_lr,
                             init=cfg.concept_init, domain_word=domain, class_words=classes,
                             init_domain_concept=init_s, init_class_concepts=init_v,
                             concept_space=cfg.concept_space, noise_scheduler=noise_scheduler,
                             generator=torch.Generator().manual_seed(seed), train_domain=train_s,
                             train_class=train_v)
        if cfg.reuse_concepts:
            _CONCEPTS[key] = (res.domain_concept.clone(), res.class_concepts.clone())
        return res.domain_concept, res.class_concepts

    # ------------------------------------------------------------------ server
    def check_upload(self, upd: Update) -> None:
        """Validate one client's upload against the LDM (clear errors naming the client)."""
        cfg, pipe, cid = self.config, self.pipe, upd.client_id
        up = upd.upload.get(UPLOAD, {})
        if set(upd.upload) != {UPLOAD}:
            raise ValueError(f"client {cid} uploaded parts {sorted(upd.upload)}; FedBiP expects only {UPLOAD!r}")
        if set(up) != set(cfg.upload_keys):
            raise ValueError(f"client {cid} uploaded {sorted(up)}; FedBiP ({cfg.personalization}) expects exactly "
                             f"{sorted(cfg.upload_keys)}")
        labels = up["labels"]
        if labels.ndim != 1 or len(labels) == 0:
            raise ValueError(f"client {cid} uploaded labels of shape {tuple(labels.shape)}; expected (N,), N >= 1")
        if labels.min() < 0 or labels.max() >= self.ctx.data.num_labels:
            raise ValueError(f"client {cid} uploaded labels outside [0, {self.ctx.data.num_labels})")
        if "latents" in up:
            exp = pipe.latent_shape()
            z = up["latents"]
            if z.ndim != 4 or tuple(z.shape[1:]) != tuple(exp):
                raise ValueError(f"client {cid} uploaded latents of shape {tuple(z.shape)}, but the LDM {cfg.ldm!r} "
                                 f"expects (N, {exp[0]}, {exp[1]}, {exp[2]}): the client used a different LDM/VAE or "
                                 f"image size")
            if len(z) != len(labels):
                raise ValueError(f"client {cid} uploaded {len(z)} latents but {len(labels)} labels")
        d = pipe.text_encoder.config.hidden_size
        if "domain_concept" in up and tuple(up["domain_concept"].shape) != (cfg.n_s, d):
            raise ValueError(f"client {cid} uploaded domain_concept {tuple(up['domain_concept'].shape)}; expected "
                             f"({cfg.n_s}, {d})")
        if "class_concepts" in up:
            V = up["class_concepts"]
            if tuple(V.shape) != (self.ctx.data.num_labels, cfg.n_v, d):
                raise ValueError(f"client {cid} uploaded class_concepts {tuple(V.shape)}; expected "
                                 f"({self.ctx.data.num_labels}, {cfg.n_v}, {d})")

    def synthesize(self, upd: Update, round_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """D_syn of one client: (N*M, C, H, W) in [-1, 1] at the classifier's input size, and labels."""
        cfg, pipe, cid = self.config, self.pipe, upd.client_id
        up = upd.upload[UPLOAD]
        g = self.ctx.generator(round_idx, cid, "fedbip-synthesis")  # one generator per client upload
        if "latents" in up:
            latents, labels = up["latents"], up["labels"]
        else:  # concept-only / prompt-only: z(T) ~ N(0, I) drawn on the server, multiplier per uploaded label
            labels = up["labels"].repeat(cfg.multiplier)
            latents = torch.randn((len(labels), *pipe.latent_shape()), generator=g)
        S_w = V_w = None
        if "domain_concept" not in up or "class_concepts" not in up:
            S_w, V_w = self.word_concepts(cid)  # real words for whatever the client did not learn
        S = up.get("domain_concept", S_w)
        V = up.get("class_concepts", V_w)
        sigma = self.concept_sigma if "domain_concept" in up else 0.0  # only a learned S is perturbed (Eq. 5)
        out = pipe(latents, labels, S, V, prompt_template=cfg.prompt_template, concept_noise_sigma=sigma,
                   num_inference_steps=cfg.num_inference_steps, guidance_scale=cfg.guidance_scale,
                   batch_size=cfg.synthesis_batch_size, generator=g, output_type="pt",
                   concept_space=cfg.concept_space,
                   start_timestep=self.sampler_t0 if "latents" in up else None)
        images = out.images.float().cpu() * 2 - 1
        size, ch = self.ctx.data.image_size, self.ctx.data.num_channels
        if images.shape[-1] != size:
            images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
        if ch == 1:
            images = images.mean(1, keepdim=True)
        return images.clamp(-1, 1).contiguous(), out.labels.long()

    def receive(self, upd: Update, round_idx: int) -> None:
        """One client's D_syn, as soon as its upload arrives (the paper: the server may synthesise per client,
        asynchronously): the engine calls this where the upload is, so N processes synthesise N clients at once;
        each client's images come from its own seeded generator, the same on any process."""
        self.check_upload(upd)
        upd.received["synthetic"] = self.synthesize(upd, round_idx)

    def aggregate(self, server_state, updates, round_idx):
        if not updates:
            return server_state
        for u in updates:
            if "synthetic" not in u.received:  # aggregate called without the engine's receive (direct use)
                self.receive(u, round_idx)
        self.synthetic = synthetic_set(updates)  # aggregate runs once, on the main process
        syn = TensorData(self.synthetic["images"], self.synthetic["labels"])
        logger.info("FedBiP: %d synthetic images from %d clients; training the classifier on them only", len(syn),
                    len(updates))
        self.ctx.load({k: server_state[MODEL][k] for k in self.global_keys})
        self.classifier_metrics = self.local_train(-1, round_idx, params=self.trainable_parameters(),
                                                   epochs=self.config.classifier_epochs,
                                                   steps=self.config.classifier_steps, data=syn,
                                                   tag="fedbip-classifier")
        self.server_training = self.classifier_metrics   # the budget of the one model this method evaluates
        if self.config.save_grid and self.ctx.is_main_process:
            self.save_grid()
        return {**server_state, MODEL: self.ctx.snapshot(self.global_keys)}

    def save_grid(self, path=None):
        path = path or (self.ctx.output_dir / "synthetic_grid.png")
        clients = sorted(set(self.synthetic["clients"].tolist()))
        real = [(self.ctx.train_data(c).pixel_values, self.ctx.train_data(c).labels) for c in clients]
        syn = [(self.synthetic["images"][self.synthetic["clients"] == c],
                self.synthetic["labels"][self.synthetic["clients"] == c]) for c in clients]
        names = [f"client {c}: {self.ctx.client(c).domain or 'mixed'}" for c in clients]
        return save_real_vs_synthetic_grid(path, real, syn, names, self.ctx.data.num_labels,
                                           per_class=self.config.grid_per_class)

    # ------------------------------------------------------------------ evaluation: one global classifier
    def load_personal(self, client_id, server_state, private, round_idx):
        return self.load_global(server_state)

    def personalize_new_client(self, client_id, server_state, data, round_idx):
        return self.load_global(server_state)  # a one-shot global classifier: new clients use it as is

    def extra_metrics(self, round_idx, server_state) -> dict:
        out = {}
        if self.synthetic is not None:
            out["num_synthetic"] = int(len(self.synthetic["labels"]))
            out["classifier_train_loss"] = float(self.classifier_metrics["train_loss"])
        if not self.config.privacy_metrics:
            return out
        out.update(membership_inference_gap(self, server_state, round_idx))
        if self.synthetic is not None:
            out.update(synthetic_nearest_neighbors(self.ctx, self.synthetic))
        return out
