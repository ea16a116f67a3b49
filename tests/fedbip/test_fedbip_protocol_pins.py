"""FedBiP's protocol settings pinned by hand (dissertation ch. 5, Eq. 1 and 5, App. A): the timestep clients noise
to and the one the server's sampler starts at for each ``noise_timestep`` choice, the concepts' lr / sigma in their
space, and the synthetic set gathered from the uploads in client order."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import hfpfl.fedbip.concepts as concepts  # noqa: E402
from hfpfl.fedbip.protocol import concept_settings, noising_timestep, resolution_matched_timestep, synthetic_set  # noqa: E402,E501


def _pipe(side=8, spacing="leading"):
    from diffusers import PNDMScheduler

    sched = PNDMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, skip_prk_steps=True,
                          steps_offset=1, timestep_spacing=spacing)
    return SimpleNamespace(scheduler=sched, latent_shape=lambda: (4, side, side))


@pytest.mark.parametrize("choice,side,want", [
    ("sampler_start", 8, (901, 901)),   # PNDM, 10 leading steps: 901 801 801 701 601 ... 1
    ("max", 8, (999, 901)),             # the paper's literal T; the sampler still starts at 901
    ("resolution_matched", 8, (601, 601)),   # t* = 535 for 8 x 8: the first schedule timestep at or above is 601
    ("resolution_matched", 64, (901, 901)),  # t* = 999 for SD's 64 x 64: none above, the sampler's first
    ("650", 8, (701, 701)), ("701", 8, (701, 701)), ("0", 8, (1, 1)), ("950", 8, (901, 901)), ("999", 8, (901, 901)),
])
def test_noising_timestep_per_choice(choice, side, want):
    """(t clients noise to, t the sampler starts at) with 10 PNDM steps: an explicit level is the first schedule
    timestep at or above it, both for the clients and for the sampler (the sampler's first when none is above)."""
    pipe = _pipe(side)
    assert noising_timestep(pipe, SimpleNamespace(noise_timestep=choice, num_inference_steps=10)) == want
    assert pipe.scheduler.timesteps is None  # read off a copy


def test_trailing_spacing_starts_at_t_max():
    assert noising_timestep(_pipe(spacing="trailing"), SimpleNamespace(noise_timestep="sampler_start",
                                                                      num_inference_steps=10)) == (999, 999)


@pytest.mark.parametrize("choice", ["1000", "-1"])
def test_a_level_outside_the_schedule_is_refused_with_the_option_named(choice):
    with pytest.raises(ValueError, match=f"^--noise_timestep must be a timestep of the LDM's schedule, 0 to 999 "
                                         rf"\(or sampler_start, resolution_matched, max\), got {choice}$"):
        noising_timestep(_pipe(), SimpleNamespace(noise_timestep=choice, num_inference_steps=10))


def test_resolution_matched_timestep_is_the_largest_t_at_the_scaled_snr():
    """SNR(t) = ab / (1 - ab) on SD's schedule; the target is SNR(999) (64 / side)^2 and t the largest step whose
    SNR reaches it; a reference side of 32 makes side 8 need 16x, not 64x."""
    from diffusers import DDPMScheduler

    sched = DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
    ab = torch.cumprod(1 - torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000, dtype=torch.float64) ** 2, 0)
    snr = ab / (1 - ab)
    for side, ref in ((8, 64), (16, 64), (8, 32)):
        want = max(t for t in range(1000) if snr[t] >= snr[999] * (ref / side) ** 2)
        assert resolution_matched_timestep(sched, side, ref) == want
    assert resolution_matched_timestep(sched, 8) == 535


def test_concept_settings_scale_lr_and_sigma_only_when_auto(monkeypatch):
    """concept_scale=auto multiplies Adam's lr and the perturbation sigma by the space's scale (computed from the
    text encoder, tokenizer, template, space, n_s and n_v); none uses them literally."""
    seen = []
    monkeypatch.setattr(concepts, "concept_space_scale", lambda *a: seen.append(a) or 0.25)
    pipe = SimpleNamespace(text_encoder="te", tokenizer="tok")
    cfg = SimpleNamespace(concept_scale="auto", concept_lr=0.2, concept_noise_sigma=0.4, prompt_template="[S] [V]",
                          concept_space="input", n_s=2, n_v=3)
    assert concept_settings(pipe, cfg) == (0.05, 0.1, 0.25)
    assert seen == [("te", "tok", "[S] [V]", "input", 2, 3)]
    cfg.concept_scale = "none"
    assert concept_settings(pipe, cfg) == (0.2, 0.4, 1.0) and len(seen) == 1


def test_synthetic_set_in_client_order_with_each_images_client():
    def upd(cid, n, v):
        return SimpleNamespace(client_id=cid, received={"synthetic": (torch.full((n, 1, 2, 2), v),
                                                                      torch.arange(n) + 10 * cid)})

    s = synthetic_set([upd(2, 3, 2.0), upd(0, 2, 0.5)])
    assert s["images"].flatten().tolist() == [0.5] * 8 + [2.0] * 12
    assert s["labels"].tolist() == [0, 1, 20, 21, 22] and s["clients"].tolist() == [0, 0, 2, 2, 2]
    assert s["clients"].dtype == torch.long
