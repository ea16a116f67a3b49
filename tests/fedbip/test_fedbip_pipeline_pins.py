"""FedBiPPipeline's helpers pinned by hand (dissertation ch. 5, Eq. 4-5): which token embeddings (or output states)
the concept prompt replaces, the placeholder tokens and their positions, the sampler's schedule cut at an uploaded
latent's timestep, and the input checks, each at its boundary and with the message it gives."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import re  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from hfpfl.fedbip import build_tiny_ldm  # noqa: E402
from hfpfl.pipelines import FedBiPPipeline  # noqa: E402
from hfpfl.pipelines.pipeline_fedbip import encode_concept_prompt, expand_template, tokenize_concept_template  # noqa: E402

torch.set_num_threads(1)
D = 32  # the tiny LDM's text width


@pytest.fixture
def pipe():
    p = FedBiPPipeline(**build_tiny_ldm(image_size=16, seed=0))
    p.set_progress_bar_config(disable=True)
    return p


class StubTextEncoder(torch.nn.Module):
    """Token embedding table row i = i + j / 100 in column j; the "encoder" maps the embedded sequence e to 2 e + 1,
    so where a concept replaced a token embedding (input space) the output row is 2 * concept + 1."""

    def __init__(self, vocab):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, D)
        with torch.no_grad():
            self.emb.weight.copy_(torch.arange(vocab)[:, None] + torch.arange(D)[None] / 100)

    @property
    def device(self):
        return self.emb.weight.device

    def get_input_embeddings(self):
        return self.emb

    def forward(self, ids):
        return (2 * self.emb(ids) + 1,)


def _ids(tok, n_s, n_v):
    """"A [S] style of a [V]" with n_s / n_v placeholders: BOS a S.. style of a V.. EOS pad..., placeholders as -1 / -2."""
    words = tok("A style of a", add_special_tokens=False).input_ids
    assert len(words) == 4
    ids = [tok.bos_token_id, words[0]] + [-1] * n_s + words[1:] + [-2] * n_v + [tok.eos_token_id]
    return ids + [tok.pad_token_id] * (tok.model_max_length - len(ids))


@pytest.mark.parametrize("space", ["input", "output"])
def test_concept_prompt_replaces_exactly_the_placeholder_rows(pipe, space):
    """n_s = n_v = 2, per-sample S (B, n_s, d): input space puts S_b / V_b in place of the placeholders' token
    embeddings (the output row is then 2 * concept + 1 on the stub encoder), output space replaces the encoder's
    output rows by the concepts themselves; every other row is the encoder's output for its token (2 * table + 1),
    the placeholders' own ids read as BOS. Called through the pipeline's method (default: input space)."""
    tok = pipe.tokenizer
    object.__setattr__(pipe, "text_encoder", StubTextEncoder(len(tok) + 8))
    g = torch.Generator().manual_seed(0)
    S, V = torch.randn(3, 2, D, generator=g), torch.randn(3, 2, D, generator=g)
    kw = {} if space == "input" else {"concept_space": "output"}
    h = pipe.encode_concept_prompt("A [S] style of a [V]", S, V, **kw)
    table = pipe.text_encoder.emb.weight.detach()
    ids = _ids(tok, 2, 2)
    assert h.shape == (3, tok.model_max_length, D)
    for b in range(3):
        k_s = k_v = 0
        for p, i in enumerate(ids):
            if i == -1:
                want = 2 * S[b, k_s] + 1 if space == "input" else S[b, k_s]
                k_s += 1
            elif i == -2:
                want = 2 * V[b, k_v] + 1 if space == "input" else V[b, k_v]
                k_v += 1
            else:
                want = 2 * table[i] + 1
            assert torch.allclose(h[b, p], want, atol=1e-6), (b, p)
    # a shared S (n_s, d) is the same for every sample
    h2 = encode_concept_prompt(pipe.text_encoder, tok, "A [S] style of a [V]", S[0], V, space)
    assert torch.allclose(h2[2, 2:4], 2 * S[0] + 1 if space == "input" else S[0], atol=1e-6)
    # the table is only read
    assert torch.equal(pipe.text_encoder.emb.weight.detach(), table)


def test_concept_prompt_errors_name_the_shape_and_space(pipe):
    S = torch.zeros(1, D)
    with pytest.raises(ValueError, match=re.escape("class_concepts per sample must be (B, n_v, d_w), got (2, 32)")):
        encode_concept_prompt(pipe.text_encoder, pipe.tokenizer, "A [S] style of a [V]", S, torch.zeros(2, D))
    with pytest.raises(ValueError, match="concept_space must be 'input' or 'output', got 'middle'"):
        encode_concept_prompt(pipe.text_encoder, pipe.tokenizer, "A [S] style of a [V]", S, torch.zeros(2, 1, D),
                              "middle")


def test_expand_template_places_n_placeholders_and_needs_one_of_each_marker():
    assert expand_template("A [S] style of a [V]", 2, 3) == \
        "A <fedbip-s0> <fedbip-s1> style of a <fedbip-v0> <fedbip-v1> <fedbip-v2>"
    assert expand_template("[STY] [CLS]", 1, 1) == "<fedbip-s0> <fedbip-v0>"
    for bad in ("[S] [S] [V]", "[S] [V] [CLS]", "[S] only", "no markers"):
        with pytest.raises(ValueError, match="exactly one domain placeholder"):
            expand_template(bad, 1, 1)


def test_tokenized_template_adds_missing_placeholders_and_finds_them():
    """A tokenizer without the placeholder tokens gets them added; the ids are the padded template's, each
    placeholder at its position replaced by BOS."""
    tok = build_tiny_ldm(image_size=16, seed=0)["tokenizer"]
    assert "<fedbip-s7>" in tok.get_vocab() and "<fedbip-s8>" not in tok.get_vocab()  # it ships eight of each
    ids, s_pos, v_pos = tokenize_concept_template(tok, "A [S] style of a [V]", 9, 1)  # 16 tokens: fits exactly
    assert "<fedbip-s8>" in tok.get_vocab()
    assert s_pos.tolist() == list(range(2, 11)) and v_pos.tolist() == [14]
    want = [tok.bos_token_id if i < 0 else i for i in _ids(tok, 9, 1)]
    assert ids.tolist() == [want]


@pytest.mark.parametrize("template,found", [("A [S] style of a " + "very " * 12 + "[V]", "1/1 domain and 0/1 class"),
                                            ("[S] " + "very " * 14 + "[V]", "1/1 domain and 0/1 class")])
def test_a_template_longer_than_the_tokenizer_is_refused(pipe, template, found):
    """The prompt is truncated to the tokenizer's 16 tokens; a placeholder cut off is an error naming the count."""
    with pytest.raises(ValueError, match=re.escape(f"does not fit in 16 tokens (found {found} placeholder tokens)")):
        tokenize_concept_template(pipe.tokenizer, template, 1, 1)


def test_vae_scale_factor_is_image_side_over_latent_side(pipe):
    """Three VAE blocks halve twice: 16 px images <-> 4 x 4 latents, factor 4, also the image processor's."""
    assert pipe.vae_scale_factor == 4 == 16 // pipe.latent_shape()[-1]
    assert pipe.image_processor.config.vae_scale_factor == 4


def test_latent_shape_with_a_rectangular_sample_size(pipe):
    object.__setattr__(pipe, "unet", SimpleNamespace(config=SimpleNamespace(in_channels=3, sample_size=(5, 7))))
    assert pipe.latent_shape() == (3, 5, 7)
    object.__setattr__(pipe, "unet", SimpleNamespace(config=SimpleNamespace(in_channels=4, sample_size=6)))
    assert pipe.latent_shape() == (4, 6, 6)


def test_step_kwargs_are_the_ones_each_sampler_takes(pipe):
    g = torch.Generator()
    assert pipe.set_sampler("ddim").prepare_extra_step_kwargs(g, 0.3) == {"eta": 0.3, "generator": g}
    kw = pipe.set_sampler("ddpm").prepare_extra_step_kwargs(g, 0.3)
    assert kw == {"generator": g} and kw["generator"] is g
    assert pipe.set_sampler("pndm").prepare_extra_step_kwargs(g, 0.3) == {}


def test_set_sampler_overrides_apply_to_the_checkpoints_config_only(pipe):
    """Overrides reach the new scheduler, and the next call starts again from the checkpoint's config; the default
    sampler is PNDM; an unknown name is refused with the choices."""
    assert pipe.set_sampler("ddim", timestep_spacing="trailing").scheduler.config.timestep_spacing == "trailing"
    assert pipe.set_sampler("ddim").scheduler.config.timestep_spacing == "leading"
    assert type(pipe.set_sampler().scheduler).__name__ == "PNDMScheduler"
    assert type(pipe.set_sampler("DDPM").scheduler).__name__ == "DDPMScheduler"
    with pytest.raises(ValueError, match=re.escape("unknown sampler 'euler'; choose one of ['ddim', 'ddpm', 'pndm']")):
        pipe.set_sampler("euler")


@pytest.mark.parametrize("start,want", [(901, [901, 801, 801, 701, 601, 501, 401, 301, 201, 101, 1]),
                                        (550, [501, 401, 401, 301, 201, 101, 1]),
                                        (501, [501, 401, 401, 301, 201, 101, 1]),
                                        (101, [101, 1, 1]), (1, [1])])
def test_pndm_schedule_from_a_timestep_repeats_its_new_second_step(pipe, start, want):
    """PNDM (PLMS), 10 leading steps: 901 801 801 701 ... 101 1. Cut at ``start`` (kept: t <= start) the repeat of
    the second timestep is rebuilt at the new second timestep."""
    pipe.scheduler.set_timesteps(10)
    assert pipe.timesteps_from(start).tolist() == want


def test_other_samplers_cut_their_schedule_as_is_and_errors(pipe):
    pipe.set_sampler("ddim").scheduler.set_timesteps(10)
    assert pipe.timesteps_from(550).tolist() == [501, 401, 301, 201, 101, 1]
    with pytest.raises(ValueError, match=re.escape("start_timestep 0 is below every timestep of the sampler's "
                                                   "schedule (lowest 1)")):
        pipe.timesteps_from(0)
    pipe.set_sampler("pndm")
    with pytest.raises(ValueError, match=re.escape("timesteps_from: call scheduler.set_timesteps(num_inference_steps) "
                                                   "first")):
        pipe.timesteps_from(500)
    pipe.scheduler.set_timesteps(10)
    with pytest.raises(ValueError, match="below every timestep"):
        pipe.timesteps_from(0)
    pipe.set_sampler("pndm", skip_prk_steps=False).scheduler.set_timesteps(10)
    with pytest.raises(ValueError, match=re.escape("start_timestep needs PNDM with skip_prk_steps=True (PLMS only)")):
        pipe.timesteps_from(500)


def _ok(pipe, **kw):
    args = dict(latents=torch.zeros(2, 4, 4, 4), labels=torch.tensor([0, 2]), domain_concept=torch.zeros(1, D),
                class_concepts=torch.zeros(3, 1, D), prompt_template="A [S] style of a [V]", concept_noise_sigma=0.0,
                batch_size=1, concept_space="input", start_timestep=None)
    args.update(kw)
    return pipe.check_inputs(**args)


def test_check_inputs_accepts_the_boundaries(pipe):
    """sigma 0, batch 1, one latent, the last class, start timesteps 0 and T - 1 = 999 are all valid."""
    _ok(pipe)
    _ok(pipe, latents=torch.zeros(1, 4, 4, 4), labels=torch.tensor([2]))
    for t in (0, 999):
        _ok(pipe, start_timestep=t)
    _ok(pipe, prompt_template="[STY] and [CLS]", concept_space="output")


@pytest.mark.parametrize("kw,msg", [
    (dict(prompt_template="A [S] style"), "exactly one domain placeholder"),
    (dict(concept_space="middle"), "concept_space must be 'input' or 'output', got 'middle'"),
    (dict(latents=torch.zeros(2, 3, 4, 4)), "latents have shape (2, 3, 4, 4) but the UNet expects (N, 4, 4, 4) "
                                            "(unet.config.in_channels=4, sample_size=4)"),
    (dict(latents=torch.zeros(2, 4, 4)), "latents have shape (2, 4, 4) but"),
    (dict(latents=np.zeros((2, 4, 4, 4))), "latents have shape ndarray but"),
    (dict(latents=torch.zeros(0, 4, 4, 4), labels=torch.zeros(0)), "latents is empty: nothing to generate"),
    (dict(labels=torch.tensor([0, 1, 2])), "labels must be (N,) = (2,), got (3,)"),
    (dict(labels=torch.tensor([[0, 1]])), "labels must be (N,) = (2,), got (1, 2)"),
    (dict(domain_concept=torch.zeros(1, 31)), "domain_concept must be (n_s, 32), got (1, 31)"),
    (dict(domain_concept=torch.zeros(1, 32, 5)), "domain_concept must be (n_s, 32), got (1, 32, 5)"),
    (dict(class_concepts=torch.zeros(3, 1, 31)), "class_concepts must be (C, n_v, 32), got (3, 1, 31)"),
    (dict(class_concepts=torch.zeros(3, 32)), "class_concepts must be (C, n_v, 32), got (3, 32)"),
    (dict(labels=torch.tensor([-1, 0])), "labels must lie in [0, 3) (rows of class_concepts)"),
    (dict(labels=torch.tensor([0, 3])), "labels must lie in [0, 3) (rows of class_concepts)"),
    (dict(concept_noise_sigma=-0.5), "concept_noise_sigma must be >= 0, got -0.5"),
    (dict(batch_size=0), "batch_size must be >= 1, got 0"),
    (dict(start_timestep=1000), "start_timestep must be a timestep of the schedule, 0 to 999, got 1000"),
    (dict(start_timestep=-1), "start_timestep must be a timestep of the schedule, 0 to 999, got -1"),
])
def test_check_inputs_refuses_with_the_argument_named(pipe, kw, msg):
    with pytest.raises(ValueError, match=re.escape(msg)):
        _ok(pipe, **kw)
