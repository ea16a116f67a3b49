"""Every option of every registered method (and every run and data option) is checked where it is declared
(:mod:`hfpfl.options`), by the one parser, before anything is written: a bad value is one line naming the option and
what it must be. The table below holds the cases users met; the sweeps make sure a new option cannot skip its check."""
import dataclasses
import math
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from hfpfl.algorithms import REGISTRY, load_builtin_methods
from hfpfl.config import RunArguments
from hfpfl.arguments import parse_run_args
from hfpfl.data import DataArguments
from hfpfl.options import declared_check, validate

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HFPFL_NUM_PROCESSES": "1",
       "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}   # this checkout's hfpfl

load_builtin_methods()
METHODS = sorted(REGISTRY)
# one method per config class (pce_fedavg etc. share FedPCEConfig): the sweeps cover each config once
CONFIG_METHODS = sorted({REGISTRY[m].Config: m for m in reversed(METHODS)
                         if dataclasses.is_dataclass(REGISTRY[m].Config)}.values())

#: options whose values are free text (paths, names, ids) that no declared check can judge; each says who checks it
EXEMPT = {
    ("RunArguments", "method"): "looked up in the method registry, with a did-you-mean (get_algorithm)",
    ("RunArguments", "model"): "a built-in name, Hub id or folder: check_model_name, then the loader",
    ("RunArguments", "output_dir"): "any folder; resolve_output_dir refuses a file or a finished run",
    ("RunArguments", "resume_from_checkpoint"): "'latest' or a checkpoint folder, checked when resuming",
    ("DataArguments", "dataset"): "a source name, Hub id or path: check_source_name (the '+degradation' suffixes), "
                                  "then the loader",
    ("DataArguments", "partition_column"): "a column of the user's own dataset, checked when partitioning",
    ("FedBiPConfig", "ldm"): "a Hub repo id or a local folder, checked when the LDM is loaded",
    ("FGLConfig", "ldm"): "FedBiP's (inherited): checked when the LDM is loaded",
    ("FedDEOConfig", "ldm"): "FedBiP's (inherited): checked when the LDM is loaded",
}


def _first_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text.strip(), f"not one line: {text!r}"
    return text


def _refused(argv) -> str:
    with pytest.raises(ValueError) as e:
        parse_run_args(list(argv))
    return _first_line(e.value)


# (method, flags, the option the line must start with, words the line must hold)
CASES = [
    ("fedpce", ["--lr_embedding", "-1"], "--lr_embedding", ["> 0", "-1.0"]),
    ("fedpce", ["--mlp_hidden", "0"], "--mlp_hidden", [">= 1", "got 0"]),
    ("fedpce", ["--widths", "8,16,32,64", "--depths", "1,1"], "--widths", ["--depths", "same number", "4 widths", "2 depths",
                                                         "one --depths entry per --widths entry"]),
    ("fedpce", ["--embedding_dim", "0"], "--embedding_dim", [">= 1"]),
    ("fedpce", ["--betas", "0.5"], "--betas", ["2 comma-separated numbers", "< 1", "'0.5'"]),
    ("fedpce", ["--betas", "0.5,1.0"], "--betas", ["< 1"]),
    ("fedbasis", ["--temperature", "-1"], "--temperature", ["> 0"]),
    ("fedbasis", ["--temperature", "0"], "--temperature", ["> 0"]),
    ("fedbasis", ["--warm_fraction", "1.5"], "--warm_fraction", ["in [0, 1]", "1.5"]),
    ("fedbasis", ["--depths", "1,1"], "--widths", ["--depths"]),
    ("fraug", ["--mmd_alpha", "-1"], "--mmd_alpha", [">= 0"]),
    ("fraug", ["--gen_lr", "-1"], "--gen_lr", ["> 0"]),
    ("fraug", ["--use_generator", "false", "--use_rtnet", "false"], "--use_generator", ["--use_rtnet", "true"]),
    ("feddat", ["--warmup", "2"], "--warmup", ["fraction in [0, 1]", "2.0"]),
    ("feddat", ["--reduction", "0"], "--reduction", [">= 1"]),
    ("fedbip", ["--concept_lr", "inf"], "--concept_lr", ["> 0 and finite", "inf"]),
    ("fedbip", ["--sampler", "euler"], "--sampler", ["pndm, ddim, ddpm"]),
    ("fedbip", ["--prompt_template", "a photo of a [V]"], "--prompt_template", ["[S]"]),
    ("perada", ["--eval_corrupted", "nois:3"], "--eval_corrupted", ["unknown corruption 'nois'", "noise:3"]),
    ("perada", ["--eval_corrupted", "noise:9"], "--eval_corrupted", ["1..5"]),
    ("feddf", ["--kd_lr", "0"], "--kd_lr", ["> 0"]),
    ("fedprox", ["--mu", "-0.1"], "--mu", [">= 0"]),
    ("ditto", ["--lam", "nan"], "--lam", [">= 0 and finite"]),
    ("fedavg", ["--dataset", "usps+rotaton:3"], "--dataset", ["'+rotaton'", "did you mean '+rotation'"]),
    ("fedavg", ["--dataset", "digits+nosie"], "--dataset", ["'+nosie'", "did you mean '+noise'"]),
    ("fedavg", ["--dataset", "usps+noise:7"], "--dataset", ["severity", "1-5"]),
    ("fedavg", ["--degradations", "noise,rotaton"], "--degradations", ["'rotaton'", "did you mean 'rotation'"]),
]


@pytest.mark.parametrize("method,flags,option,words", CASES,
                         ids=[f"{c[0]}{''.join(c[1][:2])}" for c in CASES])
def test_bad_method_option_is_one_line_naming_it(method, flags, option, words):
    line = _refused(["--method", method, *flags])
    assert line.startswith(option + " ") or line.startswith(option + ":"), line
    for w in words:
        assert w in line, (w, line)


def test_a_misspelt_degradation_is_blamed_not_the_source():
    """'usps' is a fine source: the line must not call it unknown (it used to say "unknown source 'usps+rotaton:3'")."""
    for name in ("usps+rotaton:3", "digits+nosie", "usps+noise+colr"):
        line = _refused(["--dataset", name])
        assert "unknown source" not in line and "unknown degradation" in line, line
    # the suffixes that are degradations, and names that are no source at all, pass the name check (the loader
    # names an unknown source when it is loaded)
    for name in ("usps+noise:2+rotation", "digits", "nosuchdata", "imagefolder:/no/such+folder"):
        parse_run_args(["--dataset", name])


# ------------------------------------------------------------------------------------------------ generic sweeps
def _types(dc) -> dict:
    hints = typing.get_type_hints(dc)
    out = {}
    for f in dataclasses.fields(dc):
        args = typing.get_args(hints[f.name]) or (hints[f.name],)
        out[f.name] = tuple(a for a in args if a is not type(None))
    return out


def _all_configs():
    """(owner method for --method, dataclass) for the run and data options and every registered method config."""
    yield "fedavg", RunArguments
    yield "fedavg", DataArguments
    for m in CONFIG_METHODS:
        yield m, REGISTRY[m].Config


INT_TRIES = [-1, 0, 1, -10 ** 9, 10 ** 12]
FLOAT_TRIES = [-1.0, 0.0, 1.5, 2.0, -1e9, 1e12, math.inf, -math.inf, math.nan]


def _numeric_options():
    for method, dc in _all_configs():
        for name, tps in _types(dc).items():
            if tps in ((int,), (float,)):
                yield method, dc, name, tps[0]


NUMERIC = list(_numeric_options())


@pytest.mark.parametrize("method,dc,name,tp", NUMERIC, ids=[f"{d.__name__}.{n}" for _, d, n, _ in NUMERIC])
def test_every_number_option_refuses_a_value_outside_its_check(method, dc, name, tp):
    """For each int/float option: a value its declared check rejects is refused by the parser, one line starting
    with the option's flag. (Fails, too, for a number option without a check: every value is then accepted.)"""
    f = {f.name: f for f in dataclasses.fields(dc)}[name]
    check = declared_check(f)
    assert check is not None, f"{dc.__name__}.{name} declares no check"
    bad = [v for v in (INT_TRIES if tp is int else FLOAT_TRIES) if not check.ok(v)]
    assert bad, f"{dc.__name__}.{name}: its check accepts every value tried, {check.allowed!r}"
    line = _refused(["--method", method, f"--{name}", str(bad[0])])
    assert line.startswith(f"--{name} must be {check.allowed}"), line


def test_every_option_declares_a_check_or_is_an_exempt_free_text():
    """Every int / float / str option of the run, the data and every registered method declares a check (or
    choices); the only exceptions are the free-text options of EXEMPT, each with who checks it instead."""
    missing, stale = [], []
    for _, dc in _all_configs():
        for f in dataclasses.fields(dc):
            tps = _types(dc)[f.name]
            if not set(tps) & {int, float, str}:
                continue
            exempt = (dc.__name__, f.name) in EXEMPT
            if declared_check(f) is None and not exempt:
                missing.append(f"{dc.__name__}.{f.name}")
            if declared_check(f) is not None and exempt:
                stale.append(f"{dc.__name__}.{f.name}")
    assert not missing, f"options without a declared check (hfpfl.options): {missing}"
    assert not stale, f"EXEMPT lists options that declare a check: {stale}"
    known = {(dc.__name__, f.name) for _, dc in _all_configs() for f in dataclasses.fields(dc)}
    assert set(EXEMPT) <= known, set(EXEMPT) - known


@pytest.mark.parametrize("method", METHODS)
def test_every_method_parses_its_defaults(method):
    """The declared checks accept every default (a check stricter than its default would refuse every plain run)."""
    run, data, cfg = parse_run_args(["--method", method])
    for obj in (run, data, cfg):
        validate(obj)


def test_python_built_configs_meet_the_same_checks():
    """A config built in Python (not parsed) is refused the same way, at construction."""
    from hfpfl.algorithms.fedbasis import FedBasisConfig
    from hfpfl.algorithms.fedpce import FedPCEConfig

    with pytest.raises(ValueError, match=r"^--temperature must be > 0"):
        FedBasisConfig(temperature=0.0)
    with pytest.raises(ValueError, match=r"^--widths and --depths must give the same number"):
        FedPCEConfig(widths="8,16,32", depths="1,1,1,1")
    with pytest.raises(ValueError, match=r"^--lr must be > 0"):
        RunArguments(lr=-0.1)


# ------------------------------------------------------------------------------------------------ divergence
def test_step_size_options_are_real_checked_options():
    """Every option a method names in its divergence message exists, is checked, and says which way is smaller."""
    for m in CONFIG_METHODS:
        dc = REGISTRY[m].Config
        fields = {f.name: f for f in dataclasses.fields(dc)}
        for name, way in getattr(dc, "STEP_SIZES", {}).items():
            assert name in fields and declared_check(fields[name]) is not None, (dc.__name__, name)
            assert way in ("lower", "raise"), (dc.__name__, name, way)


def test_divergence_hint_names_the_methods_step_sizes():
    """The words of the hint, written out by hand for fedbasis (lr 0.05 from the run; lr_coef, lr_full lower;
    temperature raise) and for a method that declares none (fedavg), with --server_lr for the server's state."""
    from hfpfl.algorithms.fedbasis import FedBasisConfig
    from hfpfl.fedbip.config import FedBiPConfig
    from hfpfl.federated.context import step_size_hint
    from hfpfl.federated.protocol import NoConfig

    run = RunArguments(lr=0.05, server_lr=1.0)
    assert step_size_hint(run, FedBasisConfig(temperature=0.2)) == \
        "lower --lr (now 0.05), --lr_coef (now 0.1) or --lr_full (now 0.01), or raise --temperature (now 0.2)"
    assert step_size_hint(run, NoConfig(), server=True) == "lower --lr (now 0.05) or --server_lr (now 1.0)"
    assert step_size_hint(run, FedBiPConfig(concept_lr=3.0), lr=0.5) == "lower --lr (now 0.5) or --concept_lr (now 3.0)"


def test_a_diverged_run_names_the_method_option_that_set_the_step(run_sim):
    """FedProx with a huge mu: the proximal pull, lr * mu per step, overshoots and the weights blow up; the line
    names --mu with its value (not only --lr)."""
    from hfpfl.algorithms.fedprox import FedProxConfig
    from hfpfl.federated.context import NonFiniteError

    with pytest.raises(NonFiniteError) as e:
        run_sim("fedprox", method_config=FedProxConfig(mu=1e30), num_rounds=1, local_epochs=1, vectorize="off")
    line = _first_line(e.value)
    assert "training diverged" in line and "--mu (now 1e+30)" in line and "--lr (now 0.05)" in line, line


# ------------------------------------------------------------------------------------------------ real entry points
def _recipe_main(name):
    """recipes/<name>.py's ``main(argv)``; a recipe without one (fraug) is ``run_recipe`` with its method and
    DEFAULTS, which is all its ``__main__`` block does."""
    from conftest import load_script

    mod = load_script(f"recipes/{name}.py", f"hfpfl_recipe_{name}_opts")
    if hasattr(mod, "main"):
        return mod.main
    from hfpfl.cli import run_recipe
    return lambda argv: run_recipe(method=name, argv=argv, defaults=mod.DEFAULTS, script=f"recipes/{name}.py")


def _tree(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("recipe,flags,option", [
    ("fedpce", ["--lr_embedding", "-1"], "--lr_embedding"),
    ("fedpce", ["--widths", "8,16,32,64,128"], "--widths"),
    ("fedbasis", ["--temperature", "0"], "--temperature"),
    ("fedbasis", ["--warm_fraction", "1.5"], "--warm_fraction"),
    ("fraug", ["--gen_lr", "-1"], "--gen_lr"),
    ("fraug", ["--dataset", "digits+nosie"], "--dataset"),
])
def test_recipe_refuses_bad_option_with_one_line_and_writes_nothing(recipe, flags, option, tmp_path, capsys):
    """recipes/<recipe>.py main(argv): exit code 2, exactly one stderr line 'error: --<option> ...', a new
    --output_dir not created, an existing one left as it was."""
    main = _recipe_main(recipe)
    for out, existing in ((tmp_path / "new", False), (tmp_path / "old", True)):
        if existing:
            out.mkdir()
            (out / "notes.txt").write_text("mine\n")
        before = _tree(tmp_path)
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            main([*flags, "--output_dir", str(out)])
        err = capsys.readouterr().err
        assert e.value.code == 2, err
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith(f"error: {option}"), err
        assert _tree(tmp_path) == before
        assert out.exists() == existing


def test_recipe_script_exit_code_and_line(tmp_path):
    """The same through the real process (recipes/fraug.py has no main(argv): its __main__ block is the entry):
    exit code 2, that one stderr line, no --output_dir."""
    out = tmp_path / "o"
    p = subprocess.run([sys.executable, "recipes/fraug.py", "--mmd_alpha", "-1", "--output_dir", str(out)],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and lines == ["error: --mmd_alpha must be >= 0 and finite, got -1.0"], p.stderr[-2000:]
    assert not out.exists()
