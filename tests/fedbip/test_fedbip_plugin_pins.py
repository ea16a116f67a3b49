"""The engine plug-in's client steps pinned on a stand-in ``self`` (dissertation ch. 5, Eq. 3-4, Table 3): what
``FedBiP.train_concepts`` hands the concept training (the client's seed stream, the real words only under
concept_init=words, the fixed half of the S-only / V-only ablations, every setting), when it reuses a memoised
training, and how ``FedBiP.instance_latents`` splits a client holding single-image classes."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import hfpfl.algorithms.fedbip as fedbip_mod  # noqa: E402
import hfpfl.fedbip as fedbip_pkg  # noqa: E402
import hfpfl.fedbip.protocol as protocol  # noqa: E402
from hfpfl.algorithms.fedbip import FedBiP  # noqa: E402

SEEDS = {(0, 1, "fedbip-concepts"): 4242, (0, 2, "fedbip-concepts"): 77, (3, 1, "fedbip-concepts"): 99}


def _self(personalization="full", concept_init="random", reuse=False, pipe=None):
    cfg = SimpleNamespace(personalization=personalization, concept_init=concept_init, n_s=2, n_v=3,
                          prompt_template="[S] of [V]", concept_epochs=7, concept_steps=5, concept_batch_size=4,
                          concept_space="output", reuse_concepts=reuse)
    return SimpleNamespace(config=cfg, pipe=pipe or object(), concept_lr=0.025,
                           sim=SimpleNamespace(seed_for=lambda r, c, tag: SEEDS[(r, c, tag)],
                                               data=SimpleNamespace(num_labels=2)),
                           words=lambda cid: ({1: "usps", 2: "syn"}[cid], ["zero", "one"]))


@pytest.fixture
def calls(monkeypatch):
    """Record train_concepts' and mixed_init's arguments; S / V returned are the call's number."""
    calls = {"train": [], "mixed": []}

    def fake_train(pipe, x, y, num_classes, n_s, n_v, template, epochs, steps, batch, lr, **kw):
        calls["train"].append(dict(pipe=pipe, x=x, y=y, num_classes=num_classes, n_s=n_s, n_v=n_v, template=template,
                                   epochs=epochs, steps=steps, batch=batch, lr=lr,
                                   seed=kw["generator"].initial_seed(), **kw))
        n = float(len(calls["train"]))
        return SimpleNamespace(domain_concept=torch.full((2, 4), n), class_concepts=torch.full((2, 3, 4), -n))

    def fake_mixed(algo, cid, train_s, train_v, seed):
        calls["mixed"].append((algo, cid, train_s, train_v, seed))
        return torch.full((2, 4), 0.5), torch.full((2, 3, 4), -0.5)

    monkeypatch.setattr(fedbip_pkg, "train_concepts", fake_train)
    monkeypatch.setattr(protocol, "mixed_init", fake_mixed)
    monkeypatch.setattr(fedbip_mod, "_CONCEPTS", {})
    return calls


X = torch.arange(24.0).view(2, 3, 2, 2)
Y = torch.tensor([0, 1])


def test_train_concepts_hands_over_the_clients_seed_and_settings(calls):
    """Full FedBiP, random init: the generator is seeded with the client's "fedbip-concepts" seed; every setting
    reaches the concept training (lr the space-scaled one); no real words, no fixed half, S and V both trained."""
    me, sched = _self(), object()
    S, V = FedBiP.train_concepts(me, 1, X, Y, 0, sched)
    (c,) = calls["train"]
    assert c["seed"] == 4242 and c["pipe"] is me.pipe and c["x"] is X and c["y"] is Y
    assert (c["num_classes"], c["n_s"], c["n_v"], c["template"]) == (2, 2, 3, "[S] of [V]")
    assert (c["epochs"], c["steps"], c["batch"], c["lr"]) == (7, 5, 4, 0.025)
    assert (c["init"], c["domain_word"], c["class_words"], c["concept_space"]) == ("random", None, None, "output")
    assert c["init_domain_concept"] is None and c["init_class_concepts"] is None
    assert c["noise_scheduler"] is sched and (c["train_domain"], c["train_class"]) == (True, True)
    assert calls["mixed"] == []
    assert torch.equal(S, torch.full((2, 4), 1.0)) and torch.equal(V, torch.full((2, 3, 4), -1.0))
    FedBiP.train_concepts(me, 2, X, Y, 0, sched)  # another client: its own seed
    assert calls["train"][1]["seed"] == 77


def test_train_concepts_from_the_real_words(calls):
    FedBiP.train_concepts(_self(concept_init="words"), 2, X, Y, 0, object())
    c = calls["train"][0]
    assert (c["init"], c["domain_word"], c["class_words"]) == ("words", "syn", ["zero", "one"])


@pytest.mark.parametrize("level,train_s,train_v", [("domain", True, False), ("class", False, True)])
def test_s_only_and_v_only_train_one_half_from_mixed_init(calls, level, train_s, train_v):
    """Table 3's S only / V only: mixed_init(self, client, train_s, train_v, seed) gives both initial halves, and
    only the learned half is trained."""
    me = _self(personalization=level)
    FedBiP.train_concepts(me, 1, X, Y, 3, object())
    assert calls["mixed"] == [(me, 1, train_s, train_v, 99)]
    c = calls["train"][0]
    assert torch.equal(c["init_domain_concept"], torch.full((2, 4), 0.5))
    assert torch.equal(c["init_class_concepts"], torch.full((2, 3, 4), -0.5))
    assert (c["train_domain"], c["train_class"]) == (train_s, train_v) and c["seed"] == 99


def test_memoised_concepts_are_reused_only_for_the_same_pipe_data_and_seed(calls):
    """reuse_concepts: the same LDM, images, labels and seed give the memoised S, V (copies, no training); other
    images, other labels, another LDM object or another client's seed train again; off, every call trains."""
    pipe = object()
    me = _self(reuse=True, pipe=pipe)
    S1, V1 = FedBiP.train_concepts(me, 1, X, Y, 0, object())
    S2, V2 = FedBiP.train_concepts(me, 1, X.clone(), Y.clone(), 0, object())
    assert len(calls["train"]) == 1 and torch.equal(S2, S1) and torch.equal(V2, V1)
    S2.add_(1)  # a copy: the memo is not changed through it
    assert torch.equal(FedBiP.train_concepts(me, 1, X, Y, 0, object())[0], S1)
    FedBiP.train_concepts(me, 1, X + 1, Y, 0, object())
    assert len(calls["train"]) == 2
    FedBiP.train_concepts(me, 1, X, torch.tensor([1, 0]), 0, object())
    assert len(calls["train"]) == 3
    FedBiP.train_concepts(me, 1, X.view(2, 3, 4, 1), Y, 0, object())  # same values, another shape
    assert len(calls["train"]) == 4
    FedBiP.train_concepts(_self(reuse=True, pipe=object()), 1, X, Y, 0, object())
    assert len(calls["train"]) == 5
    FedBiP.train_concepts(me, 2, X, Y, 0, object())
    assert len(calls["train"]) == 6
    off = _self(reuse=False, pipe=pipe)
    FedBiP.train_concepts(off, 1, X, Y, 0, object())
    assert len(calls["train"]) == 7
