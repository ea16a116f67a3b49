"""The engine plug-in's server steps pinned on a stand-in ``self`` (dissertation ch. 5, Eq. 5, Table 3): what
``FedBiP.synthesize`` hands the pipeline for each ablation level (the uploaded latents or the server's own N(0, I)
draws, the learned or the real-word concepts, where the perturbation applies) and how it turns the pipeline's images
into the classifier's inputs, ``check_upload``'s refusals, ``receive``, the grid's layout, the evaluation hooks, the
metrics and the options' checks."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import re  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import hfpfl.fedbip.method as method  # noqa: E402
from hfpfl.fedbip.config import UPLOAD, FedBiPConfig, _sampler_ok, _template_ok  # noqa: E402
from hfpfl.fedbip.method import FedBiP  # noqa: E402

C, D = 4, 8  # latent channels (4 x 4 latents), text width


class StubPipe:
    """Records its call; returns images whose width profile is (0, 0, 0, 1.75) + channel offset (-0.3, 0, 0.3) once
    mapped to [-1, 1], so the resize, the channel mean and the clamp can be computed by hand."""

    def __init__(self):
        self.calls = []
        self.text_encoder = SimpleNamespace(config=SimpleNamespace(hidden_size=D))

    def latent_shape(self):
        return (C, 4, 4)

    def __call__(self, latents, labels, S, V, **kw):
        self.calls.append(dict(latents=latents.clone(), labels=labels.clone(), S=S, V=V, **kw))
        x = torch.tensor([0.0, 0.0, 0.0, 1.75])[None, None, None, :] + torch.tensor([-0.3, 0.0, 0.3])[None, :, None,
                                                                                                   None]
        images = ((x + 1) / 2 + getattr(self, "shift", 0.0)).expand(len(labels), 3, 4, 4).double()
        return SimpleNamespace(images=images, labels=labels.int())


GENERATOR = torch.Generator()


def _self(personalization="full", size=2, channels=1):
    cfg = FedBiPConfig(personalization=personalization, multiplier=2, prompt_template="[S] of [V]",
                       num_inference_steps=3, guidance_scale=1.5, synthesis_batch_size=5, concept_space="output",
                       n_s=1, n_v=1)
    return SimpleNamespace(
        config=cfg, pipe=StubPipe(), concept_sigma=0.07, sampler_t0=651,
        ctx=SimpleNamespace(generator=lambda r, c, tag: {(4, 2, "fedbip-synthesis"): GENERATOR.manual_seed(5)}[
            (r, c, tag)], data=SimpleNamespace(image_size=size, num_channels=channels, num_labels=3)),
        word_concepts=lambda cid: (torch.full((1, D), 10.0 + cid), torch.full((3, 1, D), 20.0 + cid)))


def _upload(keys, cid=2):
    full = {"latents": torch.randn(2, C, 4, 4, generator=torch.Generator().manual_seed(1)),
            "labels": torch.tensor([2, 0]), "domain_concept": torch.ones(1, D), "class_concepts": -torch.ones(3, 1, D)}
    return SimpleNamespace(client_id=cid, upload={UPLOAD: {k: full[k] for k in keys}}, received={})


def test_synthesis_of_a_full_upload_starts_from_its_latents_with_its_concepts():
    """full: the uploaded z(T), labels, S (perturbed with sigma, Eq. 5) and V, the sampler started at its first
    timestep, every sampling setting; the output is the pipeline's [0, 1] images mapped to [-1, 1], resized to the
    classifier's 2 px by antialiased bilinear filtering (width profile (0, 0, 0, 1.75) -> (0.75 * 0 + 0.75 * 0 +
    0.25 * 0, 0.25 * 0 + 0.75 * 0 + 0.75 * 1.75) / 1.75 = (0, 0.75)) and averaged over the channels (the offsets
    -0.3 / 0 / 0.3 cancel) for a grey-scale classifier; labels as int64."""
    me = _self()
    up = _upload(["latents", "labels", "domain_concept", "class_concepts"])
    x, y = FedBiP.synthesize(me, up, 4)
    (c,) = me.pipe.calls
    assert torch.equal(c["latents"], up.upload[UPLOAD]["latents"]) and c["labels"].tolist() == [2, 0]
    assert torch.equal(c["S"], torch.ones(1, D)) and torch.equal(c["V"], -torch.ones(3, 1, D))
    assert c["concept_noise_sigma"] == 0.07 and c["start_timestep"] == 651
    assert (c["prompt_template"], c["num_inference_steps"], c["guidance_scale"], c["batch_size"], c["output_type"],
            c["concept_space"]) == ("[S] of [V]", 3, 1.5, 5, "pt", "output")
    assert c["generator"] is GENERATOR
    assert x.dtype == torch.float32 and x.shape == (2, 1, 2, 2) and x.is_contiguous()
    assert torch.allclose(x, torch.tensor([0.0, 0.75]).expand(2, 1, 2, 2), atol=1e-6)
    assert y.dtype == torch.long and y.tolist() == [2, 0]


def test_synthesis_keeps_rgb_at_the_ldm_size_and_clamps():
    """A 3-channel classifier at the LDM's own 4 px: no resize, no channel mean, values clamped to [-1, 1] at both
    ends (the stub's images shifted by -1.5 reach -1.8)."""
    me = _self(size=4, channels=3)
    x, _ = FedBiP.synthesize(me, _upload(["latents", "labels", "domain_concept", "class_concepts"]), 4)
    raw = (torch.tensor([0.0, 0.0, 0.0, 1.75])[None, None, None, :]
           + torch.tensor([-0.3, 0.0, 0.3])[None, :, None, None]).expand(2, 3, 4, 4)
    want = raw.clamp(-1, 1)
    assert x.shape == (2, 3, 4, 4) and torch.allclose(x, want, atol=1e-6)
    me.pipe.shift = -0.75  # -1.5 once mapped to [-1, 1]
    x, _ = FedBiP.synthesize(me, _upload(["latents", "labels", "domain_concept", "class_concepts"]), 4)
    assert torch.allclose(x, (raw - 1.5).clamp(-1, 1), atol=1e-6) and float(x.min()) == -1.0


@pytest.mark.parametrize("level,keys,S_word,V_word,sigma", [
    ("concept", ["labels", "domain_concept", "class_concepts"], False, False, 0.07),
    ("domain", ["labels", "domain_concept"], False, True, 0.07),
    ("class", ["labels", "class_concepts"], True, False, 0.0),
    ("none", ["labels"], True, True, 0.0),
])
def test_synthesis_without_latents_draws_them_and_fills_in_the_real_words(level, keys, S_word, V_word, sigma):
    """No latents uploaded: z(T) ~ N(0, I), multiplier (2) draws per uploaded label, from the client's synthesis
    stream, the sampler's whole schedule (no start timestep); the half not learned is the client's real words
    (word_concepts), and only a learned S is perturbed."""
    me = _self(level)
    FedBiP.synthesize(me, _upload(keys), 4)
    (c,) = me.pipe.calls
    assert c["labels"].tolist() == [2, 0, 2, 0]
    assert torch.equal(c["latents"], torch.randn((4, C, 4, 4), generator=torch.Generator().manual_seed(5)))
    assert c["start_timestep"] is None and c["concept_noise_sigma"] == sigma
    assert torch.equal(c["S"], torch.full((1, D), 12.0) if S_word else torch.ones(1, D))
    assert torch.equal(c["V"], torch.full((3, 1, D), 22.0) if V_word else -torch.ones(3, 1, D))


def test_instance_only_synthesis_uses_the_latents_and_the_real_words():
    me = _self("instance")
    FedBiP.synthesize(me, _upload(["latents", "labels"]), 4)
    (c,) = me.pipe.calls
    assert c["start_timestep"] == 651 and c["concept_noise_sigma"] == 0.0 and c["labels"].tolist() == [2, 0]
    assert torch.equal(c["S"], torch.full((1, D), 12.0)) and torch.equal(c["V"], torch.full((3, 1, D), 22.0))


def test_receive_checks_then_synthesises_the_upload():
    seen = []
    me = SimpleNamespace(check_upload=lambda u: seen.append(("check", u)),
                         synthesize=lambda u, r: seen.append(("synth", u, r)) or "images")
    up = _upload(["labels"])
    FedBiP.receive(me, up, 3)
    assert seen == [("check", up), ("synth", up, 3)] and up.received == {"synthetic": "images"}


def _checked(level="full", **changes):
    me = _self(level)
    up = _upload(list(me.config.upload_keys))
    up.upload[UPLOAD].update(changes)
    FedBiP.check_upload(me, up)


def test_check_upload_accepts_every_levels_upload():
    for level in ("full", "instance", "concept", "domain", "class", "none"):
        _checked(level)
    _checked(labels=torch.tensor([0, 2]))  # labels 0 and C - 1


@pytest.mark.parametrize("changes,msg", [
    (dict(labels=torch.tensor([[0, 1]])), "client 2 uploaded labels of shape (1, 2); expected (N,), N >= 1"),
    (dict(labels=torch.tensor([], dtype=torch.long), latents=torch.zeros(0, C, 4, 4)),
     "client 2 uploaded labels of shape (0,); expected (N,), N >= 1"),
    (dict(labels=torch.tensor([-1, 0])), "client 2 uploaded labels outside [0, 3)"),
    (dict(labels=torch.tensor([0, 3])), "client 2 uploaded labels outside [0, 3)"),
    (dict(latents=torch.zeros(2, C, 4)), "client 2 uploaded latents of shape (2, 4, 4), but the LDM"),
    (dict(latents=torch.zeros(2, C, 4, 5)), "expects (N, 4, 4, 4): the client used a different LDM/VAE or image size"),
    (dict(latents=torch.zeros(3, C, 4, 4)), "client 2 uploaded 3 latents but 2 labels"),
    (dict(domain_concept=torch.zeros(2, D)), "client 2 uploaded domain_concept (2, 8); expected (1, 8)"),
    (dict(domain_concept=torch.zeros(1, D + 1)), "client 2 uploaded domain_concept (1, 9); expected (1, 8)"),
    (dict(class_concepts=torch.zeros(2, 1, D)), "client 2 uploaded class_concepts (2, 1, 8); expected (3, 1, 8)"),
    (dict(class_concepts=torch.zeros(3, 2, D)), "client 2 uploaded class_concepts (3, 2, 8); expected (3, 1, 8)"),
    (dict(class_concepts=torch.zeros(3, 1, D - 1)), "client 2 uploaded class_concepts (3, 1, 7); expected (3, 1, 8)"),
    (dict(extra=torch.zeros(1)), "client 2 uploaded ['class_concepts', 'domain_concept', 'extra', 'labels', "
                                 "'latents']; FedBiP (full) expects exactly ['class_concepts', 'domain_concept', "
                                 "'labels', 'latents']"),
])
def test_check_upload_refuses_with_the_client_named(changes, msg):
    with pytest.raises(ValueError, match=re.escape(msg)):
        _checked(**changes)


def test_check_upload_refuses_other_parts():
    me = _self()
    up = _upload(list(me.config.upload_keys))
    up.upload["weights"] = {}
    with pytest.raises(ValueError, match=re.escape("client 2 uploaded parts ['fedbip', 'weights']; FedBiP expects only "
                                                   "'fedbip'")):
        FedBiP.check_upload(me, up)


def test_the_grid_shows_each_clients_real_and_own_synthetic_images(monkeypatch, tmp_path):
    """One row block per client that uploaded, in client order: its train images and labels, the synthetic images
    made from its upload only, "client c: <domain>" ("mixed" for a client holding several domains), the class count
    and grid_per_class; written to <output_dir>/synthetic_grid.png unless a path is given."""
    seen = {}
    monkeypatch.setattr(method, "save_real_vs_synthetic_grid",
                        lambda path, real, syn, names, n, per_class: seen.update(
                            path=path, real=real, syn=syn, names=names, n=n, per_class=per_class) or "written")
    train = {0: SimpleNamespace(pixel_values=torch.zeros(1, 1, 2, 2), labels=torch.tensor([1])),
             2: SimpleNamespace(pixel_values=torch.ones(1, 1, 2, 2), labels=torch.tensor([0]))}
    me = SimpleNamespace(
        config=SimpleNamespace(grid_per_class=4),
        synthetic={"images": torch.arange(5.0).view(5, 1, 1, 1), "labels": torch.tensor([0, 1, 2, 0, 1]),
                   "clients": torch.tensor([2, 0, 2, 0, 2])},
        ctx=SimpleNamespace(output_dir=tmp_path, train_data=lambda c: train[c],
                            client=lambda c: SimpleNamespace(domain={0: "usps", 2: None}[c]),
                            data=SimpleNamespace(num_labels=3)))
    assert FedBiP.save_grid(me) == "written"
    assert seen["path"] == tmp_path / "synthetic_grid.png"
    assert seen["names"] == ["client 0: usps", "client 2: mixed"] and seen["n"] == 3 and seen["per_class"] == 4
    assert [r[0] for r in seen["real"]] == [train[0].pixel_values, train[2].pixel_values]
    assert [r[1].tolist() for r in seen["real"]] == [[1], [0]]
    assert [s[0].flatten().tolist() for s in seen["syn"]] == [[1.0, 3.0], [0.0, 2.0, 4.0]]
    assert [s[1].tolist() for s in seen["syn"]] == [[1, 0], [0, 2, 1]]
    FedBiP.save_grid(me, Path("elsewhere.png"))
    assert seen["path"] == Path("elsewhere.png")


def test_every_client_is_evaluated_on_the_one_global_classifier():
    me = SimpleNamespace(load_global=lambda state: ("global", state))
    assert FedBiP.load_personal(me, 1, "state", {"p": 1}, 3) == ("global", "state")
    assert FedBiP.personalize_new_client(me, 7, "state", "data", 3) == ("global", "state")


def test_extra_metrics(monkeypatch):
    """The synthetic set's size and the classifier's last train loss after aggregate; the privacy metrics (both
    functions' rows) only when asked, the nearest-neighbour ones only once there is a synthetic set."""
    monkeypatch.setattr(method, "membership_inference_gap", lambda algo, state, r: {"mia": (algo, state, r)})
    monkeypatch.setattr(method, "synthetic_nearest_neighbors", lambda sim, syn: {"nn": (sim, syn)})
    syn = {"labels": torch.zeros(6)}
    me = SimpleNamespace(synthetic=syn, classifier_metrics={"train_loss": torch.tensor(0.25)},
                         config=SimpleNamespace(privacy_metrics=False), ctx="sim")
    assert FedBiP.extra_metrics(me, 1, "state") == {"num_synthetic": 6, "classifier_train_loss": 0.25}
    me.config.privacy_metrics = True
    assert FedBiP.extra_metrics(me, 1, "state") == {"num_synthetic": 6, "classifier_train_loss": 0.25,
                                                    "mia": (me, "state", 1), "nn": ("sim", syn)}
    me.synthetic = None
    assert FedBiP.extra_metrics(me, 1, "state") == {"mia": (me, "state", 1)}
    me.config.privacy_metrics = False
    assert FedBiP.extra_metrics(me, 1, "state") == {}


def test_option_checks():
    assert _template_ok("A [S] style of a [V]") and _template_ok("[STY] [CLS]")
    assert not _template_ok("A [S] style") and not _template_ok("[S] [S] [V]")
    assert _sampler_ok("pndm") and _sampler_ok("DDIM") and _sampler_ok("ddpm") and not _sampler_ok("euler")
    with pytest.raises(Exception, match="multiplier"):
        FedBiPConfig(multiplier=0)
