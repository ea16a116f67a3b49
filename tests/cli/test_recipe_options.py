"""Every recipe's own options go through hfpfl's one parser: listed by --help, read from --config files, recorded in
config.yaml and the resume fingerprint, checked where they are declared. A bad value is one line on stderr
(``error: ...`` naming the option), exit code 2, and nothing written."""
import dataclasses
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def recipe(name):
    """recipes/<name>.py as a module (its main(argv) runs in this process)."""
    from conftest import load_script

    return load_script(f"recipes/{name}.py", f"_recipe_options_{name}")


# (recipe, argv, what the one error line must contain): at least one case per recipe in recipes/
BAD = [
    ("run", ["--method", "fedavgg"], "unknown method 'fedavgg'. Did you mean 'fedavg'?"),
    ("fedavg", ["--num_rounds", "0"], "--num_rounds must be >= 1"),
    ("fedadapter", ["--adapter", "foo"], "--adapter must be one of"),
    ("perada", ["--lora_r", "0"], "--lora_r must be >= 1"),
    ("fraug", ["--lr", "-1"], "--lr must be > 0"),
    ("fedbasis", ["--num_new_clients", "-1"], "--num_new_clients must be >= 0"),
    ("fedpce", ["--new_client_budget", "0"], "--new_client_budget must be >= 1"),
    ("fedpce", ["--benchmark", "lodoo"], "--benchmark: invalid choice: 'lodoo'"),
    ("fedpce", ["--held_out_domain", "svhn"], "--held_out_domain"),
    ("fedpce", ["--levels", "strong"], "--levels: invalid choice"),
    ("fedpce", ["--groups", "noise,blur"], "--groups must be comma-separated groups from noise, color, rotation, "
                                           "imbalance"),
    ("fedpce", ["--new_client_test_size", "0"], "--new_client_test_size must be >= 1"),
    ("feddat", ["--backbone", "clip"], "--backbone: invalid choice: 'clip'"),
    ("feddat", ["--vqa_split", "color"], "--vqa_split"),
    ("feddat", ["--train_per_client", "5"], "--train_per_client must be >= 20"),
    ("feddat", ["--test_per_client", "abc"], "--test_per_client"),
    ("fedpop", ["--method", "fedavgg"], "Did you mean 'fedavg'?"),
    ("fedpop", ["--population_size", "0"], "--population_size must be >= 1"),
    ("fedpop", ["--tuner", "grid"], "--tuner: invalid choice: 'grid'"),
    ("fedpop", ["--sha_eta", "1"], "--sha_eta must be >= 2"),
    ("fedpop", ["--p_re0", "1.5"], "--p_re0 must be in [0, 1]"),
    ("fedbip", ["--seeds", "-1"], "--seeds must be comma-separated whole numbers"),
    ("fedbip", ["--seeds", "0,x"], "--seeds must be"),
    ("fedbip", ["--compare", "false", "--variants", "prompt_only"], "--variants shapes the comparison, which "
                                                                    "--compare false does not run; pass --compare true"),
    ("fedbip", ["--compare", "false", "--seeds", "0,1"], "--seeds shapes the comparison"),
    ("fedbip", ["--domain_words", "a,b"], "--domain_words has 2 words for 3 clients"),
    ("fedbip", ["--domain_words", "a,,b"], "--domain_words must be"),
    ("fedbip", ["--class_words", "zero,one"], "--class_words has 2 words but the data has 10 classes"),
    ("fedbip", ["--shots_per_class", "0"], "--shots_per_class must be >= 1"),
    ("fedbip", ["--variants", "prompt-only"], "--variants: unknown prompt-only; choose among prompt_only"),
    ("fedbip", ["--variants", ","], "--variants ',' names no row; choose among prompt_only"),
    ("fedbip", ["--seeds", "0,1,0"], "--seeds must be comma-separated whole numbers in [0, 2**32), each once"),
    ("fedbip", ["--classifier_steps", "None"], "--classifier_steps None: the comparison trains every classifier"),
    ("fedbip", ["--classifier_steps", "50", "--baseline_rounds", "7"], "--classifier_steps (50) must be a multiple "
                                                                        "of --baseline_rounds (7)"),
    ("fedbip", ["--data_seed", "-1"], "--data_seed must be in [0, 2**32)"),
    ("pretrain", ["--lr", "-1"], "--lr must be > 0 and finite, got -1.0"),
    ("pretrain_ldm", ["--image_size", "30"], "--image_size 30 has no default latent side"),
]


def test_every_recipe_has_a_bad_case():
    assert {p.stem for p in (ROOT / "recipes").glob("*.py")} == {name for name, _, _ in BAD}


def _no_work(monkeypatch, mod):
    """A bad value must stop at parsing: a run that gets as far as the engine, the tuner, the LDM or pretraining
    fails the test at once (instead of running for minutes)."""
    import hfpfl.fedbip.ldm as fedbip_ldm
    import hfpfl.federated.engine as engine
    import hfpfl.tuning as tuning

    def started(*args, **kwargs):
        raise RuntimeError("the run started: parsing let the bad value through")

    monkeypatch.setattr(engine, "Simulation", started)
    monkeypatch.setattr(tuning, "Tuner", started)
    monkeypatch.setattr(fedbip_ldm, "resolve_ldm", started)
    for attr in ("ensure_pretrained", "pretrain_ldm"):
        if hasattr(mod, attr):
            monkeypatch.setattr(mod, attr, started)


@pytest.mark.parametrize("name,argv,expected", BAD, ids=[f"{n}:{' '.join(a)}" for n, a, _ in BAD])
def test_bad_value_is_one_line_exit_2_nothing_written(name, argv, expected, tmp_path, capsys, monkeypatch):
    """A new --output_dir is not created; an existing one is left exactly as it was."""
    mod = recipe(name)
    _no_work(monkeypatch, mod)
    old = tmp_path / "old"
    old.mkdir()
    (old / "notes.txt").write_text("mine\n")
    for out in (tmp_path / "new", old):
        before = sorted((str(p), p.read_bytes() if p.is_file() else None) for p in tmp_path.rglob("*"))
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            mod.main([*argv, "--output_dir", str(out)])
        assert e.value.code == 2
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), lines
        assert expected in lines[0], lines[0]
        assert sorted((str(p), p.read_bytes() if p.is_file() else None) for p in tmp_path.rglob("*")) == before
    assert not (tmp_path / "new").exists()


def _options(name):
    """The dataclasses whose every field a recipe's --help must list: its own options and its method's."""
    from hfpfl.algorithms import get_algorithm
    method = {"run": "fedavg", "fedavg": "fedavg", "fedadapter": "fedavg", "perada": "perada", "fraug": "fraug",
              "fedbasis": "fedbasis", "fedpce": "fedpce", "feddat": "feddat", "fedpop": "fedavg", "fedbip": "fedbip"}
    mod = recipe(name)
    own = {"fedpce", "feddat", "fedpop", "fedbip", "fedbasis", "pretrain", "pretrain_ldm"}  # the recipes with options of their own
    assert (getattr(mod, "RECIPE_OPTIONS", None) is not None) == (name in own), name
    types = [mod.RECIPE_OPTIONS] if name in own else []
    if name in method:
        types.append(get_algorithm(method[name]).Config)
    return mod, types


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "recipes").glob("*.py")))
def test_help_lists_the_recipe_options(name, capsys):
    mod, types = _options(name)
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code in (0, None)
    text = capsys.readouterr().out
    for dc in types:
        for f in dataclasses.fields(dc):
            assert f"--{f.name}" in text, (name, f.name)


def test_recipe_options_from_a_config_file_checked_and_misspellings_named(tmp_path):
    from hfpfl.arguments import parse_run_args
    opts = recipe("fedpce").BenchmarkOptions
    cfg = tmp_path / "c.yaml"
    cfg.write_text("benchmark: lodo\nnew_client_budget: 4\nlevels: cycled\nnum_rounds: 2\n")
    run, _, _, rec = parse_run_args(["--config", str(cfg), "--levels", "paper"], method="fedpce",
                                    recipe_options=opts)
    assert (rec.benchmark, rec.new_client_budget, rec.levels, run.num_rounds) == ("lodo", 4, "paper", 2)
    cfg.write_text("new_client_budget: 0\n")  # a config file's value meets the same declared check
    with pytest.raises(ValueError, match=r"^--new_client_budget must be >= 1, got 0$"):
        parse_run_args(["--config", str(cfg)], method="fedpce", recipe_options=opts)
    cfg.write_text("benchmark: lodoo\n")
    with pytest.raises(ValueError, match=r"--benchmark must be one of degradation, lodo, got 'lodoo'"):
        parse_run_args(["--config", str(cfg)], method="fedpce", recipe_options=opts)
    cfg.write_text("new_client_budgt: 3\n")
    with pytest.raises(ValueError, match="Did you mean 'new_client_budget'"):
        parse_run_args(["--config", str(cfg)], method="fedpce", recipe_options=opts)
    # without the recipe's options (recipes/run.py) the key is unknown, not silently dropped
    cfg.write_text("levels: cycled\n")
    with pytest.raises(ValueError, match="unknown config key 'levels'"):
        parse_run_args(["--config", str(cfg)], method="fedpce")


def test_engine_records_recipe_options_in_config_yaml_and_it_parses_back(run_sim, tmp_path):
    """config.yaml holds the recipe's own options next to the run's, and is a --config input that gives them back."""
    from hfpfl.arguments import parse_run_args
    opts = recipe("fedpce").BenchmarkOptions
    settings = dataclasses.asdict(opts(benchmark="lodo", new_client_budget=3, levels="cycled"))
    sim, _ = run_sim("fedavg", num_rounds=1, output_dir="rec", recipe_settings=settings, new_client_epochs=0,
                     checkpoint_every=0)
    cfg = Path(sim.args.output_dir) / "config.yaml"
    assert "levels: cycled" in cfg.read_text()
    *_, rec = parse_run_args(["--config", str(cfg)], recipe_options=opts)
    assert dataclasses.asdict(rec) == settings


class _FakeSimulation:
    """Stands in for the engine: records what the recipe hands it; ``run`` is set per test."""
    seen: list = []

    def __init__(self, run_args, data_args=None, method_config=None, *, fed_data=None, recipe_settings=None):
        self.args, self.fed_data, self.recipe_settings = run_args, fed_data, recipe_settings
        self.accelerator = type("Acc", (), {"is_main_process": True})()
        _FakeSimulation.seen.append(self)

    def run(self):
        return _FakeSimulation.behaviour(self)


def _fake_engine(monkeypatch, behaviour):
    import hfpfl.federated.engine as engine
    _FakeSimulation.seen = []
    _FakeSimulation.behaviour = staticmethod(behaviour)
    monkeypatch.setattr(engine, "Simulation", _FakeSimulation)


def _interrupted_after_round_one(sim):
    from hfpfl.runtime import Interrupted
    ckpt = Path(sim.args.output_dir) / "checkpoints" / "round-1"
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text("{}")
    raise Interrupted(signal.SIGTERM)


def test_feddat_resume_command_keeps_the_recipe_options(monkeypatch, tmp_path, capsys):
    """SIGTERM after round 1: the printed resume command carries --train_per_client / --test_per_client (they shape
    the data, so the checkpoint refuses a resume without them); run as printed, it parses to the same recipe
    settings with --resume_from_checkpoint latest. --backbone blip makes blip's stand-in the default --model."""
    from hfpfl.models.vqa import BACKBONES
    mod = recipe("feddat")
    built = []
    monkeypatch.setattr(mod, "build_data", lambda run, data, split, train_n, test_n, image_ablation, answer_balance:
                        built.append((split, train_n, test_n, image_ablation)) or "fed")
    _fake_engine(monkeypatch, _interrupted_after_round_one)
    out = tmp_path / "run"
    argv = ["--backbone", "blip", "--vqa_split", "domain", "--train_per_client", "24", "--test_per_client", "20",
            "--image_ablation", "shuffle", "--num_rounds", "3", "--output_dir", str(out)]
    with pytest.raises(SystemExit) as e:
        mod.main(argv)
    assert e.value.code == 128 + signal.SIGTERM
    first = _FakeSimulation.seen[0]
    assert built == [("domain", 24, 20, "shuffle")] and first.fed_data == "fed"
    assert first.args.model == BACKBONES["blip"]
    assert first.recipe_settings == {"backbone": "blip", "vqa_split": "domain", "train_per_client": 24,
                                     "test_per_client": 20, "image_ablation": "shuffle", "answer_balance": "question",
                                     "validation_per_client": 0}
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("interrupted; round 1 is saved in ")
    command = shlex.split(err.split("resume with: ", 1)[1])
    assert command[:2] == ["python", "recipes/feddat.py"]
    assert command[-2:] == ["--resume_from_checkpoint", "latest"]
    i = command.index("--train_per_client")
    assert command[i + 1] == "24" and command[command.index("--test_per_client") + 1] == "20"
    assert command[command.index("--image_ablation") + 1] == "shuffle"

    _fake_engine(monkeypatch, lambda sim: {"resumed": sim.args.resume_from_checkpoint})
    monkeypatch.setattr("hfpfl.cli.format_table", lambda results: "")
    assert mod.main(command[2:]) == {"resumed": "latest"}
    again = _FakeSimulation.seen[0]
    assert again.recipe_settings == first.recipe_settings and again.args.output_dir == str(out)
    assert dataclasses.replace(again.args, resume_from_checkpoint=None) == first.args


def test_feddat_model_flag_and_config_file_override_the_backbone_default(tmp_path):
    from hfpfl.arguments import parse_run_args
    from hfpfl.models.vqa import BACKBONES
    opts = recipe("feddat").VQABenchmark
    run, *_ = parse_run_args(["--backbone", "blip"], method="feddat", recipe_options=opts)
    assert run.model == BACKBONES["blip"]
    run, *_ = parse_run_args(["--backbone", "blip", "--model", "tiny-vilt"], method="feddat", recipe_options=opts)
    assert run.model == "tiny-vilt"
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: tiny-vilt\nbackbone: blip\n")
    run, *_, rec = parse_run_args(["--config", str(cfg)], method="feddat", recipe_options=opts)
    assert (run.model, rec.backbone) == ("tiny-vilt", "blip")


def test_a_failing_embeddings_plot_does_not_fail_a_finished_fedpce_run(monkeypatch, capsys, caplog):
    mod = recipe("fedpce")
    results = {"final": {"personal_accuracy": 0.5}, "communication": {"bytes_up": 1, "bytes_down": 1},
               "method": "fedpce", "dataset": "d", "partition": "p", "num_clients": 3, "num_rounds": 1, "seed": 0,
               "wall_time_s": 0.0}
    _fake_engine(monkeypatch, lambda sim: results)
    monkeypatch.setattr(mod, "build_data", lambda *args, **kwargs: "fed")
    _FakeSimulation.data = None

    def plot(sim, fed):
        raise IndexError("index 0 is out of bounds for axis 1 with size 0")

    monkeypatch.setattr(mod, "plot_embeddings", plot)
    with caplog.at_level("WARNING", logger="hfpfl"):
        assert mod.main(["--output_dir", "unused"]) is results
    assert "embeddings_pca.png not written (IndexError" in caplog.text
    assert "personal_accuracy" in capsys.readouterr().out


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_fedpce_embedding_plot_with_few_dimensions(dim, tmp_path):
    """--embedding_dim 1 plots along one axis; a zero-size embedding has nothing to plot (no IndexError)."""
    import torch
    mod = recipe("fedpce")
    sim = type("Sim", (), {"output_dir": str(tmp_path)})()
    sim.algorithm = type("Algo", (), {"embeddings": lambda self: {i: torch.arange(dim, dtype=torch.float32) * i
                                                                  for i in range(4)}})()
    fed = type("Fed", (), {"clients": {i: type("C", (), {"domain": f"noise-{i}"})() for i in range(4)}})()
    mod.plot_embeddings(sim, fed)
    assert (tmp_path / "embeddings_pca.png").exists() == (dim > 0)


def test_fedbip_honours_hfpfl_num_processes_and_the_flag_wins(monkeypatch):
    from hfpfl.experiments import fedbip_compare as compare
    monkeypatch.setenv("HFPFL_NUM_PROCESSES", "1")
    assert compare.parse([])[0].num_processes == "1"
    monkeypatch.setenv("HFPFL_NUM_PROCESSES", "2")
    assert compare.parse([])[0].num_processes == "2"
    assert compare.parse(["--num_processes", "1"])[0].num_processes == "1"


def test_fedbip_class_words_checked_against_the_loaded_classes():
    """A Hub dataset's classes are known once loaded: the same check then, with its count."""
    from hfpfl.fedbip.config import FedBiPConfig
    from hfpfl.experiments.fedbip_compare import builtin_num_labels, check_words
    assert builtin_num_labels("digits-nomnist") == 10 and builtin_num_labels("usps+noise:2") == 10
    assert builtin_num_labels("owner/flowers") is None
    cfg = FedBiPConfig(class_words="rose,tulip,daisy", domain_words="photo")
    check_words(cfg, 5, 0, None)          # not yet known: passes
    check_words(cfg, 5, 0, 3)
    with pytest.raises(ValueError, match="^--class_words has 3 words but the data has 5 classes; pass 5"):
        check_words(cfg, 5, 0, 5)
    check_words(FedBiPConfig(domain_words="a,b,c,d,e,f"), 5, 1, 10)  # one per client, held-out clients included


def _divides_by_power_of_two(image, latent):
    factor = image // latent
    return latent > 0 and image % latent == 0 and factor >= 1 and (factor & (factor - 1)) == 0


@pytest.mark.parametrize("image,latent", [(30, None), (30, 7), (32, 7), (36, 5), (33, None), (12, 5)])
def test_pretrain_ldm_latent_advice_is_a_valid_value(image, latent):
    mod = recipe("pretrain_ldm")
    argv = ["--image_size", str(image)] + ([] if latent is None else ["--latent_size", str(latent)])
    with pytest.raises(ValueError) as e:
        mod.PretrainArguments(image_size=image, latent_size=latent)
    msg = str(e.value)
    advised = msg.split("pass --latent_size ", 1)[1].split(",")[0].split(" or ")
    assert advised and all(_divides_by_power_of_two(image, int(v)) for v in advised), (argv, msg)


def test_fedpop_default_output_folder_and_the_one_reuse_rule(monkeypatch, tmp_path, capsys):
    """No --output_dir: outputs/fedpop-<timestamp>; a folder holding a population is reused only with
    --resume_from_checkpoint latest (which resumes it) or --overwrite_output_dir."""
    import hfpfl.tuning as tuning
    mod = recipe("fedpop")
    seen = []

    class FakeTuner:
        def __init__(self, run, data, cfg, targs):
            seen.append((run.output_dir, targs.resume))
            self.accelerator = type("Acc", (), {"is_main_process": False})()

        def run(self):
            return {}

    monkeypatch.setattr(tuning, "Tuner", FakeTuner)
    monkeypatch.chdir(tmp_path)
    mod.main([])
    assert seen[-1][0].startswith(os.path.join("outputs", "fedpop-"))
    out = tmp_path / "pop"
    out.mkdir()
    (out / "population.pt").write_bytes(b"saved")
    with pytest.raises(SystemExit) as e:
        mod.main(["--output_dir", str(out)])
    assert e.value.code == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--resume_from_checkpoint latest" in lines[0]
    assert f"--output_dir {str(out)!r} already holds an unfinished run (population.pt)" in lines[0]
    assert (out / "population.pt").read_bytes() == b"saved"
    (out / "curves.png").write_bytes(b"old")
    (out / "notes.txt").write_bytes(b"mine")
    mod.main(["--output_dir", str(out), "--resume_from_checkpoint", "latest"])
    assert seen[-1] == (str(out), True) and (out / "population.pt").exists()
    mod.main(["--output_dir", str(out), "--overwrite_output_dir", "true"])
    assert seen[-1] == (str(out), False) and not (out / "population.pt").exists()
    assert not (out / "curves.png").exists() and (out / "notes.txt").read_bytes() == b"mine"  # only a run's files


@pytest.mark.parametrize("script,argv,expected", [
    ("recipes/fedpop.py", ["--population_size", "0"], "--population_size must be >= 1"),
    ("recipes/pretrain.py", ["--lr", "-1"], "--lr must be > 0"),
])
def test_end_to_end_bad_value_one_line(script, argv, expected, tmp_path):
    out = subprocess.run([sys.executable, script, *argv, "--output_dir", str(tmp_path / "o")], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], out.stderr[-2000:]
    assert not (tmp_path / "o").exists()


def test_fedpce_recipe_builds_the_papers_groups_and_new_client_test_sets():
    """--groups noise,color,imbalance and --new_client_test_size reach the benchmark: 4 clients and 2 new clients
    per group, the new clients tested on 100 images each."""
    from hfpfl.data import DataArguments

    mod = recipe("fedpce")
    data = DataArguments(dataset="mnist", num_clients=12, num_new_clients=6, max_per_domain=None, image_size=16,
                         num_channels=1)
    fed = mod.build_data(data, 0, "degradation", 5, "svhn", "paper", "noise,color,imbalance", 100)
    assert len(fed.clients) == 12 and len(fed.new_clients) == 6
    assert sorted({c.domain.split("-")[0] for c in fed.clients if c.domain}) == ["color", "imbalance", "noise"] or \
        len({c.domain for c in fed.clients}) == 3
    assert [len(c.test) for c in fed.new_clients] == [100] * 6
