"""FedDEO (Yang et al., "FedDEO: Description-Enhanced One-Shot Federated Learning with Diffusion Models", ACM MM
2024), a one-shot baseline of the FedBiP paper's Tables 1-2 (dissertation ch. 5, Sec. 5.1: "the optimized category
descriptions are uploaded and guide pretrained diffusion models"; "the total number of synthetic images is identical
to FedBiP-L").

One round (``one_shot = True``), on FedBiP's engine plug-in (:class:`hfpfl.fedbip.method.FedBiP`), its frozen LDM,
concept training, sampler and classifier training:

* **client**: optimises one description per class, V_c (``n_v`` token embeddings), with the LDM's denoising loss on
  its real images, every LDM weight frozen: L = ||eps - eps_theta(z(t), t, tau(P(V_y)))||^2, the prompt P the
  template with a fixed generic word in its domain slot (``context_word``, default "digit": "a photo of the digit
  [V]", the LDM's plain caption) and V_y in its class slot. The descriptions are the client's own, so they carry its
  domain as well as its classes: there is no separate domain concept (FedBiP's S), no instance latent and no
  perturbation. It uploads the descriptions and its labels (how many images of each class to generate), nothing
  else (part ``"fedbip"``: ``{"class_concepts", "labels"}``).
* **server**: ``multiplier`` images per uploaded label from z(T) ~ N(0, I), prompted with the client's description
  of the label's class (FedBiP's sampler and guidance), then the classifier on them (``classifier_steps``).

This is FedBiP's concept-level training with only class concepts learned (its "V only" ablation), with the domain
word replaced by a generic one. Training settings (Adam lr 0.1, epochs, batch 8, random initialisation at the
token-embedding scale) are FedBiP's (FedDEO's own are not given in the dissertation).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ...federated.registry import register
from ...options import Check, one_of
from ..config import FedBiPConfig
from ..method import FedBiP

_WORD = Check(lambda v: bool(str(v).strip()) and len(str(v).split()) == 1, "one non-empty word, e.g. 'digit'")


@dataclass
class FedDEOConfig(FedBiPConfig):
    personalization: str = field(default="class", metadata={
        "help": "FedDEO learns per-class descriptions only (z(T) ~ N(0, I), no domain concept): fixed to class.",
        "check": one_of("class")})
    prompt_template: str = field(default="a photo of the [S] [V]", metadata={
        "help": "Prompt: [S] holds context_word (fixed), [V] the client's learned class description.",
        "check": FedBiPConfig.__dataclass_fields__["prompt_template"].metadata["check"]})
    context_word: str = field(default="digit", metadata={
        "help": "The fixed generic word in the template's [S] slot (no domain word: the descriptions learn it).",
        "check": _WORD})


@register
class FedDEO(FedBiP):
    """FedDEO: clients upload per-class descriptions trained with the frozen LDM's denoising loss."""

    name = "feddeo"
    Config = FedDEOConfig

    def words(self, client_id):
        _, classes = FedBiP.words(self, client_id)
        return self.config.context_word, classes  # the [S] slot holds the generic word on every client
