"""FedPop over any method: each method declares the server and client hyperparameters its update reads
(``Algorithm.uses_server_hparams`` / ``uses_client_hparams``); the tuner refuses a search space naming another,
drops the ignored ones from the default space, and tunes a method's own options (``method:`` section) per member.
Tiny MLP (or the method's own tiny model) on 8x8 USPS-like digits, population 2, 2 rounds, 1 local step."""
import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch
import yaml

from hfpfl.algorithms import REGISTRY, get_algorithm, load_builtin_methods
from hfpfl.tuning import SuccessiveHalving, Tuner, TunerArguments
from hfpfl.tuning import search_space as ss

ALL_SERVER = {"server_lr", "server_momentum", "server_lr_decay"}
ALL_CLIENT = {"lr", "momentum", "weight_decay", "local_epochs", "batch_size", "dropout"}

# a space whose runs do not diverge at toy scale
SAFE = {"server": {"server_lr": {"type": "log10", "low": -0.5, "high": 0.0},
                   "server_momentum": {"type": "uniform", "low": 0.0, "high": 0.5},
                   "server_lr_decay": {"type": "log10_one_minus", "low": -4, "high": -2}},
        "client": {"lr": {"type": "log10", "low": -2.5, "high": -1.5},
                   "momentum": {"type": "uniform", "low": 0.0, "high": 0.5},
                   "weight_decay": {"type": "log10", "low": -5, "high": -3},
                   "local_epochs": {"type": "choice", "values": [1, 2]},
                   "batch_size": {"type": "choice", "values": [16, 32]},
                   "dropout": {"type": "uniform", "low": 0.0, "high": 0.3}}}


@pytest.fixture(scope="module")
def tiny_fed():
    from hfpfl.data import DataArguments, build_federated_dataset

    da = DataArguments(dataset="usps", partition="dirichlet", num_clients=4, alpha=0.5, max_per_domain=100,
                       image_size=8, val_fraction=0.2)
    return da, build_federated_dataset(da, seed=0)


@pytest.fixture(scope="module")
def fed16():
    """The same federation at 16x16 (the CondNorm ResNets' BatchNorm needs more than one pixel at the end)."""
    from hfpfl.data import DataArguments, build_federated_dataset

    da = DataArguments(dataset="usps", partition="dirichlet", num_clients=4, alpha=0.5, max_per_domain=100,
                       image_size=16, val_fraction=0.2)
    return da, build_federated_dataset(da, seed=0)


def _space_file(tmp_path, space, name="space.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(space))
    return str(p)


@pytest.fixture
def make_tuner(tiny_fed, tmp_path):
    from hfpfl.config import RunArguments

    da, fed = tiny_fed

    def _make(method="fedavg", space=None, method_config=None, run_kw=None, data=None, **tkw):
        run_kw = {"model": "tiny-mlp", **(run_kw or {})}
        d_args, d_fed = data or (da, fed)
        ra = RunArguments(method=method, output_dir=str(tmp_path / method), clients_per_round=2, progress=False,
                          local_steps=1, **run_kw)
        kw = dict(population_size=2, rounds_per_member=2, generation_rounds=1, final_finetune_epochs=0)
        kw.update(tkw)
        targs = TunerArguments(**kw)
        if space is not None:
            targs.search_space = _space_file(tmp_path, space, f"{method}_space.yaml")
        cfg = method_config if method_config is not None else get_algorithm(method).Config()
        return Tuner(ra, d_args, cfg, targs, fed_data=d_fed)

    return _make


# ------------------------------------------------------------------------------------------ declarations
def test_declarations_of_the_methods_that_bypass_the_fedopt_step():
    """What each method's code reads (checked by hand against its reduce/aggregate and local training): FedNova,
    PerAda, FedBasis, Local-only, FedProto (prototypes only), Central, FedBiP and the one-shot methods (FGL, FedDEO,
    DENSE, FedD3, the VQA central fine-tuning) apply no FedOpt step; DENSE's clients train with the run's settings,
    FedD3's distil with their own config, FGL/FedDEO as FedBiP; SCAFFOLD's server reads eta_g only and its
    option II needs momentum = weight decay = 0; FedBasis and FedRep run their own epochs; the VQA methods use AdamW
    (no momentum); everything else reads all of them."""
    load_builtin_methods()
    no_server = {"fednova", "perada", "fedbasis", "local", "central", "fedbip", "vqa_adapter_local", "fedproto",
                 "fgl", "feddeo", "dense", "fedd3", "vqa_central"}
    for name, cls in REGISTRY.items():
        if not _builtin(name):
            continue
        want = set() if name in no_server else {"server_lr"} if name == "scaffold" else ALL_SERVER
        assert set(cls.uses_server_hparams) == want, name
    client = {n: set(REGISTRY[n].uses_client_hparams) for n in REGISTRY if _builtin(n)}
    assert client["scaffold"] == ALL_CLIENT - {"momentum", "weight_decay"}
    assert client["fedbasis"] == client["fedrep"] == ALL_CLIENT - {"local_epochs"}
    assert client["central"] == client["fedbip"] == client["fgl"] == client["feddeo"] == client["fedd3"] == set()
    assert all(client[n] == ALL_CLIENT - {"momentum"} for n in ("feddat", "vqa_peft", "vqa_adapter",
                                                               "vqa_adapter_local", "vqa_central"))
    assert all(client[n] == ALL_CLIENT for n in ("fedavg", "fedprox", "ditto", "fednova", "fedbn", "fedper",
                                                 "fedavg_ft", "feddf", "fraug", "fedpce", "perada", "local",
                                                 "fedbabu", "fedproto", "dense"))


@pytest.mark.parametrize("method", ["fedavg", "fedprox", "ditto", "fedbn", "fedavg_ft", "scaffold", "fednova", "local"])
def test_a_declared_server_hparam_changes_the_state_and_an_undeclared_one_does_not(run_sim, method):
    """The declarations are true of the code: two rounds with each server hyperparameter moved off its default,
    one at a time, give another global model exactly when the method declares it (FedNova, Local: none;
    SCAFFOLD: server_lr only; the FedOpt methods: all three)."""
    from hfpfl.tuning.models import method_with_model

    declared = get_algorithm(method).uses_server_hparams

    name = method_with_model(method, "tiny-mlp")
    base = dict(num_rounds=2, clients_per_round=2, local_steps=1, momentum=0.0, new_client_epochs=0)

    def two_rounds(tag, **kw):
        sim, _ = run_sim(name, run=False, output_dir=f"{method}-{tag}", **{**base, **kw})
        sim.step()
        sim.step()
        return sim.server_state["model"]

    a = two_rounds("ref")
    for hp, v in (("server_lr", 0.5), ("server_momentum", 0.5), ("server_lr_decay", 0.5)):
        b = two_rounds(hp, **{hp: v})
        same = all(torch.equal(a[k], b[k]) for k in a)
        assert same == (hp not in declared), (method, hp)


# ------------------------------------------------------------------------------------------ refusal
def _recipe():

    from conftest import load_script

    return load_script("recipes/fedpop.py", "fedpop_recipe")


def test_a_search_space_naming_an_ignored_hparam_is_refused_in_one_line(tmp_path, capsys):
    """recipes/fedpop.py --method fednova with server_momentum in the file: exit 2, one line naming the
    hyperparameter, the method and the fix; no output folder is created."""
    recipe = _recipe()
    space = {"server": {"server_momentum": {"type": "uniform", "low": 0.0, "high": 0.9}},
             "client": {"lr": {"type": "log10", "low": -2, "high": -1}}}
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        recipe.main(["--method", "fednova", "--search_space", _space_file(tmp_path, space), "--output_dir", str(out),
                     "--population_size", "2", "--rounds_per_member", "1", "--num_clients", "4"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "'server_momentum'" in err[0] and "'fednova'" in err[0] and "remove it from the server: section" in err[0]
    assert not out.exists()


@pytest.mark.parametrize("tuner", ["sha", "fedpop_sha", "fedex_sha"])
def test_an_sha_budget_too_small_for_its_stages_is_refused_in_one_line(tmp_path, capsys, tuner):
    """--sha_start 4 --sha_eta 2 trains 4 configurations then 2, at least one round each (6 rounds); a budget of
    2 x 2 = 4 rounds cannot hold them: exit 2, one line naming the options and the fix, no output folder. With
    --rounds_per_member 3 (budget 6) the schedule fits exactly."""
    recipe = _recipe()
    out = tmp_path / "out"
    argv = ["--tuner", tuner, "--sha_start", "4", "--sha_eta", "2", "--population_size", "2", "--num_clients", "4",
            "--output_dir", str(out)]
    with pytest.raises(SystemExit) as e:
        recipe.main([*argv, "--rounds_per_member", "2"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "--sha_start 4 needs 6 rounds" in err[0] and "is 4" in err[0] and "raise --rounds_per_member" in err[0]
    assert not out.exists()
    targs = TunerArguments(tuner=tuner, sha_start=4, sha_eta=2, population_size=2, rounds_per_member=3)
    assert SuccessiveHalving.sha_schedule(SimpleNamespace(t=targs, budget=6)) == [(4, 1), (2, 1)]   # 4 + 2 = 6 <= 6


def test_recipe_runs_fedpop_over_scaffold_with_the_default_space(tmp_path):
    """recipes/fedpop.py --method scaffold with the default space and no --momentum: the space loses what SCAFFOLD
    does not read and the recipe defaults momentum / weight decay to 0 for it, so the run finishes (it used to stop
    with SCAFFOLD's plain-SGD ValueError on a sampled momentum)."""
    recipe = _recipe()
    res = recipe.main(["--method", "scaffold", "--output_dir", str(tmp_path / "o"), "--population_size", "2",
                       "--rounds_per_member", "1", "--num_clients", "4", "--clients_per_round", "2",
                       "--local_steps", "1", "--max_per_domain", "100", "--final_finetune_epochs", "0"])
    assert res["budget"]["rounds_used"] == 2
    assert set(res["best_member"]["alpha"]) == {"server_lr"}
    assert set(res["best_member"]["beta0"]) == {"lr", "local_epochs", "batch_size", "dropout"}


def test_scaffold_client_momentum_in_a_file_is_refused_and_dropped_from_the_default(caplog):
    """SCAFFOLD (option II: plain SGD): client momentum named in a file is refused; the default space loses
    momentum, weight decay and the two server hyperparameters it never reads, and says so in one log line."""
    cls = get_algorithm("scaffold")
    user = ss.SearchSpace({"client": {"momentum": {"type": "uniform", "low": 0.0, "high": 0.9}}})
    with pytest.raises(ValueError, match=r"client hyperparameter 'momentum' has no effect on method 'scaffold'"):
        user.fit_method(cls, cls.Config())
    default = ss.SearchSpace()
    with caplog.at_level(logging.INFO, logger="hfpfl"):
        dropped = default.fit_method(cls, cls.Config())
    assert set(default.server) == {"server_lr"}
    assert set(default.client) == {"lr", "local_epochs", "batch_size", "dropout"}
    assert set(dropped) == {"server_momentum", "server_lr_decay", "momentum", "weight_decay"}
    lines = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(lines) == 1 and "scaffold" in lines[0]


def test_adam_has_no_momentum_and_a_model_without_dropout_has_no_dropout():
    cls = get_algorithm("fedavg")
    default = ss.SearchSpace()
    default.fit_method(cls, cls.Config(), optimizer="adam", has_dropout=False)
    assert set(default.client) == ALL_CLIENT - {"momentum", "dropout"}
    with pytest.raises(ValueError, match="--optimizer adam has no momentum"):
        ss.SearchSpace({"client": {"momentum": {"type": "uniform", "low": 0, "high": 0.5}}}).fit_method(
            cls, cls.Config(), optimizer="adam")


# ------------------------------------------------------------------------------------------ method hyperparameters
def test_unknown_method_hparams_are_refused_with_did_you_mean():
    fedprox = get_algorithm("fedprox")
    with pytest.raises(ValueError, match=r"'mu_' is not an option of method 'fedprox'; did you mean 'mu'\?"):
        ss.SearchSpace({"method": {"mu_": {"type": "log10", "low": -3, "high": 0}}}).fit_method(
            fedprox, fedprox.Config())
    ditto = get_algorithm("ditto")
    with pytest.raises(ValueError, match="is an integer"):   # personal_epochs: only a choice keeps it an int
        ss.SearchSpace({"method": {"personal_epochs": {"type": "uniform", "low": 1, "high": 3}}}).fit_method(
            ditto, ditto.Config())
    with pytest.raises(ValueError, match="goes in a method: section"):
        ss.SearchSpace({"client": {"lam": {"type": "uniform", "low": 0, "high": 1}}})
    ss.SearchSpace({"method": {"lam": {"type": "uniform", "low": 0, "high": 1}}}).fit_method(ditto, ditto.Config())


def test_fedprox_mu_in_the_search_space_is_the_mu_each_member_trains_with(make_tuner, monkeypatch):
    """method: {mu: log10 U[-3, 0]}: each member's FedProx computes its proximal term with mu = 10^u of its own
    coordinate u (recorded at the call the method makes), members differ, and a FedPop-G exploit gives the replaced
    member the Evo-perturbed mu of its donor, which its next round then uses."""
    from hfpfl.algorithms import fedprox

    seen = []
    real = fedprox.proximal_term

    def spy(model, anchor, coef):
        seen.append(coef)
        return real(model, anchor, coef)

    monkeypatch.setattr(fedprox, "proximal_term", spy)
    space = {**SAFE, "method": {"mu": {"type": "log10", "low": -3.0, "high": 0.0}}}
    tuner = make_tuner("fedprox", space=space, population_size=3, rounds_per_member=2, generation_rounds=1,
                       eps0=0.5, p_re0=0.0, rho=3)
    mus = [10.0 ** m.mhp["mu"] for m in tuner.members]
    assert all(1e-3 <= mu <= 1.0 for mu in mus) and len(set(mus)) == 3
    for m, mu in zip(tuner.members, mus):
        seen.clear()
        tuner.member_round(m)
        assert seen and all(c == pytest.approx(mu, rel=1e-12) for c in seen), (seen, mu)
        assert m.sim.algorithm.config.mu == pytest.approx(mu, rel=1e-12)
    tuner.round = 1
    before = {m.idx: m.mhp["mu"] for m in tuner.members}
    events = tuner.fedpop_g(1)
    assert events
    for e in events:
        dst = next(m for m in tuner.members if m.idx == e["dst"])
        u_src, u_dst = before[e["src"]], dst.mhp["mu"]
        # Evo (Eq. 3): within eps0 * width of the donor's coordinate; eps at r = 1 of R_c = 2 is eps0 / 2
        assert abs(u_dst - u_src) <= 0.25 * 3.0 + 1e-12 and u_dst != u_src
        seen.clear()
        tuner.member_round(dst)
        assert seen and all(c == pytest.approx(10.0 ** u_dst, rel=1e-12) for c in seen)


# ------------------------------------------------------------------------------------------ every method
SKIP = {"fedbip": "needs the latent diffusion model (LDM) and its synthesis; not a small-digits classifier run",
        "feddat": "VQA: needs the VQA data and a vision-language model",
        "vqa_peft": "VQA: needs the VQA data and a vision-language model",
        "vqa_adapter": "VQA: needs the VQA data and a vision-language model",
        "vqa_adapter_local": "VQA: needs the VQA data and a vision-language model",
        "vqa_central": "VQA: needs the VQA data and a vision-language model"}
# methods that build their own model (--model tiny-mlp would replace it) or need a classifier head (FedPer/FedRep
# personalise "classifier.*", FedBABU keeps it at init, FedProto reads the embedding before it); the CondNorm ResNets need more than 8x8 pixels: 16x16 small digits
OWN_MODEL = {"fedbasis", "fedpce", "pce_fedavg", "pce_fedprox", "pce_fedbn", "pce_fedper", "fraug", "fedper", "fedrep",
             "fedbabu", "fedproto"}
SIXTEEN = OWN_MODEL - {"fraug"}


def _builtin(name: str) -> bool:
    """hfpfl's own methods: not a method+model variant the tuner registers, nor one another test module registered."""
    return "+" not in name and REGISTRY[name].__module__.startswith("hfpfl.")


def _all_methods():
    load_builtin_methods()
    return sorted(n for n in REGISTRY if _builtin(n))


@pytest.mark.slow   # about a minute over the ~27 methods on the shared 2-core box (2-5 s each)
@pytest.mark.parametrize("method", _all_methods())
def test_fedpop_runs_two_rounds_over_every_classification_method(make_tuner, method, request):
    """FedPop (default search space, fitted to the method) over each registered method: 2 rounds x 2 members,
    finite scores, and the tuned vectors hold exactly the hyperparameters the method declares."""
    if method in SKIP:
        pytest.skip(SKIP[method])
    run_kw, cfg, data = {}, None, None
    if method in OWN_MODEL:
        run_kw["model"] = "tiny-resnet"
    if method in SIXTEEN:
        data = request.getfixturevalue("fed16")
    if method == "scaffold":
        run_kw["momentum"] = 0.0    # option II: plain SGD (recipes/fedpop.py defaults it to 0 for SCAFFOLD)
    if method == "perada":
        run_kw.update(model=request.getfixturevalue("pretrained_backbone"), adapter="residual")
        cfg = get_algorithm("perada").Config(kd_steps=1, kd_pool_size=8, kd_batch_size=4)
    if method == "feddf":
        cfg = get_algorithm("feddf").Config(kd_steps=1, kd_pool_size=8, kd_batch_size=4)
    if method == "central":
        cfg = get_algorithm("central").Config(epochs=1)
    if method == "dense":
        cfg = get_algorithm("dense").Config(classifier_steps=2, generator_width=8, z_dim=16)
    if method in ("fgl", "feddeo"):   # the smallest synthesis: what is tested is the tuner around it
        cfg = get_algorithm(method).Config(multiplier=1, concept_steps=1, num_inference_steps=2)
    tuner = make_tuner(method, method_config=cfg, run_kw=run_kw, data=data)
    cls = get_algorithm(method)
    assert set(tuner.space.server) == set(cls.uses_server_hparams)
    assert set(tuner.space.client) <= set(cls.uses_client_hparams)
    res = tuner.run()
    assert res["budget"]["rounds_used"] == 4
    for row in res["members"]:
        assert row["alive"] and len(row["curve"]) == 2
        assert all(0 < loss < 1e6 for _, loss in row["curve"])
        assert set(row["alpha"]) == set(cls.uses_server_hparams)
        assert set(row["beta0"]) <= set(cls.uses_client_hparams)


def test_fitted_space_round_trips_through_resume_fingerprint(make_tuner):
    """The method section is part of the saved space (a resume with another method space is refused)."""
    space = {**SAFE, "method": {"mu": {"type": "log10", "low": -3.0, "high": 0.0}}}
    tuner = make_tuner("fedprox", space=space)
    d = tuner.space.to_dict()
    assert d["method"] == {"mu": {"type": "log10", "low": -3.0, "high": 0.0}}
    assert dataclasses.asdict(tuner.method_config)["mu"] == 0.01   # the run's own config is left untouched
