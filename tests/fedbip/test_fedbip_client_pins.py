"""FedBiP's client API and the ablations' initial concepts pinned by hand (dissertation ch. 5, Eq. 3-4, App. A):
``client_upload``'s defaults (the paper's settings) and what it hands each level, and ``mixed_init``'s learned half
(the draw ``concept_init`` names, from the client's seed) beside the fixed real-word half."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import hfpfl.fedbip.client as client  # noqa: E402
import hfpfl.fedbip.concepts as concepts  # noqa: E402
import hfpfl.fedbip.latents as latents  # noqa: E402
from hfpfl.fedbip import build_tiny_ldm  # noqa: E402
from hfpfl.fedbip.protocol import mixed_init  # noqa: E402
from hfpfl.pipelines import FedBiPPipeline  # noqa: E402

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
    return SimpleNamespace(config=cfg, pipe=pipe, ctx=SimpleNamespace(data=SimpleNamespace(num_labels=2)),
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


# ---------------------------------------------------------------------------------------------------------------
# Eq. 3 and Eq. 4 on a stub LDM whose every number is known
# ---------------------------------------------------------------------------------------------------------------
DS = 6  # the stub text width


class StubVAE(torch.nn.Module):
    """Posterior mean = the image's 3 channels and their sum (4 latent channels), std 0.2 + 0.1 * |mean|;
    scaling factor 0.5, 4 px."""

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.config = SimpleNamespace(sample_size=4, scaling_factor=0.5)

    device = property(lambda self: self.anchor.device)
    dtype = property(lambda self: self.anchor.dtype)

    def encode(self, x):
        mean = torch.cat([x, x.sum(1, keepdim=True)], 1)
        return SimpleNamespace(latent_dist=SimpleNamespace(mean=mean, std=0.2 + 0.1 * mean.abs()))


class StubTE(torch.nn.Module):
    """Token table row i = sin(i + j) in column j; output states 2 e + 1 of the embedded sequence e."""

    def __init__(self, vocab):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, DS)
        with torch.no_grad():
            self.emb.weight.copy_(torch.sin(torch.arange(vocab)[:, None] + torch.arange(DS)[None].float()))
        self.config = SimpleNamespace(hidden_size=DS)

    device = property(lambda self: self.emb.weight.device)

    def get_input_embeddings(self):
        return self.emb

    def forward(self, ids):
        return (2 * self.emb(ids) + 1,)


class StubUNet(torch.nn.Module):
    """eps_hat = w0 z_t + w1 mean(encoder states) with w = (0.3, 0.7), a trainable weight the client must not touch."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([0.3, 0.7]))

    device = property(lambda self: self.w.device)
    dtype = property(lambda self: self.w.dtype)

    def forward(self, zt, t, encoder_hidden_states=None):
        return SimpleNamespace(sample=self.w[0] * zt + self.w[1] * encoder_hidden_states.mean(dim=(1, 2))[:, None, None,
                                                                                                            None])


@pytest.fixture
def stub(pipe):
    from diffusers import DDPMScheduler

    return SimpleNamespace(vae=StubVAE(), text_encoder=StubTE(len(pipe.tokenizer) + 4), tokenizer=pipe.tokenizer,
                           unet=StubUNet(), scheduler=DDPMScheduler())


def _blocks(v):
    """8 px images made of 2 x 2 blocks of the 4 px values v (N, 3, 4, 4): bilinear resizing to 4 px returns v."""
    return v.repeat_interleave(2, -1).repeat_interleave(2, -2)


def _template_rows(stub, n_s=1, n_v=1):
    """Token ids of "A <S> style of a <V>" padded, and the placeholder positions (their ids read as BOS)."""
    tok = stub.tokenizer
    words = tok("A style of a", add_special_tokens=False).input_ids
    ids = [tok.bos_token_id, words[0]] + [tok.bos_token_id] * n_s + words[1:] + [tok.bos_token_id] * n_v
    ids += [tok.eos_token_id] + [tok.pad_token_id] * (tok.model_max_length - len(ids) - 1)
    return torch.tensor(ids), list(range(2, 2 + n_s)), list(range(5 + n_s, 5 + n_s + n_v))


def _reference_training(stub, v, y, C, steps, batch, lr, space, S0, V0, g, train_s=True, train_v=True):
    """Eq. 4 written out: the client's random stream replayed (permutation, then per step posterior noise, t and
    eps), z(0) = (mu + sigma n) * 0.5, z_t = sqrt(ab_t) z(0) + sqrt(1 - ab_t) eps on DDPM's default linear schedule,
    the concepts spliced into the prompt (input space: in place of the token embeddings, then 2 e + 1; output
    space: in place of the output states), L = mean (eps_hat - eps)^2, Adam (0.9, 0.999) on the trained half."""
    mean = torch.cat([v, v.sum(1, keepdim=True)], 1)
    std = 0.2 + 0.1 * mean.abs()
    ab = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000), 0)
    ids, sp, vp = _template_rows(stub)
    table = stub.text_encoder.emb.weight.detach()
    S, V = S0.clone().requires_grad_(train_s), V0.clone().requires_grad_(train_v)
    opt = torch.optim.Adam([p for p, on in ((S, train_s), (V, train_v)) if on], lr=lr)
    losses, n = [], len(v)
    perm, pos = torch.randperm(n, generator=g), 0
    for _ in range(steps):
        if pos + batch > n and pos > 0:
            perm, pos = torch.randperm(n, generator=g), 0
        idx = perm[pos:pos + batch]
        pos += batch
        z0 = (mean[idx] + std[idx] * torch.randn(mean[idx].shape, generator=g)) * 0.5
        t = torch.randint(0, 1000, (len(idx),), generator=g)
        eps = torch.randn(z0.shape, generator=g)
        a = ab[t][:, None, None, None]
        zt = a.sqrt() * z0 + (1 - a).sqrt() * eps
        e = table[ids].expand(len(idx), -1, -1).clone()
        if space == "input":
            e[:, sp], e[:, vp] = S.expand(len(idx), -1, -1), V[y[idx]]
            h = 2 * e + 1
        else:
            h = 2 * e + 1
            h[:, sp], h[:, vp] = S.expand(len(idx), -1, -1), V[y[idx]]
        loss = ((0.3 * zt + 0.7 * h.mean(dim=(1, 2))[:, None, None, None] - eps) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return S.detach(), V.detach(), losses


def test_concept_training_with_the_defaults_replayed_by_hand(stub):
    """train_concepts' defaults (input space, one S and one V token, "A [S] style of a [V]", 50 epochs of batches of
    8 = 100 steps for 16 images, Adam lr 0.1, random init at the token table's std drawn S then V from the
    generator, DDPM noise scheduler from the LDM's config, images resized to the VAE's 4 px) give the S, V and
    per-step losses of the hand replay; the LDM's weight is neither changed nor given a gradient, and its
    requires_grad comes back."""
    v = torch.rand(16, 3, 4, 4, generator=torch.Generator().manual_seed(0)) * 2 - 1
    y = torch.tensor([0, 1, 2] * 5 + [0])
    res = concepts.train_concepts(stub, _blocks(v), y, 3, generator=torch.Generator().manual_seed(4))
    g = torch.Generator().manual_seed(4)
    s = float(stub.text_encoder.emb.weight.detach().std())
    S0, V0 = s * torch.randn(1, DS, generator=g), s * torch.randn(3, 1, DS, generator=g)
    S, V, losses = _reference_training(stub, v, y, 3, 100, 8, 0.1, "input", S0, V0, g)
    assert len(res.losses) == 100
    assert torch.allclose(torch.tensor(res.losses), torch.tensor(losses), rtol=1e-4, atol=1e-6)
    assert torch.equal(res.init_domain_concept, S0) and torch.equal(res.init_class_concepts, V0)
    assert torch.allclose(res.domain_concept, S, atol=1e-5) and torch.allclose(res.class_concepts, V, atol=1e-5)
    assert torch.equal(stub.unet.w.detach(), torch.tensor([0.3, 0.7])) and stub.unet.w.grad is None
    assert stub.unet.w.requires_grad and stub.text_encoder.emb.weight.requires_grad


@pytest.mark.parametrize("n,batch,steps", [(3, 8, 4), (1, 1, 3), (5, 2, 7)])
def test_concept_training_batches_and_reshuffles_by_hand(stub, n, batch, steps):
    """Output space, given initial concepts, ``num_steps``: fewer images than a batch (one batch of all, reshuffled
    every step after the first), batches of one, and a last partial batch folded into a new permutation."""
    v = torch.rand(n, 3, 4, 4, generator=torch.Generator().manual_seed(n)) * 2 - 1
    y = torch.arange(n) % 2
    S0 = torch.linspace(-1, 1, DS)[None]
    V0 = torch.stack([torch.full((1, DS), 0.5), torch.full((1, DS), -0.5)])
    res = concepts.train_concepts(stub, _blocks(v), y, 2, num_steps=steps, batch_size=batch, lr=0.05,
                                init_domain_concept=S0, init_class_concepts=V0, concept_space="output",
                                generator=torch.Generator().manual_seed(9))
    S, V, losses = _reference_training(stub, v, y, 2, steps, batch, 0.05, "output", S0, V0,
                                       torch.Generator().manual_seed(9))
    assert torch.allclose(torch.tensor(res.losses), torch.tensor(losses), rtol=1e-4, atol=1e-6)
    assert torch.allclose(res.domain_concept, S, atol=1e-5) and torch.allclose(res.class_concepts, V, atol=1e-5)


def test_s_only_training_keeps_v_and_one_given_half_is_not_an_init(stub):
    """train_class=False: V stays bit for bit, S follows the replay; only one of the two initial halves given:
    both are drawn (output space: at the std of the template's output states), the given one ignored."""
    v = torch.rand(4, 3, 4, 4, generator=torch.Generator().manual_seed(2)) * 2 - 1
    y = torch.tensor([0, 1, 1, 0])
    S0, V0 = torch.ones(1, DS) * 0.1, torch.ones(2, 1, DS) * -0.1
    res = concepts.train_concepts(stub, _blocks(v), y, 2, num_steps=3, batch_size=4, init_domain_concept=S0,
                                init_class_concepts=V0, concept_space="output", train_class=False,
                                generator=torch.Generator().manual_seed(1))
    S, V, _ = _reference_training(stub, v, y, 2, 3, 4, 0.1, "output", S0, V0, torch.Generator().manual_seed(1),
                                  train_v=False)
    assert torch.equal(res.class_concepts, V0) and torch.allclose(res.domain_concept, S, atol=1e-5)
    res = concepts.train_concepts(stub, _blocks(v), y, 2, num_steps=1, init_domain_concept=S0,
                                concept_space="output", generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(1)
    ids, _, _ = _template_rows(stub)
    s = float((2 * stub.text_encoder.emb.weight.detach()[ids] + 1).std())
    assert torch.allclose(res.init_domain_concept, s * torch.randn(1, DS, generator=g))
    assert torch.allclose(res.init_class_concepts, s * torch.randn(2, 1, DS, generator=g))


def test_concept_training_refuses_bad_inputs_with_the_reason(stub):
    x = torch.zeros(2, 3, 4, 4)
    with pytest.raises(ValueError, match="^2 images but 3 labels$"):
        concepts.train_concepts(stub, x, [0, 1, 0], 2, num_steps=1)
    with pytest.raises(ValueError, match="^label 2 >= num_classes=2$"):
        concepts.train_concepts(stub, x, [0, 2], 2, num_steps=1)
    concepts.train_concepts(stub, x, [0, 1], 2, num_steps=1)  # label C - 1 is fine
    with pytest.raises(ValueError, match=r"^train_concepts: nothing to train \(train_domain and train_class are both "
                                         r"False\)$"):
        concepts.train_concepts(stub, x, [0, 1], 2, num_steps=1, train_domain=False, train_class=False)


def test_the_loss_of_given_draws_by_hand(stub):
    """concept_denoising_loss with its default template and space on fixed z(0), t, eps: the replay's formula."""
    z0 = torch.linspace(-1, 1, 2 * 4 * 16).view(2, 4, 4, 4)
    eps = torch.cos(torch.arange(2 * 4 * 16.0)).view(2, 4, 4, 4)
    t = torch.tensor([10, 900])
    S, V = torch.full((1, DS), 0.3), torch.stack([torch.full((1, DS), -0.2), torch.full((1, DS), 0.4)])
    from diffusers import DDPMScheduler

    loss = concepts.concept_denoising_loss(stub, DDPMScheduler(), z0, [1, 0], S, V, t, eps)
    ab = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000), 0)[t][:, None, None, None]
    ids, sp, vp = _template_rows(stub)
    e = stub.text_encoder.emb.weight.detach()[ids].expand(2, -1, -1).clone()
    e[:, sp], e[:, vp] = S.expand(2, -1, -1), V[[1, 0]]
    pred = 0.3 * (ab.sqrt() * z0 + (1 - ab).sqrt() * eps) + 0.7 * (2 * e + 1).mean(dim=(1, 2))[:, None, None, None]
    assert torch.allclose(loss, ((pred - eps) ** 2).mean(), atol=1e-6)


def test_instance_latents_by_hand_with_the_defaults_and_a_timestep(stub):
    """One latent per image by default, noised to T - 1 = 999; class averages over three classes (z = mean * 0.5,
    averaged within each class) noised to a given t = 500; the generator's first draw is eps (no partners needed);
    8 px images resized to the VAE's 4 px."""
    from diffusers import DDPMScheduler

    v = torch.rand(5, 3, 4, 4, generator=torch.Generator().manual_seed(3)) * 2 - 1
    y = torch.tensor([0, 1, 2, 1, 0])
    ns = DDPMScheduler()
    ab = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000), 0)
    z = torch.cat([v, v.sum(1, keepdim=True)], 1) * 0.5
    avg = torch.stack([z[y == c].mean(0) for c in y.tolist()])
    zt, ys = latents.instance_level_latents(stub.vae, ns, _blocks(v), y, class_average=True,
                                           generator=torch.Generator().manual_seed(6), timestep=500)
    eps = torch.randn(z.shape, generator=torch.Generator().manual_seed(6))
    assert torch.allclose(zt, ab[500].sqrt() * avg + (1 - ab[500]).sqrt() * eps, atol=1e-6)
    assert torch.equal(ys, y)
    zt, ys = latents.instance_level_latents(stub.vae, ns, _blocks(v), y, class_average=True,
                                           generator=torch.Generator().manual_seed(6))
    assert zt.shape == (5, 4, 4, 4) and torch.allclose(zt, ab[999].sqrt() * avg + (1 - ab[999]).sqrt() * eps,
                                                       atol=1e-6)


def test_interpolation_defaults_are_gamma_half_plus_a_tenth_noise():
    """Two images per class, so each partner is the other one (the partner draw picks among one); gamma =
    clip(0.5 + 0.1 n, 0, 1) drawn after the partners."""
    z0 = torch.arange(4 * 2.0).view(4, 2)
    zbar, gamma, partners = latents.interpolate_latents(z0, torch.tensor([0, 1, 1, 0]),
                                                       generator=torch.Generator().manual_seed(2))
    g = torch.Generator().manual_seed(2)
    for _ in range(2):
        torch.randint(0, 1, (2,), generator=g)
    want = (0.5 + 0.1 * torch.randn(4, generator=g)).clamp(0, 1)
    assert partners.tolist() == [3, 2, 1, 0] and torch.allclose(gamma, want)
    assert torch.allclose(zbar, want[:, None] * z0 + (1 - want[:, None]) * z0[[3, 2, 1, 0]])


def test_images_to_tensor_reads_pil_and_uint8():
    """PIL images (grey ones converted to RGB) and uint8 arrays map 0..255 to -1..1 as (N, 3, H, W)."""
    from PIL import Image

    a = np.array([[[0, 255, 51], [102, 0, 0]], [[255, 255, 255], [0, 0, 0]]], dtype=np.uint8)  # (2, 2, 3)
    grey = np.array([[0, 255], [51, 102]], dtype=np.uint8)
    x = latents.images_to_tensor([Image.fromarray(a), Image.fromarray(grey)])
    assert x.shape == (2, 3, 2, 2)
    assert torch.allclose(x[0], torch.tensor(a).permute(2, 0, 1).float() / 127.5 - 1)
    assert torch.allclose(x[1], (torch.tensor(grey).float() / 127.5 - 1).expand(3, 2, 2))
    assert torch.allclose(latents.images_to_tensor([Image.fromarray(grey)]), x[1:])  # a list of one
    assert torch.allclose(latents.images_to_tensor(grey[None]), x[1:])
    assert torch.allclose(latents.images_to_tensor([grey, grey]), x[[1, 1]])  # a list of arrays is no PIL list
    assert torch.allclose(latents.images_to_tensor(a[None]), x[:1])
    assert torch.allclose(latents.images_to_tensor(grey[None, :, :, None]), x[1:])
    with pytest.raises(ValueError, match=r"images must be \(N, 3, H, W\) floats"):
        latents.images_to_tensor(torch.zeros(2, 4, 5, 5))
    with pytest.raises(ValueError, match=r"images must be \(N, 3, H, W\) floats"):
        latents.images_to_tensor([])


def test_sampler_timesteps_are_read_off_a_copy():
    """PNDM with 10 leading steps (offset 1): 901 801 801 701 ... 1; the first is 901; the scheduler itself is left
    without timesteps."""
    from diffusers import PNDMScheduler

    sched = PNDMScheduler(skip_prk_steps=True, steps_offset=1)
    assert latents.sampler_timesteps(sched, 10) == [901, 801, 801, 701, 601, 501, 401, 301, 201, 101, 1]
    assert latents.sampler_start_timestep(sched, 10) == 901
    assert latents.sampler_start_timestep(PNDMScheduler(skip_prk_steps=True, steps_offset=1,
                                                       timestep_spacing="trailing"), 10) == 999
    assert sched.timesteps is None


def test_vae_size_is_the_first_side_of_a_listed_sample_size():
    assert latents._vae_size(SimpleNamespace(config=SimpleNamespace(sample_size=(4, 5)))) == 4
    assert latents._vae_size(SimpleNamespace(config=SimpleNamespace(sample_size=7))) == 7
