"""The engine plug-in's client steps pinned on a stand-in ``self`` (dissertation ch. 5, Eq. 3-4, Table 3): what
``FedBiP.train_concepts`` hands the concept training (the client's seed stream, the real words only under
concept_init=words, the fixed half of the S-only / V-only ablations, every setting), when it reuses a memoised
training, and how ``FedBiP.instance_latents`` splits a client holding single-image classes."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import hfpfl.fedbip.concepts as concepts  # noqa: E402
import hfpfl.fedbip.method as fedbip_mod  # noqa: E402
from hfpfl.fedbip.method import FedBiP  # noqa: E402

SEEDS = {(0, 1, "fedbip-concepts"): 4242, (0, 2, "fedbip-concepts"): 77, (3, 1, "fedbip-concepts"): 99}


def _self(personalization="full", concept_init="random", reuse=False, pipe=None):
    cfg = SimpleNamespace(personalization=personalization, concept_init=concept_init, n_s=2, n_v=3,
                          prompt_template="[S] of [V]", concept_epochs=7, concept_steps=5, concept_batch_size=4,
                          concept_space="output", reuse_concepts=reuse)
    return SimpleNamespace(config=cfg, pipe=pipe or object(), concept_lr=0.025,
                           ctx=SimpleNamespace(seed_for=lambda r, c, tag: SEEDS[(r, c, tag)],
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

    monkeypatch.setattr(concepts, "train_concepts", fake_train)
    monkeypatch.setattr(fedbip_mod, "mixed_init", fake_mixed)
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


def _inst_self(singleton="self", class_average=False):
    cfg = SimpleNamespace(multiplier=3, class_average=class_average, singleton_classes=singleton, gamma_std=0.2)
    gen = torch.Generator()
    return SimpleNamespace(config=cfg, pipe=SimpleNamespace(vae="vae"), noise_t=651, gen=gen,
                           ctx=SimpleNamespace(generator=lambda r, c, tag: {(2, 1, "fedbip-instance"): gen}[(r, c, tag)],
                                               data=SimpleNamespace(num_labels=4)))


@pytest.fixture
def latent_calls(monkeypatch):
    """instance_level_latents recorded; its "latents" are the images + 100 when class-averaged."""
    calls = []

    def fake(vae, ns, x, y, m, class_average, gamma_mean, gamma_std, g, timestep=None):
        calls.append(dict(vae=vae, ns=ns, x=x.clone(), y=y.tolist(), m=m, ca=class_average, gamma=(gamma_mean, gamma_std),
                          g=g, t=timestep))
        return x + (100 if class_average else 0), y.clone()

    monkeypatch.setattr(fedbip_mod, "instance_level_latents", fake)
    return calls


XI = torch.arange(5.0).view(5, 1, 1, 1)


@pytest.mark.parametrize("singleton,class_average,y", [("error", False, [0, 1, 0, 2, 3]),
                                                       ("self", True, [0, 1, 0, 2, 3]),
                                                       ("self", False, [0, 0, 1, 1, 1])])
def test_instance_latents_in_one_call_unless_singletons_are_handled(latent_calls, singleton, class_average, y):
    """Eq. 3 for every image in one call (multiplier draws, gamma ~ N(0.5, gamma_std^2), the client's instance
    stream, the noising timestep) when single-image classes raise (error), when the class average needs no partner,
    or when no class has a single image."""
    me = _inst_self(singleton, class_average)
    z, labels = FedBiP.instance_latents(me, 1, XI, torch.tensor(y), 2, "sched")
    (c,) = latent_calls
    assert (c["vae"], c["ns"], c["m"], c["ca"], c["gamma"], c["t"]) == ("vae", "sched", 3, class_average, (0.5, 0.2),
                                                                        651)
    assert c["g"] is me.gen and c["y"] == y and torch.equal(c["x"], XI)
    assert labels.tolist() == y


@pytest.mark.parametrize("singleton", ["self", "drop"])
def test_singleton_classes_are_interpolated_apart(latent_calls, singleton):
    """Classes 1, 2 and 3 hold a single image each (images 1, 3, 4): the others are interpolated (Eq. 3), then
    "self" adds the single images as their own class average (i' = i, one more call on the same stream), "drop"
    leaves them out; the uploaded latents and labels are the calls' outputs in that order."""
    me = _inst_self(singleton)
    z, labels = FedBiP.instance_latents(me, 1, XI, torch.tensor([0, 1, 0, 2, 3]), 2, "sched")
    assert [(c["y"], c["ca"], c["m"], c["g"] is me.gen, c["t"], c["vae"], c["ns"], c["gamma"]) for c in latent_calls] == (
        [([0, 0], False, 3, True, 651, "vae", "sched", (0.5, 0.2))]
        + ([([1, 2, 3], True, 3, True, 651, "vae", "sched", (0.5, 0.2))] if singleton == "self" else []))
    assert torch.equal(latent_calls[0]["x"], XI[[0, 2]])
    if singleton == "self":
        assert torch.equal(latent_calls[1]["x"], XI[[1, 3, 4]])
        assert z.flatten().tolist() == [0.0, 2.0, 101.0, 103.0, 104.0] and labels.tolist() == [0, 0, 1, 2, 3]
    else:
        assert z.flatten().tolist() == [0.0, 2.0] and labels.tolist() == [0, 0]


def test_only_singleton_classes(latent_calls):
    """Every class single: "self" uploads the class averages alone; "drop" has nothing to upload and says so."""
    z, labels = FedBiP.instance_latents(_inst_self("self"), 1, XI[:3], torch.tensor([0, 1, 2]), 2, "sched")
    assert [c["y"] for c in latent_calls] == [[0, 1, 2]] and z.flatten().tolist() == [100.0, 101.0, 102.0]
    with pytest.raises(ValueError, match="every class has a single image and singleton_classes=drop: nothing to "
                                         "upload"):
        FedBiP.instance_latents(_inst_self("drop"), 1, XI[:3], torch.tensor([0, 1, 2]), 2, "sched")


def _upd_self(level, fail=None):
    from diffusers import PNDMScheduler

    from hfpfl.fedbip.config import UPLOAD_KEYS_BY_LEVEL

    seen = {}

    def inst(cid, x, y, r, ns):
        seen["inst"] = (cid, x, y, r, ns)
        if fail:
            raise ValueError(fail)
        return torch.full((4, 2), 9.0), torch.tensor([1, 1, 0, 0])

    def conc(cid, x, y, r, ns):
        seen["conc"] = (cid, x, y, r, ns)
        return torch.ones(1, 2), -torch.ones(2, 1, 2)

    cfg = SimpleNamespace(personalization=level, upload_keys=UPLOAD_KEYS_BY_LEVEL[level])
    return SimpleNamespace(config=cfg, pipe=SimpleNamespace(scheduler=PNDMScheduler()), seen=seen,
                           real_images=lambda cid: {3: (torch.zeros(2, 3, 4, 4), torch.tensor([1, 0]))}[cid],
                           instance_latents=inst, train_concepts=conc)


@pytest.mark.parametrize("level,inst,conc", [("full", True, True), ("instance", True, False), ("concept", False, True),
                                             ("domain", False, True), ("class", False, True), ("none", False, False)])
def test_client_update_uploads_what_its_level_uses(level, inst, conc):
    """Each Table 3 level runs the levels it uses, on the client's images and one DDPM noise scheduler built from
    the LDM's, and uploads exactly its keys: latents / labels from Eq. 3 (else the client's labels), S unless V
    only, V unless S only; num_samples is the client's image count, the metric the number of latents."""
    from hfpfl.fedbip.config import UPLOAD

    me = _upd_self(level)
    upd = FedBiP.client_update(me, 3, {}, {}, 2)
    up = upd.upload[UPLOAD]
    assert set(upd.upload) == {UPLOAD} and set(up) == set(me.config.upload_keys)
    assert upd.client_id == 3 and upd.num_samples == 2 and upd.private is None
    assert upd.metrics == {"num_upload_latents": 4 if inst else 0}
    assert ("inst" in me.seen, "conc" in me.seen) == (inst, conc)
    for cid, x, y, r, ns in me.seen.values():
        assert (cid, r, y.tolist(), tuple(x.shape)) == (3, 2, [1, 0], (2, 3, 4, 4))
        assert type(ns).__name__ == "DDPMScheduler" and ns.config.num_train_timesteps == 1000
    if inst:
        assert torch.equal(up["latents"], torch.full((4, 2), 9.0)) and up["labels"].tolist() == [1, 1, 0, 0]
    else:
        assert up["labels"].tolist() == [1, 0]
    if "domain_concept" in up:
        assert torch.equal(up["domain_concept"], torch.ones(1, 2))
    if "class_concepts" in up:
        assert torch.equal(up["class_concepts"], -torch.ones(2, 1, 2))


def test_client_update_names_the_client_in_its_errors():
    with pytest.raises(ValueError, match="^FedBiP client 3: class 1 has a single image$"):
        FedBiP.client_update(_upd_self("instance", fail="class 1 has a single image"), 3, {}, {}, 2)


def test_real_images_are_rgb_at_the_ldms_size():
    """A grey 2 x 2 image with columns (0, 4) becomes 3 equal channels, bilinearly upsampled (half-pixel centres)
    to the LDM's 4 px: columns (0, 0.75 * 0 + 0.25 * 4, 0.25 * 0 + 0.75 * 4, 4) = (0, 1, 3, 4); at the LDM's size
    it is only expanded."""
    x = torch.tensor([[0.0, 4.0], [0.0, 4.0]])[None, None].expand(2, 1, 2, 2)  # two images
    data = SimpleNamespace(pixel_values=x, labels=torch.tensor([2, 1]))
    me = SimpleNamespace(ldm_size=4, ctx=SimpleNamespace(train_data=lambda c: {5: data}[c]))
    img, y = FedBiP.real_images(me, 5)
    assert img.shape == (2, 3, 4, 4) and img.is_contiguous() and y.tolist() == [2, 1]
    assert torch.allclose(img, torch.tensor([0.0, 1.0, 3.0, 4.0]).expand(2, 3, 4, 4))
    me.ldm_size = 2
    img, _ = FedBiP.real_images(me, 5)
    assert torch.equal(img, x.expand(2, 3, 2, 2)) and img.is_contiguous()


def test_nothing_travels_down_and_nothing_is_kept_on_clients():
    assert FedBiP.download(None, {"model": 1}, 0) == {} and FedBiP.init_private_state(None, 0) == {}


@pytest.mark.parametrize("field,value", [("n_s", 1), ("n_v", 1), ("prompt_template", "[V] in [S]"),
                                         ("concept_epochs", 8), ("concept_steps", None), ("concept_batch_size", 2),
                                         ("concept_init", "words"), ("concept_space", "input")])
def test_memoised_concepts_are_not_reused_under_another_setting(calls, field, value):
    """Each concept-training setting is part of the memo's key: changing one trains again."""
    pipe = object()
    FedBiP.train_concepts(_self(reuse=True, pipe=pipe), 1, X, Y, 0, object())
    other = _self(reuse=True, pipe=pipe)
    setattr(other.config, field, value)
    FedBiP.train_concepts(other, 1, X, Y, 0, object())
    assert len(calls["train"]) == 2


def test_memoised_concepts_key_the_lr_classes_words_and_trained_halves(calls):
    """The space-scaled lr, the number of classes, the real words and which halves are trained are in the key."""
    pipe = object()
    base = _self(reuse=True, pipe=pipe, concept_init="words")
    FedBiP.train_concepts(base, 1, X, Y, 0, object())
    n = 1
    for change in (lambda s: setattr(s, "concept_lr", 0.5),
                   lambda s: setattr(s.ctx.data, "num_labels", 3),
                   lambda s: setattr(s, "words", lambda cid: ("mnistm", ["zero", "one"])),
                   lambda s: setattr(s, "words", lambda cid: ("usps", ["nought", "one"])),
                   lambda s: setattr(s.config, "personalization", "domain"),
                   lambda s: setattr(s.config, "personalization", "class")):
        other = _self(reuse=True, pipe=pipe, concept_init="words")
        change(other)
        FedBiP.train_concepts(other, 1, X, Y, 0, object())
        n += 1
        assert len(calls["train"]) == n


def test_memoised_concepts_key_the_fixed_halfs_words(calls, monkeypatch):
    """S only (V fixed at the real words' embedding): the same fixed half reuses the memo; another fixed half (the
    words of another run, e.g. FedDEO's descriptions vs the V-only ablation's class words) trains again, and so
    does another fixed S half."""
    pipe = object()

    def fixed(s_value, v_value):
        return lambda algo, cid, train_s, train_v, seed: (torch.full((2, 4), s_value), torch.full((2, 3, 4), v_value))

    FedBiP.train_concepts(_self(reuse=True, pipe=pipe, personalization="domain"), 1, X, Y, 0, object())
    FedBiP.train_concepts(_self(reuse=True, pipe=pipe, personalization="domain"), 1, X, Y, 0, object())
    assert len(calls["train"]) == 1
    monkeypatch.setattr(fedbip_mod, "mixed_init", fixed(0.5, 0.25))
    FedBiP.train_concepts(_self(reuse=True, pipe=pipe, personalization="domain"), 1, X, Y, 0, object())
    assert len(calls["train"]) == 2
    monkeypatch.setattr(fedbip_mod, "mixed_init", fixed(0.75, 0.25))
    FedBiP.train_concepts(_self(reuse=True, pipe=pipe, personalization="domain"), 1, X, Y, 0, object())
    assert len(calls["train"]) == 3


def test_word_concepts_are_the_clients_real_words_in_the_configured_space(monkeypatch):
    """The real-word concepts: init_concepts(init="words") with the client's domain and class words, the run's
    n_s / n_v / template / space and the data's class count."""
    seen = []
    monkeypatch.setattr(concepts, "init_concepts", lambda *a, **kw: seen.append((a, kw)) or ("S", "V"))
    me = _self()
    assert FedBiP.word_concepts(me, 2) == ("S", "V")
    assert seen == [((me.pipe, 2, 2, 3, "[S] of [V]"), dict(init="words", domain_word="syn",
                                                             class_words=["zero", "one"], concept_space="output"))]
