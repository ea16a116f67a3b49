"""FGL (Zhang et al., "Federated Generative Learning with Foundation Models", 2023), a one-shot baseline of the
FedBiP paper's Tables 1-2 (dissertation ch. 5, Sec. 5.1: "captions of client local images, extracted by BLIP-2, are
uploaded and guide pretrained LDM").

One round (``one_shot = True``), on FedBiP's engine plug-in (:class:`hfpfl.fedbip.method.FedBiP`), its frozen LDM,
server sampler and classifier training:

* **client**: writes one caption per train image and uploads the captions, as token ids, with the labels (part
  ``"fedbip"``: ``{"captions", "labels"}``), nothing else: no image, latent, concept or weight. No captioning model
  is at hand (BLIP-2 in the paper), so a caption is built from the client's own words: FedBiP's prompt template
  with the client's domain word in its domain slot and the image's class word in its class slot, e.g. "a
  handwritten photo of the digit seven" (the domain word as FedBiP's real-word prompts choose it: the caption word
  the LDM's pool gave the domain's public images, or ``--domain_words``). Every image of a class on a client then
  has the same caption, which BLIP-2's image-specific captions would not.
* **server**: reads each caption's words (the token ids in the template's slots) and embeds them with the LDM's own
  text encoder; that is the caption's encoding (a real word in its slot is the tokenized caption), and it
  generates ``multiplier`` images per caption from z(T) ~ N(0, I) with FedBiP's sampler and guidance, then trains
  the classifier on them (``classifier_steps``), as FedBiP does.

Amount: the paper generates 3500 images per class per domain for FGL (App. A), 22x FedBiP-L's 160; here
``--multiplier`` sets it (the study uses FedBiP-L's 10x: 3500 per class would take hours on 2 cores). With these
captions, FGL's synthetic set is FedBiP's prompt-only ablation's ("none"): the same words, the same seeded draws; the
difference is who writes the words (the client, from its data, vs the server, from the domain name).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...federated.protocol import Update
from ...federated.registry import register
from ...options import one_of
from ..config import UPLOAD, FedBiPConfig
from ..method import FedBiP

CAPTION_KEYS = ("captions", "labels")


@dataclass
class FGLConfig(FedBiPConfig):
    personalization: str = field(default="none", metadata={
        "help": "FGL generates from the clients' captions alone, z(T) ~ N(0, I): fixed to none.",
        "check": one_of("none")})
    concept_space: str = field(default="input", metadata={
        "help": "The caption's words are embedded as tokens (input space): fixed to input.", "check": one_of("input")})

    @property
    def upload_keys(self) -> tuple[str, ...]:
        return CAPTION_KEYS


def word_ids(tokenizer, word: str, n: int) -> list[int]:
    """The ``n`` token ids a word fills a slot of ``n`` tokens with (cycled / truncated; BOS for an empty word)."""
    ids = tokenizer(word, add_special_tokens=False).input_ids or [tokenizer.bos_token_id]
    return [ids[i % len(ids)] for i in range(n)]


def write_captions(tokenizer, template: str, n_s: int, n_v: int, domain_word: str, class_words: list[str]):
    """Token ids (N, L) of one caption per image: the template with ``domain_word`` in its domain slot and the image's
    class word in its class slot."""
    from ...pipelines.pipeline_fedbip import tokenize_concept_template

    ids, s_pos, v_pos = tokenize_concept_template(tokenizer, template, n_s, n_v)
    rows = ids.repeat(len(class_words), 1)
    rows[:, s_pos] = torch.tensor(word_ids(tokenizer, domain_word, n_s))
    for i, w in enumerate(class_words):
        rows[i, v_pos] = torch.tensor(word_ids(tokenizer, w, n_v))
    return rows


def read_captions(table: torch.Tensor, captions: torch.Tensor, labels: torch.Tensor, s_pos, v_pos, num_classes: int):
    """The server's reading of one client's captions: (S (n_s, d), V (C, n_v, d)), the token embeddings of the words
    in the domain slot and in each class's slot. One domain word per client and one class word per class."""
    dom = captions[:, s_pos]
    if not bool((dom == dom[0]).all()):
        raise ValueError("the captions carry several domain words; FGL here expects one per client")
    V = torch.zeros(num_classes, len(v_pos), table.shape[1])
    for c in labels.unique().tolist():
        cls = captions[labels == c][:, v_pos]
        if not bool((cls == cls[0]).all()):
            raise ValueError(f"the captions of class {c} carry different class words")
        V[c] = table[cls[0]].float().cpu()
    return table[dom[0]].float().cpu(), V


@register
class FGL(FedBiP):
    """FGL: clients upload captions once; the server generates with the frozen LDM and trains the classifier."""

    name = "fgl"
    Config = FGLConfig

    def __init__(self, sim, config):
        super().__init__(sim, config)
        self._read: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def client_update(self, client_id, down, private, round_idx):
        cfg = self.config
        y = self.ctx.train_data(client_id).labels
        domain, classes = self.words(client_id)
        captions = write_captions(self.pipe.tokenizer, cfg.prompt_template, cfg.n_s, cfg.n_v, domain,
                                  [classes[int(c)] for c in y])
        return Update(client_id, upload={UPLOAD: {"captions": captions, "labels": y.clone()}}, num_samples=len(y),
                      private=None)

    def word_concepts(self, client_id):
        return self._read[client_id]  # the words the client's captions carry (read in ``synthesize``)

    def synthesize(self, upd: Update, round_idx: int):
        from ...pipelines.pipeline_fedbip import tokenize_concept_template

        cfg, up = self.config, upd.upload[UPLOAD]
        _, s_pos, v_pos = tokenize_concept_template(self.pipe.tokenizer, cfg.prompt_template, cfg.n_s, cfg.n_v)
        if up["captions"].ndim != 2 or len(up["captions"]) != len(up["labels"]):
            raise ValueError(f"client {upd.client_id} uploaded captions of shape {tuple(up['captions'].shape)} for "
                             f"{len(up['labels'])} labels; expected one caption (a row of token ids) per label")
        table = self.pipe.text_encoder.get_input_embeddings().weight.detach()
        self._read[upd.client_id] = read_captions(table, up["captions"], up["labels"], s_pos, v_pos,
                                                  self.ctx.data.num_labels)
        return super().synthesize(upd, round_idx)  # prompt only from the captions' words, multiplier per caption
