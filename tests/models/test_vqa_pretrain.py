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
