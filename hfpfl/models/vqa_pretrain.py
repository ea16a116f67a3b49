"""The pretraining objectives of the VQA foundation stand-ins, as their papers pretrain them -- on image-caption
pairs, never on VQA questions or answers (the clients' task):

* ViLT (Kim et al., ICML 2021, Sec. 3.2): image-text matching (ITM: a binary head on the pooled output; half the
  captions replaced by a caption of another image) + masked language modelling (MLM: caption tokens masked, predicted
  from the text and the image). ViLT's word-patch alignment term is left out.
* BLIP (Li et al., ICML 2022, Sec. 3.2), the nearest HF architecture to FedDAT's ALBEF: image-text contrastive (ITC,
  on the unimodal image and text encoders' [CLS] projections) + ITM (the image-grounded text encoder) + language
  modelling (LM: the image-grounded text decoder writes the caption). ALBEF has MLM where BLIP has LM; the decoder is
  the part of BLIP that answers (first-step answer scores), so it is pretrained with BLIP's own objective.

Choices the papers leave open at this scale (said in the model card): a negative caption is one of another image in
the batch whose (shape, colour) differs, so a "mismatched" pair never describes its image; ITC counts every caption
of the batch with the image's (shape, colour) as a positive (uniform soft targets) instead of BLIP's momentum
distillation; MLM masks each caption token (never [CLS] / [SEP] / [PAD]) with probability ``mlm_prob`` and at least
one per caption, always by [MASK] (no 80/10/10); the ITC temperature is fixed.

A batch is a dict of ``input_ids``, ``attention_mask`` (the caption), ``pixels`` (uint8 [B, 3, H, W]) and ``attr``
(an integer code of the image's (shape, colour)).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def pixel_values(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 pixels -> [-1, 1], as :class:`hfpfl.models.vqa_model.VQAModel` feeds the backbone."""
    return pixels.float() / 127.5 - 1.0


def mask_caption_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor, special_ids, mask_id: int,
                        prob: float, generator: torch.Generator | None = None):
    """MLM inputs and labels: each caption token (attended, not a special token) is masked with probability ``prob``,
    and at least one per caption that has a caption token; masked positions become ``mask_id`` and keep their id as
    the label, every other position is labelled -100 (ignored)."""
    eligible = attention_mask.bool() & ~torch.isin(input_ids, torch.as_tensor(list(special_ids)))
    u = torch.rand(input_ids.shape, generator=generator)
    chosen = (u < prob) & eligible
    # at least one masked token per caption: the eligible token with the smallest draw
    first = torch.where(eligible, u, torch.full_like(u, 2.0)).argmin(1)
    has = eligible.any(1)
    chosen[has, first[has]] = True
    labels = torch.where(chosen, input_ids, torch.full_like(input_ids, -100))
    masked = torch.where(chosen, torch.full_like(input_ids, mask_id), input_ids)
    return masked, labels


def itm_partners(attr: torch.Tensor, generator: torch.Generator | None = None, negative_prob: float = 0.5):
    """For each image i of the batch, the index of the caption it is paired with and the ITM label: with probability
    ``negative_prob`` a caption of a uniformly drawn image j whose attributes differ (label 0, mismatched), otherwise
    its own caption (label 1, matched; also when no image of the batch differs)."""
    n = len(attr)
    differs = attr[:, None] != attr[None, :]
    neg = (torch.rand(n, generator=generator) < negative_prob) & differs.any(1)
    weights = differs.float() + (~differs.any(1)).float()[:, None]      # a row with no candidate: any (unused)
    pick = torch.multinomial(weights, 1, generator=generator).squeeze(1)
    partner = torch.where(neg, pick, torch.arange(n))
    return partner, (~neg).long()


def itc_loss(image_feat: torch.Tensor, text_feat: torch.Tensor, attr: torch.Tensor, temperature: float):
    """Symmetric image-text contrastive loss on L2-normalised features, ``s = img @ txt.T / temperature``; the target
    of image i is uniform over the batch's captions with i's attributes (and the same for text -> image)."""
    img = F.normalize(image_feat, dim=-1)
    txt = F.normalize(text_feat, dim=-1)
    sim = img @ txt.t() / temperature
    same = (attr[:, None] == attr[None, :]).float()
    target = same / same.sum(1, keepdim=True)
    i2t = -(target * F.log_softmax(sim, 1)).sum(1).mean()
    t2i = -(target * F.log_softmax(sim.t(), 1)).sum(1).mean()
    return (i2t + t2i) / 2


class ViltPretrainer(nn.Module):
    """A ``ViltForMaskedLM`` (``self.mlm``, what is published) plus the ITM head on its pooled output."""

    def __init__(self, mlm_model, special_ids, mask_id: int, mlm_prob: float = 0.15, negative_prob: float = 0.5,
                 generator: torch.Generator | None = None):
        super().__init__()
        self.mlm = mlm_model
        self.itm_head = nn.Linear(mlm_model.config.hidden_size, 2)
        self.special_ids, self.mask_id = list(special_ids), mask_id
        self.mlm_prob, self.negative_prob, self.generator = mlm_prob, negative_prob, generator

    def losses(self, input_ids, attention_mask, pixels, attr, **_) -> dict:
        px = pixel_values(pixels)
        vilt = self.mlm.vilt
        masked, labels = mask_caption_tokens(input_ids, attention_mask, self.special_ids, self.mask_id,
                                             self.mlm_prob, self.generator)
        seq = vilt(input_ids=masked, attention_mask=attention_mask, pixel_values=px).last_hidden_state
        mlm_logits = self.mlm.mlm_score(seq[:, :input_ids.shape[1]])
        partner, itm_labels = itm_partners(attr, self.generator, self.negative_prob)
        pooled = vilt(input_ids=input_ids[partner], attention_mask=attention_mask[partner],
                      pixel_values=px).pooler_output
        itm_logits = self.itm_head(pooled)
        return {"mlm": F.cross_entropy(mlm_logits.flatten(0, 1), labels.flatten(), ignore_index=-100),
                "itm": F.cross_entropy(itm_logits, itm_labels),
                "mlm_acc": _masked_acc(mlm_logits, labels), "itm_acc": (itm_logits.argmax(-1) == itm_labels).float().mean()}

    def forward(self, **batch):
        out = self.losses(**batch)
        return out["mlm"] + out["itm"]


class BlipPretrainer(nn.Module):
    """A ``BlipForQuestionAnswering`` (``self.qa``, what is published: vision encoder, text encoder, text decoder)
    plus BLIP's pretraining heads: the ITC projections and the ITM head."""

    def __init__(self, qa_model, bos_id: int, projection_dim: int = 32, temperature: float = 0.07,
                 negative_prob: float = 0.5, generator: torch.Generator | None = None):
        super().__init__()
        self.qa = qa_model
        hv = qa_model.config.vision_config.hidden_size
        ht = qa_model.config.text_config.hidden_size
        self.vision_proj = nn.Linear(hv, projection_dim)
        self.text_proj = nn.Linear(ht, projection_dim)
        self.itm_head = nn.Linear(ht, 2)
        self.bos_id, self.temperature = bos_id, temperature
        self.negative_prob, self.generator = negative_prob, generator

    def losses(self, input_ids, attention_mask, pixels, attr, **_) -> dict:
        qa = self.qa
        image_embeds = qa.vision_model(pixel_values=pixel_values(pixels)).last_hidden_state
        image_att = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=image_embeds.device)
        # ITC: unimodal text encoding (no cross-attention without encoder states)
        text_cls = qa.text_encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, 0]
        itc = itc_loss(self.vision_proj(image_embeds[:, 0]), self.text_proj(text_cls), attr, self.temperature)
        # ITM: the image-grounded text encoder on matched / mismatched pairs
        partner, itm_labels = itm_partners(attr, self.generator, self.negative_prob)
        fused = qa.text_encoder(input_ids=input_ids[partner], attention_mask=attention_mask[partner],
                                encoder_hidden_states=image_embeds, encoder_attention_mask=image_att).last_hidden_state
        itm_logits = self.itm_head(fused[:, 0])
        # LM: the image-grounded decoder writes the caption after [DEC] (its own shift: position t predicts t + 1)
        dec_ids = input_ids.clone()
        dec_ids[:, 0] = self.bos_id
        labels = dec_ids.masked_fill(attention_mask == 0, -100)
        lm_logits = qa.text_decoder(input_ids=dec_ids, attention_mask=attention_mask, encoder_hidden_states=image_embeds,
                                    encoder_attention_mask=image_att).logits
        lm = F.cross_entropy(lm_logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return {"itc": itc, "itm": F.cross_entropy(itm_logits, itm_labels), "lm": lm,
                "itm_acc": (itm_logits.argmax(-1) == itm_labels).float().mean(),
                "lm_acc": _masked_acc(lm_logits[:, :-1], labels[:, 1:])}

    def forward(self, **batch):
        out = self.losses(**batch)
        return out["itc"] + out["itm"] + out["lm"]


def _masked_acc(logits, labels):
    keep = labels != -100
    return (logits.argmax(-1)[keep] == labels[keep]).float().mean() if keep.any() else logits.new_zeros(())
