"""The VQA controls of the FedDAT studies: the recipe's --image_ablation data option (blank: no image information;
shuffle: images permuted across questions), the control kinds built on it, the per-client chance level, and the
upload-bytes metric hook of the adapters study."""
import numpy as np
import pytest

from hfpfl.data.vqa import BLANK_VALUE, ablate_images, vqa_benchmark
from hfpfl.experiments import Study, Variant
from hfpfl.experiments import vqa_controls as vqa


def test_ablate_images_blank_is_one_grey_image_and_shuffle_is_the_generators_permutation():
    """Three 1x1 images of values 10, 20, 30: blank gives three images of 128; shuffle with a generator whose first
    permutation of 3 is p gives images [10, 20, 30][p] (the pairing moves, the images are the same); none is identity."""
    imgs = np.array([10, 20, 30], np.uint8).reshape(3, 1, 1, 1).repeat(3, -1)
    assert BLANK_VALUE == 128
    assert (ablate_images(imgs, "blank", np.random.default_rng(0)) == 128).all()
    p = np.random.default_rng(5).permutation(3)
    got = ablate_images(imgs, "shuffle", np.random.default_rng(5))
    assert got[:, 0, 0, 0].tolist() == [[10, 20, 30][i] for i in p]
    assert ablate_images(imgs, "none", None) is imgs
    with pytest.raises(ValueError, match="--image_ablation"):
        ablate_images(imgs, "noise", np.random.default_rng(0))


@pytest.fixture(scope="module")
def function_split():
    """The function split built three times (no ablation, blank, shuffle): about 25 s on a loaded 2-core box."""
    from hfpfl.models.vqa import vqa_tokenizer

    kw = dict(seed=0, train_per_client=20, test_per_client=20)
    tok = vqa_tokenizer()
    return {a: vqa_benchmark("function", tokenizer=tok, image_ablation=a, **kw) for a in ("none", "blank", "shuffle")}


def _cols(split, which):
    return [getattr(c, which).with_format("numpy")[:] for c in split.clients]


@pytest.mark.slow
@pytest.mark.parametrize("which", ["train", "test"])
def test_blank_images_keep_every_question_and_answer_and_carry_no_image(function_split, which):
    """Blank: the same questions, masks and answers in the same order as without ablation; every pixel is 128, so
    no two questions' images differ (a question-only model)."""
    for ref, blank in zip(_cols(function_split["none"], which), _cols(function_split["blank"], which)):
        assert (ref["input_ids"] == blank["input_ids"]).all() and (ref["answer"] == blank["answer"]).all()
        assert (ref["attention_mask"] == blank["attention_mask"]).all()
        assert (blank["pixels"] == 128).all() and not (ref["pixels"] == 128).all()


@pytest.mark.slow
@pytest.mark.parametrize("which", ["train", "test"])
def test_shuffled_images_are_the_same_images_paired_with_other_questions(function_split, which):
    """Shuffle: the same questions and answers in order; each client split's images are a permutation of its own
    images (the same multiset: sorted flattened images equal), and most questions get another question's image."""
    for ref, shuf in zip(_cols(function_split["none"], which), _cols(function_split["shuffle"], which)):
        assert (ref["input_ids"] == shuf["input_ids"]).all() and (ref["answer"] == shuf["answer"]).all()
        a = ref["pixels"].reshape(len(ref["pixels"]), -1)
        b = shuf["pixels"].reshape(len(shuf["pixels"]), -1)
        assert sorted(map(bytes, a)) == sorted(map(bytes, b))
        moved = np.mean([not np.array_equal(x, y) for x, y in zip(a, b)])
        assert moved > 0.5


def test_recipe_declares_the_ablation_with_a_check():
    """--image_ablation is one option of the VQA recipe; a value outside none|blank|shuffle is refused."""
    from hfpfl.arguments import parse_run_args
    from hfpfl.experiments.runner import _load_recipe
    rec = _load_recipe("recipes/feddat.py")
    *_, opts = parse_run_args(["--method", "vqa_adapter", "--image_ablation", "blank"], defaults=rec.DEFAULTS,
                              recipe_options=rec.VQABenchmark)
    assert opts.image_ablation == "blank"
    with pytest.raises((ValueError, SystemExit)):
        parse_run_args(["--method", "vqa_adapter", "--image_ablation", "noise"], defaults=rec.DEFAULTS,
                       recipe_options=rec.VQABenchmark)


def test_chance_is_one_over_the_answers_each_client_trains_on():
    """Client 0 trains on answers 0 and 2 (counts 3, 2): 1/2; client 1 on answer 2 only: 1/1; client 2 on all
    three: 1/3."""
    assert vqa.chance_scores(np.array([[3, 0, 2], [0, 0, 5], [1, 1, 1]])) == [0.5, 1.0, pytest.approx(1 / 3)]


def test_ablation_controls_train_with_their_ablation_and_refuse_a_variant_without_it():
    """question_only(adapter) adds --image_ablation blank, shuffled_image(adapter) shuffle; a variant of kind
    question_only built by hand without the flag, or with --image_ablation shuffle, is refused before anything
    trains."""
    adapter = Variant("adapter", ("--method", "vqa_adapter"), recipe=vqa.RECIPE)
    qo, sh = vqa.question_only(adapter), vqa.shuffled_image(adapter)
    assert qo.argv[-2:] == ("--image_ablation", "blank") and qo.kind == "question_only"
    assert sh.argv[-2:] == ("--image_ablation", "shuffle") and sh.kind == "shuffled_image"
    bad = Variant("question_only", ("--method", "vqa_adapter"), kind="question_only", recipe=vqa.RECIPE)
    st = Study(name="t", title="t", paper="p", variants=(bad,), seeds=(0,))
    with pytest.raises(ValueError, match="--image_ablation blank"):
        vqa._run_ablated(st, bad, 0, None)
    wrong = Variant("question_only", ("--method", "vqa_adapter", "--image_ablation", "shuffle"), kind="question_only",
                    recipe=vqa.RECIPE)   # the flag is there, with the other ablation's value
    with pytest.raises(ValueError, match="--image_ablation blank"):
        vqa._run_ablated(Study(name="t", title="t", paper="p", variants=(wrong,), seeds=(0,)), wrong, 0, None)


def test_upload_bytes_hook_is_bytes_per_client_and_round():
    """Round 1: clients 0 and 1 upload, round 2: client 0 (3 uploads); 300 bytes uploaded in all: 100 per upload."""
    from types import SimpleNamespace

    from hfpfl.experiments.studies.fedadapter_silo import upload_bytes
    sim = SimpleNamespace(ledger=SimpleNamespace(rounds={1: {0: (5, 100), 1: (5, 100)}, 2: {0: (5, 100)}}))
    results = {"final": {}, "communication": {"bytes_up": 300}}
    upload_bytes(sim, results)
    assert results["final"]["upload_bytes"] == 100
