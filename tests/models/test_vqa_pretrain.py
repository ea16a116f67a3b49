"""The VQA stand-ins' pretraining objectives (hfpfl.models.vqa_pretrain), on hand-built batches: MLM masks caption
tokens only, ITM pairs are labelled matched / mismatched correctly, the contrastive loss equals the hand value."""
import math

import pytest
import torch

from hfpfl.models.vqa_pretrain import itc_loss, itm_partners, mask_caption_tokens

SPECIAL = [0, 1, 2, 3, 4]          # [PAD] [UNK] [CLS] [SEP] [MASK]
MASK = 4


def test_mlm_with_probability_one_masks_exactly_the_caption_tokens():
    """prob 1: every attended non-special token becomes [MASK] and keeps its id as the label; [CLS], [SEP], [PAD]
    and an unattended position (even holding a word id) stay as they are and are labelled -100."""
    ids = torch.tensor([[2, 10, 11, 3, 0, 0], [2, 12, 3, 13, 0, 0]])
    att = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]])
    masked, labels = mask_caption_tokens(ids, att, SPECIAL, MASK, prob=1.0, generator=torch.Generator().manual_seed(0))
    assert masked.tolist() == [[2, 4, 4, 3, 0, 0], [2, 4, 3, 13, 0, 0]]
    assert labels.tolist() == [[-100, 10, 11, -100, -100, -100], [-100, 12, -100, -100, -100, -100]]


def test_mlm_masks_at_least_one_caption_token_and_none_of_a_caption_without_words():
    """prob 0: exactly one caption token per caption is masked (never a special one); a caption with no word is left
    whole."""
    ids = torch.tensor([[2, 10, 11, 12, 3], [2, 3, 0, 0, 0]])
    att = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    for seed in range(5):
        masked, labels = mask_caption_tokens(ids, att, SPECIAL, MASK, prob=0.0,
                                             generator=torch.Generator().manual_seed(seed))
        row = labels[0].tolist()
        assert sum(v != -100 for v in row) == 1
        pos = next(i for i, v in enumerate(row) if v != -100)
        assert pos in (1, 2, 3) and masked[0, pos] == MASK and row[pos] == ids[0, pos]
        assert masked[1].tolist() == ids[1].tolist() and labels[1].tolist() == [-100] * 5


def test_itm_pairs_are_labelled_by_whether_the_caption_describes_the_image():
    """negative_prob 1: every image with some other attribute in the batch gets a caption of an image whose
    attributes differ (label 0); an image with no such partner keeps its own (label 1). negative_prob 0: its own
    caption, label 1."""
    attr = torch.tensor([0, 0, 1, 2])
    partner, labels = itm_partners(attr, torch.Generator().manual_seed(0), negative_prob=1.0)
    assert labels.tolist() == [0, 0, 0, 0]
    assert partner[0].item() in (2, 3) and partner[1].item() in (2, 3) and partner[2].item() in (0, 1, 3)
    assert all(attr[p] != attr[i] for i, p in enumerate(partner.tolist()))
    partner, labels = itm_partners(attr, torch.Generator().manual_seed(0), negative_prob=0.0)
    assert partner.tolist() == [0, 1, 2, 3] and labels.tolist() == [1, 1, 1, 1]
    partner, labels = itm_partners(torch.tensor([5, 5]), torch.Generator().manual_seed(0), negative_prob=1.0)
    assert partner.tolist() == [0, 1] and labels.tolist() == [1, 1]


def test_itm_negatives_come_at_the_given_rate():
    """negative_prob 0.5 over 4,000 images (two attributes): ~half mismatched; each label agrees with the pair."""
    attr = torch.arange(4000) % 2
    partner, labels = itm_partners(attr, torch.Generator().manual_seed(1), negative_prob=0.5)
    assert abs(labels.float().mean().item() - 0.5) < 0.03
    assert torch.equal(labels.bool(), attr[partner] == attr)
    torch.manual_seed(123)
    again = itm_partners(attr, torch.Generator().manual_seed(1), negative_prob=0.5)
    assert torch.equal(again[0], partner) and torch.equal(again[1], labels)    # every draw from the generator


def test_itc_loss_equals_the_hand_value():
    """Two images, two captions, unit features e1, e2 (scaled by 3: the loss normalises), temperature 1:
    s = I. Distinct attributes: each direction is -log(e / (e + 1)) = log(1 + 1/e). Same attribute: the target is
    (1/2, 1/2), so -1/2 (log e/(e+1) + log 1/(e+1)) = log(e + 1) - 1/2. Temperature 1/2: log(1 + e^-2)."""
    img = 3 * torch.eye(2)
    txt = torch.eye(2)
    assert itc_loss(img, txt, torch.tensor([0, 1]), 1.0).item() == pytest.approx(math.log(1 + math.exp(-1)), abs=1e-6)
    assert itc_loss(img, txt, torch.tensor([7, 7]), 1.0).item() == pytest.approx(math.log(math.e + 1) - 0.5, abs=1e-6)
    assert itc_loss(img, txt, torch.tensor([0, 1]), 0.5).item() == pytest.approx(math.log(1 + math.exp(-2)), abs=1e-6)


def test_itc_loss_is_symmetric_in_its_two_directions():
    """Image 0 matches caption 1 best; the image->text and text->image terms differ on this non-symmetric s, and the
    loss is their mean, computed here by hand from s = [[0, 1], [1/sqrt2, 1/sqrt2]] (temperature 1)."""
    img = torch.tensor([[0.0, 1.0], [1.0, 1.0]])
    txt = torch.eye(2)
    r = 1 / math.sqrt(2)
    s = [[0.0, 1.0], [r, r]]

    def ce(row, j):
        return -(row[j] - math.log(sum(math.exp(v) for v in row)))
    i2t = (ce(s[0], 0) + ce(s[1], 1)) / 2
    t2i = (ce([s[0][0], s[1][0]], 0) + ce([s[0][1], s[1][1]], 1)) / 2
    assert itc_loss(img, txt, torch.tensor([0, 1]), 1.0).item() == pytest.approx((i2t + t2i) / 2, abs=1e-6)


# --- the two pretrainers' losses, against the HF models' own outputs and the objectives written out by hand -------
from torch.nn import functional as F  # noqa: E402

from hfpfl.models.vqa_pretrain import BlipPretrainer, ViltPretrainer, _masked_acc  # noqa: E402


def _batch(vocab: int):
    """Four 6-token captions ([CLS] w w (w) [SEP] [PAD]..), four distinct images, four distinct attributes."""
    g = torch.Generator().manual_seed(11)
    cls_id, sep_id = 2, 3
    ids = torch.zeros(4, 6, dtype=torch.long)
    att = torch.zeros(4, 6, dtype=torch.long)
    for i, n in enumerate((2, 3, 2, 4)):
        words = torch.randint(10, vocab, (n,), generator=g)
        ids[i, :n + 2] = torch.cat([torch.tensor([cls_id]), words, torch.tensor([sep_id])])
        att[i, :n + 2] = 1
    pixels = torch.randint(0, 256, (4, 3, 32, 32), generator=g, dtype=torch.uint8)
    return {"input_ids": ids, "attention_mask": att, "pixels": pixels, "attr": torch.tensor([0, 1, 2, 3])}


@pytest.fixture(scope="module")
def vilt_mlm():
    from transformers import ViltForMaskedLM

    from hfpfl.models.builders import build_vqa_model

    torch.manual_seed(0)
    return ViltForMaskedLM(build_vqa_model("tiny-vilt", 13, image_size=32, vocab_size=40).config).eval()


@pytest.fixture(scope="module")
def blip_qa():
    from hfpfl.models.builders import build_vqa_model

    torch.manual_seed(0)
    model = build_vqa_model("tiny-blip", 13, image_size=32, vocab_size=40).eval()
    # a randomly initialised BLIP barely reads the image (cross-attention weights ~0.02 move the logits by ~1e-3):
    # larger cross-attention weights make every loss depend on the image visibly
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "crossattention" in name and p.dim() == 2:
                p.normal_(0.0, 0.3)
    return model


def test_pretrainers_default_to_the_papers_rates(vilt_mlm, blip_qa):
    """ViLT (Sec. 3.2): 15% of caption tokens masked, the matched pair replaced with probability 0.5 (also
    itm_partners' default); BLIP/ALBEF: the contrastive temperature starts at 0.07; ITM heads are binary."""
    vilt = ViltPretrainer(vilt_mlm, [0, 1, 2, 3, 4], 4)
    blip = BlipPretrainer(blip_qa, 5)
    assert vilt.mlm_prob == 0.15 and vilt.negative_prob == 0.5 and blip.temperature == 0.07
    assert blip.negative_prob == 0.5
    assert vilt.itm_head.out_features == 2 and blip.itm_head.out_features == 2       # matched / mismatched
    attr = torch.arange(4000) % 2
    _, labels = itm_partners(attr, torch.Generator().manual_seed(1))
    assert abs(labels.float().mean().item() - 0.5) < 0.03


def test_vilt_pretrainer_losses_are_hf_mlm_and_itm_on_mismatched_partners(vilt_mlm):
    """MLM = ViltForMaskedLM's own loss on the masked captions (HF computes it); ITM = CE of the ITM head on the
    pooled output of each image with its partner's caption (label 0 where the partner is another image's caption, 1
    where it is its own; both occur at this seed); pixels enter as p / 127.5 - 1. The draws are replayed from the same seed (masking first,
    then partners); accuracies by hand; forward = MLM + ITM."""
    b = _batch(40)
    pre = ViltPretrainer(vilt_mlm, [0, 1, 2, 3, 4], 4, mlm_prob=0.4, negative_prob=0.7,
                         generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = pre.losses(**b)
        g = torch.Generator().manual_seed(5)
        masked, labels = mask_caption_tokens(b["input_ids"], b["attention_mask"], [0, 1, 2, 3, 4], 4, 0.4, g)
        partner, itm_labels = itm_partners(b["attr"], g, 0.7)
        assert set(itm_labels.tolist()) == {0, 1}
        assert all((p != i) == (lab == 0) for i, (p, lab) in enumerate(zip(partner.tolist(), itm_labels.tolist())))
        px = b["pixels"].float() / 127.5 - 1.0
        hf = vilt_mlm(input_ids=masked, attention_mask=b["attention_mask"], pixel_values=px, labels=labels)
        pooled = vilt_mlm.vilt(input_ids=b["input_ids"][partner], attention_mask=b["attention_mask"][partner],
                               pixel_values=px).pooler_output
        itm_logits = pre.itm_head(pooled)
        itm = -F.log_softmax(itm_logits, -1)[torch.arange(4), itm_labels].mean()
        keep = labels != -100
        mlm_acc = (hf.logits.argmax(-1)[keep] == labels[keep]).float().mean()
        assert float(out["mlm"]) == pytest.approx(float(hf.loss), rel=1e-5)
        assert float(out["itm"]) == pytest.approx(float(itm), rel=1e-5)
        assert float(out["mlm_acc"]) == pytest.approx(float(mlm_acc))
        assert float(out["itm_acc"]) == pytest.approx(float((itm_logits.argmax(-1) == itm_labels).float().mean()))
        pre.generator = torch.Generator().manual_seed(5)
        assert float(pre(**b)) == pytest.approx(float(hf.loss + itm), rel=1e-5)


def test_blip_pretrainer_losses_are_itc_itm_and_the_decoders_next_token_lm(blip_qa):
    """ITC: the unimodal [CLS] features (text encoder without the image), projected and L2-normalised, s = v t^T / T,
    targets uniform over same-attribute captions (here the diagonal), the mean of both directions' CE, written out;
    ITM: CE of the ITM head on the image-grounded encoder's [CLS] for (image, partner caption), labels 0 / 1 as
    drawn (both occur at this seed); LM: the decoder reads [DEC] + caption and each position t predicts token t + 1 of the
    caption (attended positions only), plain CE summed by hand over those positions; accuracies by hand; forward =
    ITC + ITM + LM."""
    b = _batch(40)
    bos = blip_qa.config.text_config.bos_token_id
    pre = BlipPretrainer(blip_qa, bos, projection_dim=8, temperature=0.5, negative_prob=0.7,
                         generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        pre.itm_head.weight.zero_()                  # the ITM head says "matched" where fused feature 2 is > 0
        pre.itm_head.weight[1, 2] = 100.0
        pre.itm_head.bias.zero_()
        out = pre.losses(**b)
        ids, att = b["input_ids"], b["attention_mask"]
        px = b["pixels"].float() / 127.5 - 1.0
        img = blip_qa.vision_model(pixel_values=px).last_hidden_state
        ones = torch.ones(img.shape[:2], dtype=torch.long)
        v = F.normalize(pre.vision_proj(img[:, 0]), dim=-1)
        t = F.normalize(pre.text_proj(blip_qa.text_encoder(input_ids=ids, attention_mask=att).last_hidden_state[:, 0]),
                        dim=-1)
        s = v @ t.T / 0.5
        i2t = sum(-(s[i, i] - torch.logsumexp(s[i], 0)) for i in range(4)) / 4
        t2i = sum(-(s[i, i] - torch.logsumexp(s[:, i], 0)) for i in range(4)) / 4
        partner, itm_labels = itm_partners(b["attr"], torch.Generator().manual_seed(9), 0.7)
        assert set(itm_labels.tolist()) == {0, 1}
        fused = blip_qa.text_encoder(input_ids=ids[partner], attention_mask=att[partner], encoder_hidden_states=img,
                                     encoder_attention_mask=ones).last_hidden_state[:, 0]
        itm_logits = pre.itm_head(fused)
        dec = ids.clone()
        dec[:, 0] = bos
        logits = blip_qa.text_decoder(input_ids=dec, attention_mask=att, encoder_hidden_states=img,
                                      encoder_attention_mask=ones).logits
        terms, hits = [], []
        for i in range(4):
            for pos in range(5):
                if att[i, pos + 1]:
                    terms.append(-F.log_softmax(logits[i, pos], -1)[dec[i, pos + 1]])
                    hits.append(float(logits[i, pos].argmax() == dec[i, pos + 1]))
        lm = sum(terms) / len(terms)
        assert float(out["itc"]) == pytest.approx(float((i2t + t2i) / 2), rel=1e-5)
        itm = -F.log_softmax(itm_logits, -1)[torch.arange(4), itm_labels].mean()
        assert float(out["itm"]) == pytest.approx(float(itm), rel=1e-5)
        assert float(out["lm"]) == pytest.approx(float(lm), rel=1e-5)
        assert itm_labels.tolist() == [0, 0, 0, 1] and (fused[:, 2] > 0).long().tolist() == [0, 0, 1, 1]
        assert float(out["itm_acc"]) == pytest.approx(0.75)
        assert float(out["lm_acc"]) == pytest.approx(sum(hits) / len(hits))
        pre.generator = torch.Generator().manual_seed(9)
        assert float(pre(**b)) == pytest.approx(float((i2t + t2i) / 2 + out["itm"] + lm), rel=1e-5)


def test_masked_accuracy_counts_labelled_positions_only_and_is_zero_without_any():
    """argmax hits over positions whose label is not -100: 2 of 3 here; no labelled position gives 0."""
    logits = torch.tensor([[[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]]])
    assert float(_masked_acc(logits, torch.tensor([[1, 1, -100]]))) == pytest.approx(0.5)
    assert float(_masked_acc(logits, torch.tensor([[1, 0, 0]]))) == pytest.approx(2 / 3)
    assert float(_masked_acc(logits, torch.full((1, 3), -100))) == 0.0
