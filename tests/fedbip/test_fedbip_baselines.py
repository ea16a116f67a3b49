"""FGL and FedDEO, the one-shot baselines of FedBiP's Tables 1-2 that use FedBiP's frozen LDM and server pipeline, on a
tiny *randomly initialised* LDM: what each client uploads (and nothing else), the captions as the tokenized text
and the server's reading of them by hand, and each method as the FedBiP configuration it must equal (FGL's synthetic
set is the prompt-only ablation's; FedDEO's descriptions and images are the V-only ablation's with the generic word
in the domain slot)."""
import dataclasses
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from hfpfl.config import RunArguments  # noqa: E402
from hfpfl.fedbip import build_tiny_ldm  # noqa: E402
from hfpfl.fedbip.baselines.feddeo import FedDEO, FedDEOConfig  # noqa: E402
from hfpfl.fedbip.baselines.fgl import FGLConfig, read_captions, write_captions  # noqa: E402
from hfpfl.fedbip.config import FedBiPConfig  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ldm_dir(tmp_path_factory):
    from hfpfl.pipelines.pipeline_fedbip import FedBiPPipeline

    path = tmp_path_factory.mktemp("tiny_ldm")
    FedBiPPipeline(**build_tiny_ldm(image_size=16, seed=0)).save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def fed():
    """3 feature-shift clients (usps, mnistm, syn), 2 shots per class, 12x12 classifier input."""
    from hfpfl.data import DataArguments, build_federated_dataset

    args = DataArguments(dataset="digits-nomnist", num_clients=3, max_per_domain=80, image_size=12, test_fraction=0.3)
    fd = build_federated_dataset(args, seed=0)
    clients = []
    for c in fd.clients:
        y = np.asarray(c.train.with_format(None)["labels"])
        keep = np.sort(np.concatenate([np.flatnonzero(y == k)[:2] for k in np.unique(y)]))
        clients.append(dataclasses.replace(c, train=c.train.select(keep)))
    return args, dataclasses.replace(fd, clients=clients)


SHARED = dict(multiplier=2, concept_steps=2, num_inference_steps=2, classifier_steps=3, synthesis_batch_size=64,
              save_grid=False, privacy_metrics=False, reuse_concepts=False)


def _run(fed, tmp_path, method, cfg):
    from hfpfl.federated.engine import Simulation

    data_args, fd = fed
    run = RunArguments(method=method, num_rounds=1, batch_size=16, lr=0.05, output_dir=str(tmp_path / method),
                       progress=False, checkpoint_every=0, overwrite_output_dir=True)
    sim = Simulation(run, data_args, cfg, fed_data=fd, keep_uploads=True)
    return sim, sim.run()


# ------------------------------------------------------------------------------------------------ FGL
def test_captions_are_the_tokenized_text_of_the_clients_words(ldm_dir):
    """A caption row is the tokenizer's ids of the written-out caption "a handwritten photo of the digit seven"
    (padded to the tokenizer's length): what travels is that text."""
    from hfpfl.fedbip.method import load_ldm

    tok = load_ldm(ldm_dir).tokenizer
    rows = write_captions(tok, "a [S] photo of the digit [V]", 1, 1, "handwritten", ["seven", "one"])
    for row, word in zip(rows, ("seven", "one")):
        text = tok(f"a handwritten photo of the digit {word}", padding="max_length",
                   max_length=tok.model_max_length, truncation=True, return_tensors="pt").input_ids[0]
        assert torch.equal(row, text)


def test_read_captions_by_hand():
    """The server embeds the words in the slots: S = table[domain id], V[c] = table[class id of c's captions], zero
    rows for classes the client does not hold; several domain words, or two class words for one class, refused."""
    table = torch.arange(12.0).view(6, 2)          # token i -> (2i, 2i + 1)
    caps = torch.tensor([[0, 3, 4], [0, 3, 5], [0, 3, 4]])   # slot 1: domain, slot 2: class
    labels = torch.tensor([2, 0, 2])
    S, V = read_captions(table, caps, labels, torch.tensor([1]), torch.tensor([2]), num_classes=3)
    assert torch.equal(S, torch.tensor([[6.0, 7.0]]))
    assert torch.equal(V, torch.tensor([[[10.0, 11.0]], [[0.0, 0.0]], [[8.0, 9.0]]]))
    one_S, one_V = read_captions(table, caps[:1], labels[:1], torch.tensor([1]), torch.tensor([2]), num_classes=3)
    assert torch.equal(one_S, S) and torch.equal(one_V[2], V[2])   # a client with a single caption
    with pytest.raises(ValueError, match="domain words"):
        read_captions(table, torch.tensor([[0, 3, 4], [0, 1, 4]]), torch.tensor([0, 0]), torch.tensor([1]),
                      torch.tensor([2]), 3)
    with pytest.raises(ValueError, match="class 0"):
        read_captions(table, torch.tensor([[0, 3, 4], [0, 3, 5]]), torch.tensor([0, 0]), torch.tensor([1]),
                      torch.tensor([2]), 3)


def test_fgl_uploads_only_captions_and_labels_and_synthesises_the_prompt_only_set(ldm_dir, fed, tmp_path):
    """Each client uploads exactly {captions, labels}, one caption per train image; the server's synthetic set is
    bit for bit the prompt-only FedBiP ablation's (the same words, read back from the captions; the same seeded
    draws): the captions carry the words the server needs, and the server uses nothing else."""
    sim, res = _run(fed, tmp_path, "fgl", FGLConfig(ldm=ldm_dir, **SHARED))
    for u in sim.last_updates:
        up = u.upload["fedbip"]
        assert set(u.upload) == {"fedbip"} and set(up) == {"captions", "labels"}
        assert len(up["captions"]) == len(up["labels"]) == len(sim.train_data(u.client_id))
        assert up["captions"].dtype == torch.long
    ref, _ = _run(fed, tmp_path, "fedbip", FedBiPConfig(ldm=ldm_dir, personalization="none", **SHARED))
    assert torch.equal(sim.algorithm.synthetic["labels"], ref.algorithm.synthetic["labels"])
    assert torch.equal(sim.algorithm.synthetic["images"], ref.algorithm.synthetic["images"])
    assert res["final"]["num_synthetic"] == 2 * sum(len(sim.train_data(i)) for i in range(3))


def test_fgl_and_feddeo_refuse_other_personalizations(ldm_dir):
    with pytest.raises(ValueError, match="personalization"):
        FGLConfig(ldm=ldm_dir, personalization="full")
    with pytest.raises(ValueError, match="concept_space"):
        FGLConfig(ldm=ldm_dir, concept_space="output")
    with pytest.raises(ValueError, match="personalization"):
        FedDEOConfig(ldm=ldm_dir, personalization="domain")
    with pytest.raises(ValueError, match="context_word"):
        FedDEOConfig(ldm=ldm_dir, context_word="two words")


# ------------------------------------------------------------------------------------------------ FedDEO
def test_feddeo_words_put_the_generic_word_in_the_domain_slot_of_every_client():
    me = SimpleNamespace(config=SimpleNamespace(context_word="digit", domain_words="usps,syn", class_words=None),
                         ctx=SimpleNamespace(data=SimpleNamespace(label_names=[str(i) for i in range(10)],
                                                                  num_labels=10)))
    for cid in (0, 1):
        domain, classes = FedDEO.words(me, cid)
        assert domain == "digit" and classes[7] == "seven" and len(classes) == 10


def test_feddeo_uploads_descriptions_and_labels_equal_to_v_only_with_the_generic_word(ldm_dir, fed, tmp_path):
    """Each client uploads exactly {class_concepts, labels}; its descriptions and the server's images are the V-only
    FedBiP ablation's with the generic word as the domain word and FedDEO's template: the descriptions learn the
    client's domain, no domain concept travels, nothing is perturbed."""
    sim, res = _run(fed, tmp_path, "feddeo", FedDEOConfig(ldm=ldm_dir, **SHARED))
    for u in sim.last_updates:
        assert set(u.upload) == {"fedbip"} and set(u.upload["fedbip"]) == {"class_concepts", "labels"}
    ref, _ = _run(fed, tmp_path, "fedbip", FedBiPConfig(ldm=ldm_dir, personalization="class", domain_words="digit",
                                                        prompt_template="a photo of the [S] [V]", **SHARED))
    for a, b in zip(sorted(sim.last_updates, key=lambda u: u.client_id),
                    sorted(ref.last_updates, key=lambda u: u.client_id)):
        assert torch.equal(a.upload["fedbip"]["class_concepts"], b.upload["fedbip"]["class_concepts"])
    assert torch.equal(sim.algorithm.synthetic["images"], ref.algorithm.synthetic["images"])
    # a real-word domain (the V-only ablation's default) gives other descriptions: the context word reaches them
    other, _ = _run(fed, tmp_path, "fedbip", FedBiPConfig(ldm=ldm_dir, personalization="class",
                                                          prompt_template="a photo of the [S] [V]", **SHARED))
    assert not torch.equal(sim.algorithm.synthetic["images"], other.algorithm.synthetic["images"])
