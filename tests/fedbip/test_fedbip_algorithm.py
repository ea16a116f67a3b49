"""FedBiP as an engine plug-in, on a tiny *randomly initialised* LDM saved to a tmp folder (never pretrained here)."""
import dataclasses
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from hfpfl.fedbip.config import FedBiPConfig  # noqa: E402
from hfpfl.fedbip.method import load_ldm  # noqa: E402
from hfpfl.config import RunArguments  # noqa: E402
from hfpfl.fedbip import build_tiny_ldm, state_checksum  # noqa: E402

torch.set_num_threads(1)
SHOTS = 2


@pytest.fixture(scope="module")
def ldm_dir(tmp_path_factory):
    from hfpfl.pipelines.pipeline_fedbip import FedBiPPipeline

    path = tmp_path_factory.mktemp("tiny_ldm")
    FedBiPPipeline(**build_tiny_ldm(image_size=16, seed=0)).save_pretrained(str(path))
    return str(path)


def _few_shot(fed, shots):
    clients = []
    for c in fed.clients:
        y = np.asarray(c.train.with_format(None)["labels"])
        keep = np.sort(np.concatenate([np.flatnonzero(y == k)[:shots] for k in np.unique(y)]))
        clients.append(dataclasses.replace(c, train=c.train.select(keep)))
    return dataclasses.replace(fed, clients=clients)


@pytest.fixture(scope="module")
def fed():
    """3 feature-shift clients (usps, mnistm, syn: domains without mnist), 2 shots per class, 12x12 classifier input."""
    from hfpfl.data import DataArguments, build_federated_dataset

    args = DataArguments(dataset="digits-nomnist", num_clients=3, max_per_domain=80, image_size=12, test_fraction=0.3)
    return args, _few_shot(build_federated_dataset(args, seed=0), SHOTS)


def _cfg(ldm_dir, **kw):
    base = dict(ldm=ldm_dir, multiplier=2, concept_steps=2, num_inference_steps=2, classifier_epochs=1,
                synthesis_batch_size=64, grid_per_class=1)
    base.update(kw)
    return FedBiPConfig(**base)


def _sim(fed, tmp_path, cfg, name="fedbip", **run_kw):
    from hfpfl.federated.engine import Simulation

    data_args, fd = fed
    kw = dict(method="fedbip", num_rounds=3, batch_size=16, lr=0.05, output_dir=str(tmp_path / name),
              progress=False, checkpoint_every=0, overwrite_output_dir=True)
    kw.update(run_kw)
    return Simulation(RunArguments(**kw), data_args, cfg, fed_data=fd, keep_uploads=True)


@pytest.fixture(scope="module")
def full_run(ldm_dir, fed, tmp_path_factory):
    cfg = _cfg(ldm_dir)
    pipe = load_ldm(ldm_dir)
    mods = (pipe.unet, pipe.vae, pipe.text_encoder)
    before = state_checksum(*mods)
    sim = _sim(fed, tmp_path_factory.mktemp("full"), cfg)
    res = sim.run()
    return sim, res, before, state_checksum(*mods)


def test_exactly_one_round_and_only_named_tensors_leave_clients(full_run):
    sim, res, _, _ = full_run
    assert sim.args.num_rounds == 1 and res["num_rounds"] == 1 and len(sim.history) == 1  # asked for 3
    pipe = sim.algorithm.pipe
    c, h, w = pipe.latent_shape()
    d = pipe.text_encoder.config.hidden_size
    expected_up = 0
    for u in sim.last_updates:
        assert set(u.upload["fedbip"]) == {"latents", "labels", "domain_concept", "class_concepts"}
        n = len(sim.train_data(u.client_id))
        assert u.upload["fedbip"]["latents"].shape == (2 * n, c, h, w)
        assert u.upload["fedbip"]["domain_concept"].shape == (1, d) and u.upload["fedbip"]["class_concepts"].shape == (10, 1, d)
        real = sim.train_data(u.client_id).pixel_values
        for v in u.upload["fedbip"].values():  # nothing image-shaped leaves a client
            assert tuple(v.shape[-3:]) != tuple(real.shape[-3:])
        expected_up += sum(v.numel() * v.element_size() for v in u.upload["fedbip"].values())
        assert expected_up > 0
    comm = res["communication"]
    assert comm["bytes_up"] == expected_up and comm["bytes_down"] == 0
    assert sum(2 * len(sim.train_data(i)) for i in range(3)) * c * h * w * 4 < comm["bytes_up"]


def test_ldm_weights_unchanged_and_frozen(full_run):
    sim, _, before, after = full_run
    assert before == after
    pipe = sim.algorithm.pipe
    assert not any(p.requires_grad for m in (pipe.unet, pipe.vae, pipe.text_encoder) for p in m.parameters())
    assert load_ldm(sim.algorithm.config.ldm, sim.device) is pipe  # loaded once per process, shared


def test_synthetic_set_size_and_class_balance(full_run):
    sim, res, _, _ = full_run
    syn = sim.algorithm.synthetic
    assert syn["images"].shape[1:] == (3, 12, 12) and -1 <= syn["images"].min() and syn["images"].max() <= 1
    for cid in range(sim.num_clients):
        y_real = sim.train_data(cid).labels
        y_syn = syn["labels"][syn["clients"] == cid]
        assert len(y_syn) == 2 * len(y_real)
        assert torch.equal(torch.bincount(y_syn, minlength=10), 2 * torch.bincount(y_real, minlength=10))
    assert res["final"]["num_synthetic"] == len(syn["labels"])


def test_each_upload_is_synthesised_on_receipt_alone(full_run):
    """``receive`` makes each client's images from its upload alone (the engine runs it where the upload is, so
    processes synthesise clients in parallel); ``aggregate`` only gathers them. A client synthesised again, after
    another client and on its own, gives the same images: the set does not depend on which process made what."""
    sim, _, _, _ = full_run
    algo, ups = sim.algorithm, sim.last_updates
    syn = algo.synthetic
    assert [u.client_id for u in ups] == [0, 1, 2]
    for u in ups:
        x, y = u.received["synthetic"]
        assert torch.equal(syn["images"][syn["clients"] == u.client_id], x)
        assert torch.equal(syn["labels"][syn["clients"] == u.client_id], y)
    r = sim.history[-1]["round"]
    algo.synthesize(ups[0], r)
    x2, y2 = algo.synthesize(ups[2], r)
    assert torch.equal(x2, ups[2].received["synthetic"][0]) and torch.equal(y2, ups[2].received["synthetic"][1])


def test_server_denoising_starts_from_each_clients_uploaded_latents(full_run):
    """The engine plug-in hands the upload's z_i(T) to the sampler: the UNet's first call sees exactly the first
    synthesis batch of uploaded latents (PNDM: init_noise_sigma 1, no input scaling), and an upload with other
    latents (negated) gives other images while the same upload gives the same ones."""
    sim, _, _, _ = full_run
    algo, upd = sim.algorithm, sim.last_updates[0]
    up = upd.upload["fedbip"]
    firsts = []

    def first_call(module, args, kwargs):
        if not firsts:
            firsts.append(args[0].detach().clone())

    r = sim.history[-1]["round"]
    h = algo.pipe.unet.register_forward_pre_hook(first_call, with_kwargs=True)
    try:
        x, y = algo.synthesize(upd, r)
    finally:
        h.remove()
    n = min(len(up["latents"]), algo.config.synthesis_batch_size)
    assert torch.equal(firsts[0], up["latents"][:n].to(firsts[0].dtype))
    assert torch.equal(x, upd.received["synthetic"][0]) and torch.equal(y, up["labels"])
    from hfpfl.algorithms import Update

    other = Update(upd.client_id, {"fedbip": {**up, "latents": -up["latents"]}}, upd.num_samples)
    x_other, _ = algo.synthesize(other, r)
    assert (x_other - x).abs().mean() > 1e-3


def test_results_privacy_metrics_by_hand(full_run):
    """results.json's privacy numbers recomputed here from the run's state: the nearest-neighbour RMS pixel distance
    of every synthetic image to its own client's train images (mean, min), of every real test image to the train
    images (mean); the membership-inference gaps |mean member - mean non-member| of the final classifier's
    cross-entropy and prediction entropy, members = the clients' train images, non-members = their test images;
    personal accuracy = the mean over clients of the classifier's accuracy on each test split."""
    sim, res, _, _ = full_run
    final = json.loads((sim.output_dir / "results.json").read_text())["final"]
    syn = sim.algorithm.synthetic

    def nn_rms(q, ref):
        return ((q[:, None].double() - ref[None].double()) ** 2).flatten(2).mean(-1).min(1).values.sqrt()

    syn_d, ref_d, member, nonmember, accs = [], [], [], [], []
    model = sim.algorithm.load_personal(0, sim.server_state, None, sim.round)  # FedBiP: one global classifier
    model.eval()
    with torch.no_grad():
        for cid in range(sim.num_clients):
            train, test = sim.train_data(cid), sim.test_data(cid)
            syn_d.append(nn_rms(syn["images"][syn["clients"] == cid], train.pixel_values))
            ref_d.append(nn_rms(test.pixel_values, train.pixel_values))
            for data, out in ((train, member), (test, nonmember)):
                logp = torch.log_softmax(model(pixel_values=data.pixel_values).logits.double(), -1)
                out.append((-logp[torch.arange(len(data.labels)), data.labels], -(logp.exp() * logp).sum(-1)))
            accs.append(float((model(pixel_values=test.pixel_values).logits.argmax(-1) == test.labels).double().mean()))
    syn_d, ref_d = torch.cat(syn_d), torch.cat(ref_d)
    assert final["syn_nn_dist_mean"] == pytest.approx(float(syn_d.mean()), rel=1e-5)
    assert final["syn_nn_dist_min"] == pytest.approx(float(syn_d.min()), rel=1e-5)
    assert final["syn_nn_dist_min"] > 0  # no synthetic image is a copy of a client image
    assert final["real_test_nn_dist_mean"] == pytest.approx(float(ref_d.mean()), rel=1e-5)
    ml, me = (torch.cat([r[i] for r in member]).mean() for i in (0, 1))
    nl, ne = (torch.cat([r[i] for r in nonmember]).mean() for i in (0, 1))
    assert final["mia_loss_gap"] == pytest.approx(abs(float(ml - nl)), rel=1e-4, abs=1e-6)
    assert final["mia_entropy_gap"] == pytest.approx(abs(float(me - ne)), rel=1e-4, abs=1e-6)
    assert final["personal_accuracy"] == pytest.approx(float(np.mean(accs)), abs=1e-9)
    assert set(json.loads((sim.output_dir / "results.json").read_text())["per_domain_accuracy"]) == \
        {"usps", "mnistm", "syn"}
    assert (sim.output_dir / "synthetic_grid.png").stat().st_size > 0


@pytest.mark.parametrize("level,keys", [("none", {"labels"}), ("instance", {"latents", "labels"}),
                                        ("concept", {"labels", "domain_concept", "class_concepts"})])
def test_ablation_levels_upload_only_what_they_use(ldm_dir, fed, tmp_path, level, keys):
    cfg = _cfg(ldm_dir, personalization=level, multiplier=1, privacy_metrics=False, save_grid=False)
    sim = _sim(fed, tmp_path, cfg, name=level)
    res = sim.run()
    assert all(set(u.upload["fedbip"]) == keys for u in sim.last_updates)
    assert res["final"]["num_synthetic"] == sum(len(sim.train_data(i)) for i in range(3))


def test_central_oracle_uploads_raw_data(fed, tmp_path):
    from hfpfl.algorithms.central import CentralConfig

    sim = _sim(fed, tmp_path, CentralConfig(epochs=1), name="central", method="central")
    res = sim.run()
    raw = sum(len(sim.train_data(i)) * (3 * 12 * 12 * 4 + 8) for i in range(3))
    assert res["num_rounds"] == 1 and res["communication"]["bytes_up"] == raw


# ------------------------------------------------------------------------------------------------ bad inputs
def test_template_without_placeholders_is_rejected(ldm_dir):
    with pytest.raises(ValueError, match="placeholder"):
        _cfg(ldm_dir, prompt_template="a photo of a digit")
    with pytest.raises(ValueError, match="personalization"):
        _cfg(ldm_dir, personalization="partial")


def _one_image_of_class_3_on_client_0(fed):
    """The fixture's clients with client 0 keeping a single image of class 3 (no same-class partner for Eq. 3)."""
    data_args, fd = fed
    c0 = fd.clients[0]
    y = np.asarray(c0.train.with_format(None)["labels"])
    keep = [i for i in range(len(y)) if y[i] != 3] + [int(np.flatnonzero(y == 3)[0])]
    return data_args, dataclasses.replace(fd, clients=[dataclasses.replace(c0, train=c0.train.select(sorted(keep)))]
                                          + fd.clients[1:])


def test_client_with_one_image_in_a_class(ldm_dir, fed, tmp_path):
    data_args, bad = _one_image_of_class_3_on_client_0(fed)
    sim = _sim((data_args, bad), tmp_path, _cfg(ldm_dir, personalization="instance"))
    with pytest.raises(ValueError, match=r"client 0: class 3 has a single image"):
        sim.run()
    # the stricter-privacy class-average variant needs no partner
    sim = _sim((data_args, bad), tmp_path, _cfg(ldm_dir, personalization="instance", class_average=True,
                                                privacy_metrics=False, save_grid=False), name="avg")
    assert sim.run()["num_rounds"] == 1


def test_mismatched_latent_shapes_from_a_client(ldm_dir, fed, tmp_path):
    from hfpfl.algorithms import Update

    sim = _sim(fed, tmp_path, _cfg(ldm_dir, personalization="instance"))
    c, h, w = sim.algorithm.pipe.latent_shape()
    bad = Update(2, {"fedbip": {"latents": torch.randn(4, c, h + 1, w), "labels": torch.zeros(4, dtype=torch.long)}}, 4)
    with pytest.raises(ValueError, match=r"client 2 uploaded latents of shape \(4, 4, 5, 4\).*expects"):
        sim.algorithm.aggregate(sim.algorithm.init_server_state(), [bad], 1)
    extra = Update(1, {"fedbip": {"latents": torch.randn(4, c, h, w), "labels": torch.zeros(4, dtype=torch.long),
                                  "images": torch.zeros(4, 3, 16, 16)}}, 4)
    with pytest.raises(ValueError, match="client 1 uploaded"):
        sim.algorithm.aggregate(sim.algorithm.init_server_state(), [extra], 1)


def test_uncached_model_id_offline_fails_fast(fed, tmp_path, monkeypatch, network_calls):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = FedBiPConfig(ldm="someone/not-a-cached-ldm")
    with pytest.raises(OSError, match="not in the local Hub cache"):
        _sim(fed, tmp_path, cfg)
    assert network_calls == []


def test_same_seed_same_uploads_and_synthetic_set(full_run, ldm_dir, fed, tmp_path):
    sim, _, _, _ = full_run
    again = _sim(fed, tmp_path, _cfg(ldm_dir, reuse_concepts=False, privacy_metrics=False, save_grid=False))
    again.run()
    for a, b in zip(sim.last_updates, again.last_updates):
        assert all(torch.equal(a.upload["fedbip"][k], b.upload["fedbip"][k]) for k in a.upload["fedbip"])
    assert torch.equal(sim.algorithm.synthetic["images"], again.algorithm.synthetic["images"])


def test_singleton_classes_self_and_drop(ldm_dir, fed, tmp_path):
    data_args, bad = _one_image_of_class_3_on_client_0(fed)
    for mode, n3 in (("self", 2), ("drop", 0)):
        sim = _sim((data_args, bad), tmp_path, _cfg(ldm_dir, personalization="instance", singleton_classes=mode,
                                                    privacy_metrics=False, save_grid=False), name=mode)
        sim.run()
        up = next(u for u in sim.last_updates if u.client_id == 0).upload["fedbip"]
        assert int((up["labels"] == 3).sum()) == n3 and len(up["latents"]) == len(up["labels"])


def _unet_timesteps(algo, upd):
    seen = []
    h = algo.pipe.unet.register_forward_pre_hook(
        lambda m, a, kw: seen.append(int(torch.as_tensor(a[1] if len(a) > 1 else kw["timestep"]).flatten()[0])),
        with_kwargs=True)
    try:
        algo.synthesize(upd, 0)
    finally:
        h.remove()
    return seen


@pytest.mark.parametrize("choice,spacing,expected,calls", [
    # PNDM, 10 leading steps (offset 1): 901, 801, ..., 1 with PLMS's repeated second timestep
    ("sampler_start", None, 901, [901, 801, 801, 701, 601, 501, 401, 301, 201, 101, 1]),
    ("sampler_start", "trailing", 999, None),
    # the test LDM's 4x4 latents: SNR(t) >= SNR_SD(999) * (64/4)^2 gives t=326 by hand; the first schedule
    # timestep at or above it is 401, where the clients noise and the sampler starts, repeat rebuilt
    ("resolution_matched", None, 401, [401, 301, 301, 201, 101, 1]),
    # an explicit level: the first schedule timestep at or above it, for the clients and the sampler alike (it
    # used to noise to 651 and run the whole schedule from 901)
    ("651", None, 701, [701, 601, 601, 501, 401, 301, 201, 101, 1]),
])
def test_clients_noise_to_the_samplers_first_timestep(ldm_dir, fed, tmp_path, choice, spacing, expected, calls):
    """Sampler start == noising timestep: the upload's latents are noised to the t at which the server's sampler
    begins, and the UNet's calls run the schedule from exactly there."""
    from hfpfl.fedbip import sampler_start_timestep

    cfg = _cfg(ldm_dir, num_inference_steps=10, timestep_spacing=spacing, noise_timestep=choice)
    sim = _sim(fed, tmp_path, cfg, name=f"t-{choice}-{spacing}", num_rounds=1)
    algo = sim.algorithm
    assert algo.noise_t == algo.sampler_t0 == expected
    if choice == "sampler_start":
        assert sampler_start_timestep(algo.pipe.scheduler, 10) == expected
    upd = algo.client_update(0, {}, {}, 0)
    seen = _unet_timesteps(algo, upd)
    assert seen[0] == expected  # the first denoising step is at the timestep the client noised to
    if calls is not None:
        assert seen[: len(calls)] == calls and len(seen) % len(calls) == 0
    # and the client used that timestep: same generator, same latents as noising z_bar(0) to it by hand
    from diffusers import DDPMScheduler

    from hfpfl.fedbip import instance_level_latents

    x, y = algo.real_images(0)
    ns = DDPMScheduler.from_config(algo.pipe.scheduler.config)
    ref, _ = instance_level_latents(algo.pipe.vae, ns, x, y, 2, False, 0.5, 0.1,
                                    sim.generator(0, 0, "fedbip-instance"), timestep=expected)
    assert torch.equal(ref, upd.upload["fedbip"]["latents"])


def test_out_of_range_timesteps_are_refused_with_the_option_named(ldm_dir, fed, tmp_path):
    """--noise_timestep 5000 used to end in an IndexError traceback from the noise schedule after the run folder was
    made; now a ValueError names the option and its range (the CLI turns it into one line, exit 2)."""
    with pytest.raises(ValueError, match=r"--noise_timestep must be a timestep of the LDM's schedule, 0 to 999 .*got 5000"):
        _sim(fed, tmp_path, _cfg(ldm_dir, noise_timestep="5000"), name="bad-t", num_rounds=1)
    assert not (tmp_path / "bad-t" / "results.json").exists()
    pipe = load_ldm(ldm_dir)
    pipe.set_sampler("pndm")
    with pytest.raises(ValueError, match="call scheduler.set_timesteps"):
        pipe.timesteps_from(501)
    z = torch.zeros(1, *pipe.latent_shape())
    S, V = torch.zeros(1, pipe.text_encoder.config.hidden_size), torch.zeros(10, 1, pipe.text_encoder.config.hidden_size)
    with pytest.raises(ValueError, match="start_timestep must be a timestep of the schedule, 0 to 999, got 1000"):
        pipe(z, torch.tensor([0]), S, V, num_inference_steps=2, start_timestep=1000)
    # the recipe: one line, exit 2, and no run folder left behind (it used to stay, empty)
    from hfpfl.experiments import fedbip_compare as compare
    out = tmp_path / "cli-bad-t"
    with pytest.raises(SystemExit) as e:
        compare.main(["--ldm", ldm_dir, "--output_dir", str(out), "--noise_timestep", "5000", "--variants",
                      "instance_only", "--max_per_domain", "80", "--image_size", "12", "--test_fraction", "0.3",
                      "--shots_per_class", "2", "--progress", "false"])
    assert e.value.code == 2 and not out.exists()


def test_random_latent_rows_run_the_whole_schedule_under_resolution_matching(ldm_dir, fed, tmp_path):
    """prompt-only draws z ~ N(0, I) on the server: pure noise must start at the schedule's top, whatever the
    clients' noising timestep."""
    cfg = _cfg(ldm_dir, num_inference_steps=10, noise_timestep="resolution_matched", personalization="none")
    algo = _sim(fed, tmp_path, cfg, name="t-none", num_rounds=1).algorithm
    assert algo.sampler_t0 == 401
    seen = _unet_timesteps(algo, algo.client_update(0, {}, {}, 0))
    assert seen[:3] == [901, 801, 801]


def test_resolution_matched_timestep_keeps_sd_snr_scale_for_scale():
    """Hand numbers for SD v1's schedule (scaled_linear 0.00085..0.012): alpha_bar(999) = 0.00466, SNR 0.00468;
    an 8x8 latent needs 64x that SNR, alpha_bar ~0.23: t = 535; a 64x64 latent (SD itself) keeps T = 999. Then a
    Monte Carlo check of why: the image-wide mean of a noised constant latent has the same SNR at (8x8, 535) as at
    (64x64, 999), and 64x less at (8x8, 999)."""
    from diffusers import DDPMScheduler

    from hfpfl.fedbip.protocol import resolution_matched_timestep

    sched = DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
    assert abs(float(sched.alphas_cumprod[999]) - 0.00466) < 1e-5
    assert resolution_matched_timestep(sched, 64) == 999
    assert resolution_matched_timestep(sched, 8) == 535
    assert resolution_matched_timestep(sched, 32) == 874

    g = torch.Generator().manual_seed(0)

    def mean_snr(side, t):  # signal 1 in every latent pixel; SNR of the mean over the side x side pixels
        a = float(sched.alphas_cumprod[t])
        noisy_means = (a ** 0.5 + (1 - a) ** 0.5 * torch.randn(4000, side * side, generator=g, dtype=torch.float64)
                       ).mean(1)
        return noisy_means.mean() ** 2 / noisy_means.var()

    sd, ours, literal = mean_snr(64, 999), mean_snr(8, 535), mean_snr(8, 999)
    assert 0.85 < ours / sd < 1.2
    assert literal / sd < 0.03


def test_pndm_started_below_its_top_denoises_an_exact_noise_prediction_back(ldm_dir):
    """With an oracle noise prediction (the true eps) every deterministic step keeps x_t on the line
    sqrt(ab_t) x0 + sqrt(1 - ab_t) eps, so a sampler started at 551 must end at ab_0's point of it. The schedule
    ``timesteps_from`` gives does; the img2img-style cut (PLMS's repeated timestep dropped) does not."""
    from hfpfl.fedbip.method import load_ldm

    pipe = load_ldm(ldm_dir)
    pipe.set_sampler("pndm")
    g = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(2, 4, 4, 4, generator=g, dtype=torch.float64)
    ab = pipe.scheduler.alphas_cumprod.double()

    def run(timesteps_of):
        pipe.scheduler.set_timesteps(20)
        ts = timesteps_of()
        x = ab[int(ts[0])].sqrt() * x0 + (1 - ab[int(ts[0])]).sqrt() * eps
        for t in ts:
            x = pipe.scheduler.step(eps, t, x, return_dict=False)[0]
        return x

    target = ab[0].sqrt() * x0 + (1 - ab[0]).sqrt() * eps
    pipe.scheduler.set_timesteps(20)
    assert pipe.timesteps_from(551).tolist()[:4] == [551, 501, 501, 451]
    assert torch.allclose(run(lambda: pipe.timesteps_from(551)), target, atol=1e-6)
    naive = run(lambda: pipe.scheduler.timesteps[pipe.scheduler.timesteps <= 551])
    assert not torch.allclose(naive, target, atol=1e-2)
    # and from the top the rebuilt schedule is PNDM's own
    pipe.scheduler.set_timesteps(20)
    assert torch.equal(pipe.timesteps_from(951), pipe.scheduler.timesteps)


def test_concept_lr_and_sigma_scaled_to_their_space(ldm_dir, fed, tmp_path, monkeypatch):
    """lr 0.1 / sigma 0.1 are output-space settings; in the input (token-embedding) space both are multiplied
    by std(embedding table) / std(text-encoder states of "A _ style of a _", placeholders as BOS), computed here from
    hand-built token ids; the server's perturbation S^ - S then has that std. Output space or concept_scale=none:
    0.1 as given."""

    sim = _sim(fed, tmp_path, _cfg(ldm_dir, personalization="domain", concept_steps=1), name="scale", num_rounds=1)
    algo = sim.algorithm
    te, tok = algo.pipe.text_encoder, algo.pipe.tokenizer
    words = tok("A style of a", add_special_tokens=False).input_ids
    ids = [tok.bos_token_id, words[0], tok.bos_token_id, words[1], words[2], words[3], tok.bos_token_id,
           tok.eos_token_id]
    ids += [tok.pad_token_id] * (tok.model_max_length - len(ids))
    with torch.no_grad():
        scale = float(te.get_input_embeddings().weight.std() / te(torch.tensor([ids]))[0].std())
    assert algo.space_scale == pytest.approx(scale, rel=1e-5)
    assert algo.concept_lr == pytest.approx(0.1 * scale) and algo.concept_sigma == pytest.approx(0.1 * scale)
    assert scale < 0.5  # token embeddings are much smaller than the layer-normed outputs
    from conftest import spy_concept_prompts

    seen = spy_concept_prompts(monkeypatch)
    upd = algo.client_update(0, {}, {}, 0)
    algo.synthesize(upd, 0)
    eta = torch.cat([S for S, _ in seen]) - upd.upload["fedbip"]["domain_concept"]
    assert eta.numel() >= 1000 and float(eta.std()) == pytest.approx(0.1 * scale, rel=0.1)
    out = _sim(fed, tmp_path, _cfg(ldm_dir, concept_space="output"), name="scale-out", num_rounds=1).algorithm
    assert out.space_scale == 1.0 and out.concept_lr == pytest.approx(0.1) and out.concept_sigma == pytest.approx(0.1)
    none = _sim(fed, tmp_path, _cfg(ldm_dir, concept_scale="none"), name="scale-none", num_rounds=1).algorithm
    assert none.concept_lr == pytest.approx(0.1) and none.concept_sigma == pytest.approx(0.1)


@pytest.mark.parametrize("level,trained", [("domain", "domain_concept"), ("class", "class_concepts")])
def test_s_only_and_v_only_keep_the_real_words_fixed(ldm_dir, fed, tmp_path, monkeypatch, level, trained):
    """The paper Table 3's "S only" / "V only": the client learns one part; the other is, exactly, the text encoder's token
    embedding of the real word(s) -- the digit names for S only, for V only the word the LDM's pool captions gave
    client 0's domain (USPS's public images: "handwritten"; its name "usps" is in no caption) -- both
    where the client trains (the fixed half it trains against, left unchanged) and where the server builds the
    prompt (the fixed half it inserts). The expected rows are read off the embedding table by token id here."""
    import hfpfl.fedbip.concepts as fb

    sim = _sim(fed, tmp_path, _cfg(ldm_dir, personalization=level, concept_steps=3, reuse_concepts=False),
               name=level, num_rounds=1)
    algo = sim.algorithm
    tok, table = algo.pipe.tokenizer, algo.pipe.text_encoder.get_input_embeddings().weight.detach()

    def word_row(w):
        ids = tok(w, add_special_tokens=False).input_ids
        assert len(ids) == 1, (w, ids)  # one whole token in the tiny LDM's vocabulary
        return table[ids[0]]

    assert sim.client(0).domain == "usps"
    words_S = word_row("handwritten")[None]  # (n_s = 1, d)
    digits = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    words_V = torch.stack([word_row(w) for w in digits])[:, None]  # (10, n_v = 1, d)

    trained_with = {}
    real_train = fb.train_concepts

    def spy_train(*a, **kw):
        res = real_train(*a, **kw)
        trained_with.update(kw, result=res)
        return res

    monkeypatch.setattr(fb, "train_concepts", spy_train)
    upd = algo.client_update(0, {}, {}, 0)
    up = upd.upload["fedbip"]
    assert set(up) == {"labels", trained}
    res = trained_with["result"]
    if level == "domain":  # S only: V fixed at the digit names, S learned and uploaded
        assert trained_with["train_class"] is False and trained_with["train_domain"] is True
        assert torch.equal(trained_with["init_class_concepts"], words_V)
        assert torch.equal(res.class_concepts, words_V)
        assert torch.equal(up["domain_concept"], res.domain_concept)
        assert not torch.equal(res.domain_concept, trained_with["init_domain_concept"])
    else:  # V only: S fixed at the domain's caption word, V learned and uploaded
        assert trained_with["train_domain"] is False and trained_with["train_class"] is True
        assert torch.equal(trained_with["init_domain_concept"], words_S)
        assert torch.equal(res.domain_concept, words_S)
        assert torch.equal(up["class_concepts"], res.class_concepts)
        assert not torch.equal(res.class_concepts, trained_with["init_class_concepts"])

    from conftest import spy_concept_prompts

    prompts = spy_concept_prompts(monkeypatch)
    _, labels = algo.synthesize(upd, 0)
    S_used = torch.cat([s.expand(len(v), -1, -1) for s, v in prompts])
    V_used = torch.cat([v for _, v in prompts])
    assert len(V_used) == len(labels) == 2 * len(up["labels"])
    if level == "domain":
        assert torch.equal(V_used, words_V[labels])
        assert not torch.equal(S_used, up["domain_concept"][None].expand_as(S_used))  # S^ = S + eta, perturbed
    else:
        assert torch.equal(S_used, words_S[None].expand_as(S_used))  # the real word, unperturbed
        assert torch.equal(V_used, up["class_concepts"][labels])


@pytest.mark.slow
def test_recipe_comparison_end_to_end(ldm_dir, tmp_path, capsys):
    """recipes/fedbip.py --all_variants: every row of the study fedbip_digits on the random LDM, each classifier
    trained exactly --classifier_steps steps (FedAvg / Local-only: rounds x local steps), the controls computed, the
    summary, claims and results page written by the study runner's own functions."""

    from hfpfl.experiments.studies.fedbip_digits import STUDY

    from conftest import load_script

    recipe = load_script("recipes/fedbip.py", "fedbip_recipe")
    out = tmp_path / "cmp"
    summary = recipe.main(["--ldm", ldm_dir, "--output_dir", str(out), "--max_per_domain", "80", "--image_size", "12",
                           "--test_fraction", "0.3", "--shots_per_class", "2", "--concept_steps", "2",
                           "--num_inference_steps", "2", "--classifier_steps", "6", "--baseline_rounds", "3",
                           "--all_variants", "true", "--progress", "false"])
    assert summary["order"] == [v.name for v in STUDY.variants]   # every row of the study, in its order
    rows = summary["variants"]
    for name, e in rows.items():   # matched budgets: 6 steps per trained classifier, none for the controls
        assert e["budget"]["optimizer_steps_per_model"] == (0 if e["control"] else 6), name
    assert [n for n, e in rows.items() if e["control"]] == ["chance", "majority", "untrained"]
    assert rows["chance"]["metrics"]["personal_accuracy"]["mean"] == pytest.approx(0.1)
    res = {n: json.loads((out / n / "results.json").read_text()) for n in rows if not rows[n]["control"]}
    assert res["fedbip_l"]["final"]["num_synthetic"] == 5 * res["fedbip_s"]["final"]["num_synthetic"] == 5 * 2 * 3 * 10 * 2
    # the paper Table 3's ablations are read at FedBiP-L's amount (its full row is Table 1's FedBiP-L)
    assert all(res[v]["final"]["num_synthetic"] == 10 * 3 * 10 * 2 for v in ("prompt_only", "v_only", "instance_only"))
    assert res["fedavg"]["num_rounds"] == 3 and res["fedavg"]["budget"]["optimizer_steps"] == 3 * 3 * 2
    # 6 batches of 32 over 120 synthetic images, the epoch's last batch 24: 32 + 32 + 32 + 24 + 32 + 32
    assert res["fedbip_s"]["budget"]["examples_seen"] == 184 and res["fedbip_s"]["budget"]["trained_models"] == 1
    # the style judge reads every synthetic set; real-data rows have none; every row has its MIA gap
    for v in ("prompt_only", "instance_only", "fedbip_l"):
        assert 0 <= rows[v]["metrics"]["synthetic_style"]["mean"] <= 1
    assert "synthetic_style" not in rows["fedavg"]["metrics"] and "synthetic_style" not in rows["central"]["metrics"]
    assert all("mia_loss_gap" in rows[n]["metrics"] for n in res)
    assert {c["claim"] for c in summary["claims"]} == {c.text() for c in STUDY.claims}
    assert all(c["verdict"] in ("held", "not held") for c in summary["claims"])
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summary))
    assert (out / "results.md").read_text().startswith("# FedBiP") and (out / "fedbip_s" / "synthetic_grid.png").exists()
    printed = capsys.readouterr().out
    assert "FedBiP-L (10x)" in printed and "[control]" in printed and "paper's ordering" in printed


@pytest.mark.slow
def test_noise_sweep_runs_instance_only_at_each_timestep_and_chooses_by_the_rule(ldm_dir, tmp_path, capsys):
    """scripts/fedbip_noise_sweep.py: one instance-only run per timestep (clients noise there, the sampler starts
    there), its style / closeness read off the synthetic set, the choice by hfpfl.fedbip.sweep's rule on what was
    recorded; a finished sweep is not overwritten without --overwrite_output_dir."""

    import yaml

    from hfpfl.fedbip.sweep import choose_noise_timestep

    from conftest import load_script

    script = load_script("scripts/fedbip_noise_sweep.py", "fedbip_noise_sweep")
    out = tmp_path / "sweep"
    argv = ["--timesteps", "401,901", "--variant", "instance_only", "--output_dir", str(out), "--ldm", ldm_dir,
            "--max_per_domain", "80", "--image_size", "12", "--test_fraction", "0.3", "--shots_per_class", "2",
            "--concept_steps", "2",
            "--num_inference_steps", "10", "--classifier_steps", "2", "--progress", "false"]
    rows, floor, chosen = script.main(argv)
    assert [r["timestep"] for r in rows] == [901, 401]
    for r in rows:
        cfg = yaml.safe_load((out / f"t{r['timestep']}" / "instance_only" / "config.yaml").read_text())
        assert str(cfg["noise_timestep"]) == str(r["timestep"])
        assert 0 <= r["style"] <= 1
    assert floor > 0 and chosen == choose_noise_timestep(rows, floor)
    saved = json.loads((out / "sweep.json").read_text())
    assert saved["floor"] == floor and saved["chosen"] == (chosen["timestep"] if chosen else None)
    assert (out / "sweep.png").stat().st_size > 0
    assert "choice:" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        script.main(argv)
    assert e.value.code == 2 and "--overwrite_output_dir" in capsys.readouterr().err


def test_one_seed_in_seeds_is_the_run_seed(ldm_dir, tmp_path):
    """``--seeds 1`` alone: every row runs with seed 1 (not only the few-shot draw), in output_dir itself."""
    from hfpfl.experiments import fedbip_compare as compare

    out = tmp_path / "one"
    summary = compare.main(["--ldm", ldm_dir, "--output_dir", str(out), "--max_per_domain", "80", "--image_size",
                            "12", "--test_fraction", "0.3", "--shots_per_class", "2", "--classifier_steps", "1",
                            "--baseline_rounds", "1", "--progress", "false", "--seeds", "1", "--variants", "fedavg"])
    assert summary["seeds"] == [1] and summary["variants"]["fedavg"]["seeds"] == [1]
    assert json.loads((out / "fedavg" / "results.json").read_text())["seed"] == 1


def test_bad_seeds_name_the_option(tmp_path):
    from hfpfl.experiments import fedbip_compare as compare

    with pytest.raises(ValueError, match=r"--seeds must be comma-separated whole numbers in \[0, 2\*\*32\), each once, e\.g\. 0,1,2, got '1,x'"):
        compare.parse(["--seeds", "1,x", "--output_dir", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_interrupted_comparison_leaves_no_unfinished_variant_folder(ldm_dir, tmp_path, monkeypatch):
    """A comparison killed (SIGINT/SIGTERM) in a row removes that row's folder (it had config.yaml but no
    results.json); finished variants keep theirs; a comparison killed in its first variant leaves no output folder."""
    from pathlib import Path

    from hfpfl.federated.engine import Simulation
    from hfpfl.experiments import fedbip_compare as compare

    real_run = Simulation.run

    def run_then_kill(self, *a, **k):
        if Path(self.output_dir).name == kill_in:
            self.setup()  # the variant has started: its folder holds config.yaml
            assert (Path(self.output_dir) / "config.yaml").exists()
            raise KeyboardInterrupt
        return real_run(self, *a, **k)

    monkeypatch.setattr(Simulation, "run", run_then_kill)
    argv = ["--ldm", ldm_dir, "--max_per_domain", "80", "--image_size", "12", "--test_fraction", "0.3",
            "--shots_per_class", "2", "--concept_steps", "2", "--num_inference_steps", "2", "--classifier_steps", "1",
            "--baseline_rounds", "1", "--progress", "false"]
    kill_in, out = "prompt_only", tmp_path / "first"
    with pytest.raises(SystemExit) as e:
        compare.main(argv + ["--output_dir", str(out)])
    assert e.value.code == 130 and not out.exists()

    kill_in, out = "fedbip_l", tmp_path / "second"
    with pytest.raises(SystemExit) as e:
        compare.main(argv + ["--output_dir", str(out)])
    assert e.value.code == 130
    assert sorted(p.name for p in out.iterdir()) == ["prompt_only"]
    assert (out / "prompt_only" / "results.json").exists()


@pytest.mark.slow
def test_comparison_in_two_processes_gives_the_one_process_rows(ldm_dir, tmp_path):
    """``recipes/fedbip.py --num_processes 2``: the rows run in two forked processes (each synthesises the
    clients it holds); the table is printed once and every number equals the one-process run's, the
    membership-inference gap of Local-only (whose models are private states, each on one process) included."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "ACCELERATE_MIXED_PRECISION"):
        env.pop(k, None)
    rows, printed = {}, {}
    for n in ("1", "2"):
        out = tmp_path / n
        proc = subprocess.run(
            [sys.executable, str(root / "recipes" / "fedbip.py"), "--ldm", ldm_dir, "--output_dir", str(out),
             "--max_per_domain", "80", "--image_size", "12", "--test_fraction", "0.3", "--shots_per_class", "2",
             "--concept_steps", "2", "--num_inference_steps", "2", "--classifier_steps", "2", "--baseline_rounds", "2",
             "--variants", "prompt_only,fedbip_s,local,central", "--progress", "false", "--num_processes", n],
            env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        rows[n] = {k: summary["variants"][k]["metrics"] for k in summary["order"]}
        printed[n] = proc.stdout
    assert list(rows["2"]) == ["prompt_only", "fedbip_s", "local", "central"]
    assert rows["1"] == rows["2"]
    local = {k: m["mean"] for k, m in rows["2"]["local"].items()}
    # its own trained models score their members: lower loss than on non-members
    assert local["member_loss"] < local["nonmember_loss"] and local["mia_loss_gap"] > 0
    two = json.loads((tmp_path / "2" / "fedbip_s" / "results.json").read_text())
    assert two["final"]["num_synthetic"] == 2 * 3 * 10 * 2
    assert all(p.count("wall time") == 1 for p in printed.values())  # the main process reports, once
    assert two["world_size"] == 2  # and both processes held clients, so both received (synthesised) uploads
    assert len(two["process_train_examples"]) == 2 and min(two["process_train_examples"]) > 0


def test_comparison_decides_its_processes_on_one_round_variants(ldm_dir, tmp_path, monkeypatch, capsys):
    """``--num_processes auto`` for the comparison weighs what a FedBiP variant runs: 3 clients x 1 round x update cost
    100 (one-shot), not the run's ``--num_rounds``; the one line it prints says so."""
    import hfpfl.cli as cli
    from hfpfl import launch
    from hfpfl.experiments import fedbip_compare as compare

    for k in ("LOCAL_RANK", "HFPFL_NUM_PROCESSES", *launch._ACCELERATE_LAUNCH_VARS):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(launch, "machine", lambda measure_busy=True: {"cores": 2, "busy": 0.0, "gpus": 0})

    class Decided(Exception):
        pass

    def stop(n, workers, output_dir):
        raise Decided(n)

    monkeypatch.setattr(cli, "start_processes", stop)
    import sys
    monkeypatch.setattr(sys, "argv", ["recipes/fedbip.py", "--ldm", ldm_dir, "--output_dir", str(tmp_path / "out"),
                                      "--variants", "prompt_only", "--num_rounds", "7"])
    with pytest.raises(Decided) as e:
        compare._main(None, {}, [])  # as the recipe script runs it (top level: it may start processes)
    assert e.value.args == (2,)
    assert "2 idle cores (2 usable, 0.00 busy), 3 clients x 1 rounds x 100 (update cost)" in capsys.readouterr().out


def test_the_budget_is_the_server_classifiers_steps(full_run, ldm_dir, fed, tmp_path, monkeypatch):
    """What a study matches rows by: the classifier trained on the server. One epoch (classifier_epochs 1) over the
    2x synthetic set, 2 x 60 = 120 images in batches of 16: 7 full batches and one of 8; two epochs twice that;
    --classifier_steps 3: three batches of 16, whatever the set's size."""
    _, res, _, _ = full_run
    assert res["budget"]["trained_models"] == 1
    assert res["budget"]["optimizer_steps_per_model"] == 8 and res["budget"]["examples_seen_per_model"] == 120
    for kw, steps, examples in ((dict(classifier_epochs=2), 16, 240),   # not the run's --local_epochs (1)
                                (dict(classifier_steps=3), 3, 3 * 16)):
        sim = _sim(fed, tmp_path, _cfg(ldm_dir, save_grid=False, privacy_metrics=False, **kw), name=str(kw),
                   num_rounds=1)
        calls, real = [], sim.generator
        monkeypatch.setattr(sim, "generator", lambda r, c, tag="": calls.append((r, c, tag)) or real(r, c, tag))
        b = sim.run()["budget"]
        assert (b["optimizer_steps"], b["examples_seen"]) == (steps, examples), kw
        # the classifier's batch order: the server's own stream (client -1), named for it (reproducibility contract)
        assert calls.count((1, -1, "fedbip-classifier")) == 1   # round 1, the one round
        assert not (tmp_path / str(kw) / "synthetic_grid.png").exists()   # save_grid=False writes none


@pytest.mark.slow
def test_the_main_jobs_rows_are_the_study_runners_rows(ldm_dir, tmp_path):
    """recipes/fedbip.py runs the study fedbip_digits's rows in its own loop (so that they can spread over several
    processes): at the same settings each row is the number ``python -m hfpfl.experiments run`` stores."""
    import dataclasses

    from hfpfl.experiments import controls, runner
    from hfpfl.experiments.studies.fedbip_digits import CENTRAL, FEDAVG, STUDY
    from hfpfl.experiments import fedbip_compare as compare

    small = ["--max_per_domain", "80", "--image_size", "12", "--test_fraction", "0.3", "--shots_per_class", "2"]
    mine = compare.main(["--ldm", ldm_dir, *small, "--classifier_steps", "4", "--baseline_rounds", "2", "--variants",
                         "fedavg,central,majority", "--output_dir", str(tmp_path / "job"), "--progress", "false",
                         "--num_processes", "1"])
    study = dataclasses.replace(
        STUDY, name="fedbip_small", seeds=(0,), common=(*STUDY.common, *small), claims=(), paper_ordering=(),
        variants=(dataclasses.replace(FEDAVG, argv=("--method", "fedavg", "--num_rounds", "2", "--local_steps", "2")),
                  dataclasses.replace(CENTRAL, argv=("--method", "central", "--steps", "4", "--num_rounds", "1")),
                  controls.majority()))
    theirs = runner.run_study(study, tmp_path / "store", work_dir=tmp_path / "work", log=lambda *a: None)
    for name in ("fedavg", "central", "majority"):
        for m in ("personal_accuracy", "global_accuracy"):
            assert mine["variants"][name]["metrics"][m]["values"] == theirs["variants"][name]["metrics"][m]["values"]
        assert (mine["variants"][name]["budget"]["optimizer_steps_per_model"]
                == theirs["variants"][name]["budget"]["optimizer_steps_per_model"] == (0 if name == "majority" else 4))


def test_prompts_name_a_digits_domain_by_the_word_the_ldm_learnt_it_with():
    """The real-word prompts' [STY]: the first caption word of the domain's public images in the tiny LDM's pool
    (hfpfl.fedbip.pool.STYLE_WORDS), another domain by its own name, a mixed client by none."""
    from hfpfl.fedbip.pool import caption_word

    assert [caption_word(d) for d in ("usps", "mnistm", "syn", "mnist")] == ["handwritten", "textured", "printed",
                                                                             "handwritten"]
    assert caption_word("clipart") == "clipart" and caption_word(None) is None


def test_the_main_jobs_defaults_are_the_studys_settings():
    """recipes/fedbip.py with no option runs the study fedbip_digits's rows at the study's own settings: the data,
    the FedBiP options and the classifier recipe parse to the same values."""
    from hfpfl.arguments import parse_run_args
    from hfpfl.experiments.studies.fedbip_digits import FEDBIP_L, STUDY
    from hfpfl.experiments import fedbip_compare as compare

    run_s, data_s, cfg_s = parse_run_args([*STUDY.common, *FEDBIP_L.argv, "--seed", "0"])
    run_m, data_m, cfg_m, _ = compare.parse([])
    assert data_m == data_s and cfg_m == cfg_s
    for k in ("method", "model", "optimizer", "lr", "momentum", "weight_decay", "batch_size", "seed"):
        assert getattr(run_m, k) == getattr(run_s, k), k
    assert set(compare.FEDBIP_ROWS) == {v.name for v in STUDY.variants if "fedbip" in v.argv}


def test_given_domain_and_class_words_reach_the_prompts(ldm_dir, fed, tmp_path):
    """--domain_words: one word per client (client i gets word i) or one for every client; --class_words: one per
    class, in label order."""
    classes = ["o", "i", "ii", "iii", "iv", "v", "vi", "vii", "viii", "ix"]
    cfg = _cfg(ldm_dir, domain_words="bold, thin ,noisy", class_words=",".join(classes))
    algo = _sim(fed, tmp_path, cfg, name="words", num_rounds=1).algorithm
    assert [algo.words(c) for c in range(3)] == [("bold", classes), ("thin", classes), ("noisy", classes)]
    one = _sim(fed, tmp_path, _cfg(ldm_dir, domain_words="photo"), name="word", num_rounds=1).algorithm
    assert [one.words(c)[0] for c in range(3)] == ["photo"] * 3 and one.words(0)[1][7] == "seven"


def test_aggregate_called_directly_synthesises_what_the_engine_received(full_run):
    """aggregate on uploads the engine never ``receive``d (direct use, e.g. a notebook) synthesises each client's
    set itself: the same images as the run's, which were synthesised as each upload arrived."""
    import dataclasses as dc

    sim, _, _, _ = full_run
    engine_images = sim.algorithm.synthetic["images"].clone()
    fresh = [dc.replace(u, received={}) for u in sim.last_updates]
    sim.algorithm.config.save_grid = False
    try:
        sim.algorithm.aggregate(sim.server_state, fresh, 1)   # the run's one round
    finally:
        sim.algorithm.config.save_grid = True
    assert all("synthetic" in u.received for u in fresh)
    assert torch.equal(sim.algorithm.synthetic["images"], engine_images)
