"""The easy-vqa benchmark whose answers need the image: every question string's answers uniform in each client
split (--answer_balance question, the default), and the foundation stand-ins' caption pool disjoint from the
clients' images."""
import collections

import numpy as np
import pytest

from hfpfl.data import vqa as V


def test_balanced_by_question_keeps_one_row_per_answer_per_block_counted_by_hand():
    """q1 (answers no, yes) has yes x3, no x1 -> one block (1 yes, 1 no); q2 (circle, rectangle, triangle) has 2, 2, 1
    -> one block; q3 lacks 'no' -> nothing. Uncapped: 5 rows, q1 1/1, q2 1/1/1. Cap 4: the first block drawn is kept
    and the second (2 + 3 > 4) is not, so 2 or 3 rows, each string still uniform."""
    sel = [("q1", "yes", 0), ("q1", "yes", 1), ("q1", "yes", 2), ("q1", "no", 3),
           ("q2", "circle", 4), ("q2", "circle", 5), ("q2", "rectangle", 6), ("q2", "rectangle", 7),
           ("q2", "triangle", 8), ("q3", "yes", 9), ("q3", "yes", 10)]
    sets = {"q1": ("no", "yes"), "q2": ("circle", "rectangle", "triangle"), "q3": ("no", "yes")}
    out = V.balanced_by_question(sel, sets, cap=100, rng=np.random.default_rng(0))
    counts = collections.Counter((r[0], r[1]) for r in out)
    assert counts == {("q1", "yes"): 1, ("q1", "no"): 1, ("q2", "circle"): 1, ("q2", "rectangle"): 1,
                      ("q2", "triangle"): 1}
    assert next(r for r in out if r[0] == "q1" and r[1] == "no")[2] == 3     # the only 'no' of q1
    assert next(r for r in out if r[0] == "q2" and r[1] == "triangle")[2] == 8
    sizes = set()
    for seed in range(12):
        out = V.balanced_by_question(sel, sets, cap=4, rng=np.random.default_rng(seed))
        sizes.add(len(out))
        per = collections.Counter(r[0] for r in out)
        assert set(per.values()) <= {2, 3} and len(per) == 1
    assert sizes == {2, 3}


def test_balanced_by_question_uses_every_full_block():
    """q1 with yes x3 and no x3: three blocks, 6 rows, each row once."""
    sel = [("q1", a, i) for i, a in enumerate(["yes", "no"] * 3)]
    out = V.balanced_by_question(sel, {"q1": ("no", "yes")}, cap=6, rng=np.random.default_rng(3))
    assert sorted(r[2] for r in out) == list(range(6))


@pytest.mark.slow
def test_every_client_split_has_uniform_answers_per_question_string():
    """The domain split at 40 / 20 questions per client: decoding each split's questions, every question string
    has the same count for each answer easy-vqa gives that string (yes/no strings 50/50); with
    --answer_balance none a yes/no colour string is far from even somewhere."""
    from hfpfl.models.vqa import vqa_tokenizer

    tok = vqa_tokenizer()
    sets = V.question_answer_sets()
    answers = V.easy_vqa_answers()

    def per_question(fed):
        out = []
        for c in fed.clients:
            for split in (c.train, c.test):
                d = split.with_format("numpy")[:]
                qs = [tok.decode(ids, skip_special_tokens=True).replace(" ?", "?") for ids in d["input_ids"]]
                counts = collections.defaultdict(collections.Counter)
                for q, a in zip(qs, d["answer"]):
                    counts[q][answers[a]] += 1
                out.append(counts)
        return out

    fed = V.vqa_benchmark("domain", tokenizer=tok, seed=0, train_per_client=40, test_per_client=20)
    for counts in per_question(fed):
        assert counts
        for q, c in counts.items():
            assert set(c) == set(sets[q]) and len(set(c.values())) == 1, (q, c)
    raw = V.vqa_benchmark("domain", tokenizer=tok, seed=0, train_per_client=40, test_per_client=20,
                          answer_balance="none")
    assert any(len(set(c[a] for a in sets[q])) > 1 for counts in per_question(raw) for q, c in counts.items())
    with pytest.raises(ValueError, match="--answer_balance"):
        V.vqa_benchmark("domain", tokenizer=tok, answer_balance="both")


def test_caption_pool_images_are_pool_images_no_client_holds():
    """The stand-ins' pretraining images are pool images, none of them a client image; a caption names its image's
    shape and colour as easy-vqa's own questions state them (checked on the first pool image by its questions)."""
    pool, clients = V.pool_and_client_images()
    ids = V.caption_pool_ids()
    assert len(ids) > 800 and set(ids) <= set(pool.tolist()) and not set(ids) & set(clients.tolist())
    rows, _ = V._easy_vqa_raw()
    i = ids[0]
    mine = [r for r in rows if r[3] == i]
    shape = next(a for q, a, t, *_ in mine if t == "shape")
    colour = next(a for q, a, t, *_ in mine if t == "color")
    assert V.image_attributes()[i] == (shape, colour)
    for template in range(len(V.CAPTION_TEMPLATES)):
        words = V.caption(shape, colour, template).split()
        assert shape in words and colour in words


def test_caption_pool_draws_its_images_and_captions_from_those_pool_images():
    """caption_pool's first pass is the pool images in the plain style (pixel for pixel the images of
    caption_pool_ids), and caption k names the attributes of image k; the second pass repeats them jittered."""
    ids = V.caption_pool_ids()
    images, captions, attrs = V.caption_pool(32, seed=0, captions_per_image=2)
    assert len(images) == len(captions) == len(attrs) == 2 * len(ids)
    assert np.array_equal(images[:len(ids)], V.easy_vqa_images(32)[ids])
    truth = V.image_attributes()
    assert attrs == [truth[i] for i in ids] * 2
    for c, (s, col) in zip(captions, attrs):
        assert s in c.split() and col in c.split()
