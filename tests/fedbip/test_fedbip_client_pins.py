"""FedBiP's client API and the ablations' initial concepts pinned by hand (dissertation ch. 5, Eq. 3-4, App. A):
``client_upload``'s defaults (the paper's settings) and what it hands each level, and ``mixed_init``'s learned half
(the draw ``concept_init`` names, from the client's seed) beside the fixed real-word half."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import hfpfl.fedbip.client as client  # noqa: E402
from hfpfl.fedbip import build_tiny_ldm  # noqa: E402
from hfpfl.fedbip.protocol import mixed_init  # noqa: E402
from pipelines import FedBiPPipeline  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def pipe():
    p = FedBiPPipeline(**build_tiny_ldm(image_size=16, seed=0))
    p.set_progress_bar_config(disable=True)
    return p


def test_client_upload_defaults_and_what_each_level_receives(pipe, monkeypatch):
    """The paper's settings are client_upload's defaults (one S and one V token, template "A [S] style of a [V]",
    50 epochs, batch 8, Adam lr 0.1, gamma ~ N(0.5, 0.1^2), one latent per image, random init, input space, seed 0,
    the maximum timestep); both levels share one DDPM noise scheduler and one generator seeded with ``seed``, get
    the images resized to the VAE's 16 px, and the upload is exactly their outputs."""
    seen = {}

    def fake_instance(vae, noise_scheduler, x, labels, m, class_average, gamma_mean, gamma_std, generator, **kw):
        seen["instance"] = dict(vae=vae, sched=noise_scheduler, x=x, labels=labels, m=m, class_average=class_average,
                                gamma=(gamma_mean, gamma_std), g=generator, state=generator.get_state(), **kw)
        return torch.full((len(labels), 4, 4, 4), 7.0), labels.clone()

    def fake_train(pipe_, x, labels, num_classes, n_s, n_v, template, epochs, steps, batch, lr, **kw):
        seen["concepts"] = dict(x=x, labels=labels, num_classes=num_classes, n_s=n_s, n_v=n_v, template=template,
                                epochs=epochs, steps=steps, batch=batch, lr=lr, **kw)
        return SimpleNamespace(domain_concept=torch.ones(n_s, 32), class_concepts=torch.zeros(num_classes, n_v, 32))

    monkeypatch.setattr(client, "instance_level_latents", fake_instance)
    monkeypatch.setattr(client, "train_concepts", fake_train)
    x = torch.zeros(3, 3, 8, 8)
    x[:, 0] = 0.5  # a constant image: bilinear resizing to 16 px keeps every pixel's value
    up = client.client_upload(pipe, x, [1, 0, 1], num_classes=2)
    inst, conc = seen["instance"], seen["concepts"]
    assert inst["vae"] is pipe.vae and inst["m"] == 1 and inst["class_average"] is False
    assert inst["gamma"] == (0.5, 0.1) and inst["timestep"] is None
    assert type(inst["sched"]).__name__ == "DDPMScheduler" and conc["noise_scheduler"] is inst["sched"]
    assert torch.equal(inst["state"], torch.Generator().manual_seed(0).get_state())
    assert conc["generator"] is inst["g"]
    assert inst["x"].shape == (3, 3, 16, 16) and torch.equal(conc["x"], inst["x"])
    assert torch.equal(inst["x"][:, 0], torch.full((3, 16, 16), 0.5)) and torch.equal(inst["x"][:, 1:], torch.zeros(3, 2, 16, 16))
    assert inst["labels"].tolist() == conc["labels"].tolist() == [1, 0, 1] and inst["labels"].dtype == torch.long
    assert (conc["num_classes"], conc["n_s"], conc["n_v"], conc["template"]) == (2, 1, 1, "A [S] style of a [V]")
    assert (conc["epochs"], conc["steps"], conc["batch"], conc["lr"]) == (50, None, 8, 0.1)
    assert (conc["init"], conc["domain_word"], conc["class_words"], conc["concept_space"]) == ("random", None, None,
                                                                                                "input")
    assert set(up) == {"latents", "labels", "domain_concept", "class_concepts"}
    assert torch.equal(up["latents"], torch.full((3, 4, 4, 4), 7.0)) and up["labels"].tolist() == [1, 0, 1]
    assert torch.equal(up["domain_concept"], torch.ones(1, 32)) and torch.equal(up["class_concepts"],
                                                                                torch.zeros(2, 1, 32))

    # every argument reaches its level
    client.client_upload(pipe, x, [1, 0, 1], num_classes=2, n_s=2, n_v=3, prompt_template="[S] and [V]",
                         num_epochs=4, num_steps=5, batch_size=6, lr=0.7, latents_per_image=2, class_average=True,
                         gamma_mean=0.3, gamma_std=0.2, concept_space="output", init="words", domain_word="mnist",
                         class_words=["zero", "one"], seed=5, timestep=123)
    inst, conc = seen["instance"], seen["concepts"]
    assert (inst["m"], inst["class_average"], inst["gamma"], inst["timestep"]) == (2, True, (0.3, 0.2), 123)
    assert torch.equal(inst["state"], torch.Generator().manual_seed(5).get_state())
    assert (conc["n_s"], conc["n_v"], conc["template"], conc["epochs"], conc["steps"], conc["batch"], conc["lr"]) == (
        2, 3, "[S] and [V]", 4, 5, 6, 0.7)
    assert (conc["init"], conc["domain_word"], conc["class_words"], conc["concept_space"]) == (
        "words", "mnist", ["zero", "one"], "output")


def _algo(pipe, concept_init, concept_space="input", n_s=2, n_v=1):
    d = pipe.text_encoder.config.hidden_size
    cfg = SimpleNamespace(concept_init=concept_init, n_s=n_s, n_v=n_v, prompt_template="A [S] style of a [V]",
                          concept_space=concept_space)
    return SimpleNamespace(config=cfg, pipe=pipe, sim=SimpleNamespace(data=SimpleNamespace(num_labels=2)),
                           word_concepts=lambda cid: (torch.full((n_s, d), -1.0 * cid), torch.full((2, n_v, d), -2.0 * cid)),
                           words=lambda cid: {1: ("mnist", ["zero", "one"]), 2: ("usps", ["two", "three"])}[cid])


@pytest.mark.parametrize("train_s,train_v", [(True, False), (False, True)])
def test_mixed_init_learned_half_is_the_seeded_random_draw(pipe, train_s, train_v):
    """concept_init=random in input space: S_0 = s * randn(n_s, d), V_0 = s * randn(C, n_v, d) drawn in that order
    from a generator seeded with the client's seed, s = std of the token-embedding table; the half not trained is
    the real words' embedding (word_concepts), untouched."""
    d = pipe.text_encoder.config.hidden_size
    s = float(pipe.text_encoder.get_input_embeddings().weight.detach().std())
    g = torch.Generator().manual_seed(11)
    S_exp, V_exp = s * torch.randn(2, d, generator=g), s * torch.randn(2, 1, d, generator=g)
    S, V = mixed_init(_algo(pipe, "random"), 2, train_s, train_v, seed=11)
    assert torch.equal(S, S_exp if train_s else torch.full((2, d), -2.0))  # client 2's words
    assert torch.equal(V, V_exp if train_v else torch.full((2, 1, d), -4.0))


def test_mixed_init_output_space_draw_is_at_the_encoder_outputs_scale(pipe):
    """In output space the random draw is scaled by the std of the text encoder's output states for the template
    (not by the embedding table's std): S_0 / randn is one constant, the same for V_0."""
    d = pipe.text_encoder.config.hidden_size
    g = torch.Generator().manual_seed(3)
    rs, rv = torch.randn(2, d, generator=g), torch.randn(2, 1, d, generator=g)
    S, V = mixed_init(_algo(pipe, "random", "output"), 1, True, False, seed=3)
    S2, V2 = mixed_init(_algo(pipe, "random", "output"), 1, False, True, seed=3)
    scale = float((S / rs).mean())
    assert torch.allclose(S, scale * rs) and torch.allclose(V2, scale * rv)
    assert abs(scale - float(pipe.text_encoder.get_input_embeddings().weight.std())) > 1e-3


def test_mixed_init_words_learned_half_starts_at_the_real_words(pipe):
    """concept_init=words: the learned half starts at the token-embedding rows of the client's domain word (cycled
    to n_s tokens) and class words, read off the table by token id."""
    tok, table = pipe.tokenizer, pipe.text_encoder.get_input_embeddings().weight.detach()

    def rows(w, n):
        ids = tok(w, add_special_tokens=False).input_ids
        return table[[ids[i % len(ids)] for i in range(n)]]

    S, _ = mixed_init(_algo(pipe, "words"), 2, True, False, seed=0)
    _, V = mixed_init(_algo(pipe, "words"), 2, False, True, seed=0)
    assert torch.equal(S, rows("usps", 2))  # client 2's words
    assert torch.equal(V, torch.stack([rows("two", 1), rows("three", 1)]))
