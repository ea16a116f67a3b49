"""Mutation testing of one method's core against that method's fast tests (mutmut 3).

    .venv/bin/python scripts/mutation.py fedprox                  # a method (or a target: server, adapters, ...)
    .venv/bin/python scripts/mutation.py hfpfl/algorithms/fedprox.py   # a core file: its target's tests
    .venv/bin/python scripts/mutation.py --list                   # the table of targets, core files and tests

mutmut changes one operator, constant or call at a time in the core file(s) and runs the tests that execute the
changed function; a mutant that no test notices ("survived") is a change to the algorithm the suite would let
through. The script prints killed / total, every surviving mutant with its diff, and writes
``outputs/mutation/<target>.json`` (per file: mutants, killed, survived, timeouts, score, and each survivor's diff).

mutmut 3 copies the sources into ``mutants/`` under its working directory and imports them from there. The script
runs it in ``outputs/mutation/<target>/`` (ignored by git), so the checkout stays untouched, targets do not share a
cache, and the editable install (which maps ``hfpfl`` to whichever checkout installed it) is shadowed: mutmut puts
``mutants/`` first on ``sys.path``, and ``PYTHONPATH`` points subprocesses there too. mutmut mutates code inside
functions only (not module or class bodies, not functions with decorators other than @staticmethod/@classmethod).

The score counts killed + timed-out mutants over all mutants (a mutant no selected test executes counts as
surviving: "no tests"). Each run starts afresh unless ``--resume`` is given (mutmut then retests only functions that
changed; it cannot see edits to the tests themselves).
"""
from __future__ import annotations

import argparse
import fcntl
import fnmatch
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the fast tier: mutation testing runs each mutant's covering tests, so slow and quality tests stay out
FAST = "not slow and not quality"
#: what the tests need beside the packages (they find recipes/, scripts/ and README.md next to tests/)
ALSO_COPY = ["recipes", "scripts", "README.md", "docs"]
SOURCE_PATHS = ["hfpfl", "pipelines"]


@dataclass
class Target:
    """A method's core: the files mutmut mutates (``core``), optionally only some functions of them (``functions``:
    mutmut key globs such as ``x_server_optimizer_step`` or ``xǁWeightedSumsǁ*``), and the tests whose fast tests
    must kill the mutants (``tests``: file globs, or ``file::test`` node ids; ``k``: a pytest -k expression)."""

    core: list[str]
    tests: list[str]
    functions: list[str] = field(default_factory=list)
    k: str | None = None


def fedpop_nodes(file: str, *tests: str) -> list[str]:
    """Node ids of some tests of one file under tests/tuning/."""
    return [f"tests/tuning/{file}::{t}" for t in tests]


FEDBIP_PINS = ["tests/fedbip/test_fedbip_pins.py", "tests/fedbip/test_fedbip_*_pins.py"]
FEDBIP_FAST = ["tests/fedbip/test_fedbip_algorithm.py", "tests/fedbip/test_fedbip_pipeline.py", *FEDBIP_PINS]
BASELINE_TESTS = ["tests/algorithms/test_baselines*.py", "tests/algorithms/test_baseline_pins.py"]
#: method -> core -> tests, the one table. Targets share no file unless a file is genuinely part of both cores.
TARGETS: dict[str, Target] = {
    "fedprox": Target(["hfpfl/algorithms/fedprox.py"],
                      BASELINE_TESTS + ["tests/federated/test_vectorized.py::test_vectorized_matches_sequential"], k="prox"),
    "scaffold": Target(["hfpfl/algorithms/scaffold.py"], BASELINE_TESTS),
    "fednova": Target(["hfpfl/algorithms/fednova.py"], BASELINE_TESTS),
    "fedbn": Target(["hfpfl/algorithms/fedbn.py"], BASELINE_TESTS + [
        "tests/federated/test_vectorized.py::test_option_dependent_override_vectorizes_only_when_inactive"]),
    "fedper": Target(["hfpfl/algorithms/fedper.py"], BASELINE_TESTS),
    "ditto": Target(["hfpfl/algorithms/ditto.py"], BASELINE_TESTS),
    "fedavg_ft": Target(["hfpfl/algorithms/fedavg_ft.py"], BASELINE_TESTS + ["tests/algorithms/test_fedavg_ft_lr.py"]),
    "local": Target(["hfpfl/algorithms/local.py", "hfpfl/algorithms/central.py"],
                    [*BASELINE_TESTS, "tests/federated/test_server_budget.py"]),
    "feddf": Target(["hfpfl/algorithms/feddf.py", "hfpfl/algorithms/distill.py"],
                    ["tests/algorithms/test_baseline_pins.py", "tests/algorithms/test_distill*.py"]),
    "perada": Target(["hfpfl/algorithms/perada.py"], ["tests/algorithms/test_perada*.py", "tests/algorithms/test_distill.py"]),
    "fedproto": Target(["hfpfl/algorithms/fedproto.py"], ["tests/algorithms/test_fedproto_fedbabu.py"], k="proto"),
    "fedbabu": Target(["hfpfl/algorithms/fedbabu.py"], ["tests/algorithms/test_fedproto_fedbabu.py"], k="babu"),
    "fedbasis": Target(["hfpfl/algorithms/fedbasis.py"], ["tests/algorithms/test_fedbasis*.py"]),
    "fedpce": Target(["hfpfl/algorithms/fedpce.py"], ["tests/algorithms/test_fedpce*.py"]),
    "fraug": Target(["hfpfl/algorithms/fraug.py"], ["tests/algorithms/test_fraug*.py"]),
    "feddat": Target(["hfpfl/algorithms/feddat.py"], ["tests/algorithms/test_feddat*.py"]),
    "vqa_central": Target(["hfpfl/algorithms/vqa_central.py"], ["tests/algorithms/test_vqa_central.py"]),
    # the VQA stand-ins' pretraining objectives (ViLT: ITM + MLM; BLIP: ITC + ITM + LM): what makes them honest
    "vqa_pretrain": Target(["hfpfl/models/vqa_pretrain.py"], ["tests/models/test_vqa_pretrain.py"]),
    "fedbip": Target(["hfpfl/fedbip/config.py", "hfpfl/fedbip/method.py", "hfpfl/fedbip/latents.py",
                      "hfpfl/fedbip/concepts.py", "hfpfl/fedbip/client.py", "hfpfl/fedbip/protocol.py",
                      "pipelines/pipeline_fedbip.py"],
                     ["tests/fedbip/test_fedbip_algorithm*.py", "tests/fedbip/test_fedbip_pipeline*.py", "tests/fedbip/test_fedbip_pins.py"]),
    "fedpop": Target(["hfpfl/tuning/*.py"], ["tests/tuning/test_fedpop*.py"]),
    # FedPop and FedEx wrapped in SHA (the dissertation's appendix algorithm): the part of the fedpop target they add
    "fedpop_sha": Target(["hfpfl/tuning/sha.py", "hfpfl/tuning/baselines.py"],
                         ["tests/tuning/test_fedpop_pins.py", "tests/tuning/test_fedpop_hparams.py",
                          "tests/tuning/test_fedpop_score_pins.py"],
                         functions=["xǁSHAStagesǁ_eliminate", "xǁSHAWrapperǁ_run_sha_wrapped", "x_fedpop_sha", "x_fedex_sha"],
                         k="sha"),
    # the fedpop target's parts, each against the fast tests that pin it (the whole target takes hours on 2 cores);
    # `--parts fedpop` checks that they mutate every function of its core, each in exactly one part
    "fedpop_space": Target(["hfpfl/tuning/search_space.py"],
                           ["tests/tuning/test_search_space_pins.py", *fedpop_nodes(
                               "test_fedpop.py", "test_search_space_defaults_and_unknown_keys",
                               "test_evo_identity_bounds_and_resampling", "test_delta_box_sampling"), *fedpop_nodes(
                               "test_fedpop_pins.py", "test_evo_moves_each_coordinate_by_eps_times_its_range_and_clips",
                               "test_delta_box_bounds_sampling_and_projection_by_hand",
                               "test_coordinate_inverts_value_for_each_kind_by_hand", "test_in_ball_is_the_closed_delta_box",
                               "test_method_values_apply_the_members_value_and_run_the_configs_checks"), *fedpop_nodes(
                               "test_fedpop_hparams.py", "test_scaffold_client_momentum_in_a_file_is_refused_and_dropped_"
                               "from_the_default", "test_adam_has_no_momentum_and_a_model_without_dropout_has_no_dropout",
                               "test_unknown_method_hparams_are_refused_with_did_you_mean")]),
    # population steps: Eq. 3-5 (annealing, quantile sets, the power-law score), FedPop-L and FedPop-G
    "fedpop_evo": Target(["hfpfl/tuning/fedpop.py"],
                         ["tests/tuning/test_fedpop_core_pins.py", "tests/tuning/test_fedpop_score_pins.py", *fedpop_nodes(
                             "test_fedpop.py", "test_cos_anneal_endpoints_and_stop", "test_eq5_power_law_score",
                             "test_fedpop_l_replaces_only_the_worst_slots_with_perturbed_best"), *fedpop_nodes(
                             "test_fedpop_pins.py", "test_fedpop_l_on_known_scores_replaces_the_worst_third_by_the_best_"
                             "perturbed_into_the_box", "test_fedpop_g_on_known_scores_exploits_the_best_and_explores_"
                             "within_eps")],
                         functions=["x_cos_anneal", "x_quantile_sets", "x_eq5_weights", "x_eq5_score", "x_clone_state",
                                    "xǁFedPopǁlocal_window", "xǁFedPopǁfedpop_l", "xǁFedPopǁfedpop_g"]),
    # FedEx's client-configuration draws and its exponentiated-gradient step (and FedPop-L's slot vectors)
    "fedpop_fedex": Target(["hfpfl/tuning/fedex.py", "hfpfl/tuning/fedpop.py"],
                           ["tests/tuning/test_fedpop_core_pins.py", *fedpop_nodes(
                               "test_fedpop.py", "test_fedex_exponentiated_gradient_steps_by_hand",
                               "test_slot_vectors_reach_the_engine")],
                           functions=["xǁFedExǁfedex_update", "xǁFedExǁslot_vectors", "xǁFedPopǁslot_vectors"]),
    # the population checkpoint (state, fingerprint, atomic save, load)
    "fedpop_resume": Target(["hfpfl/tuning/base.py", "hfpfl/tuning/checkpoint.py"],
                            ["tests/tuning/test_fedpop_core_pins.py", *fedpop_nodes(
                                "test_fedpop_pins.py", "test_population_checkpoint_restores_the_tuner_and_refuses_other_"
                                "settings"), *fedpop_nodes(
                                "test_fedpop_hparams.py", "test_fitted_space_round_trips_through_resume_fingerprint")],
                            functions=["xǁMemberǁmeta", "xǁPopulationCheckpointǁ*", "x__tuplify"]),
    # the driver: the registry, building the population, one member's round, each tuner's hooks, the run loops,
    # SHA's schedule and stages, the validation scorer
    "fedpop_driver": Target(["hfpfl/tuning/base.py", "hfpfl/tuning/fedpop.py", "hfpfl/tuning/fedex.py",
                             "hfpfl/tuning/sha.py", "hfpfl/tuning/scoring.py"],
                            ["tests/tuning/test_fedpop_driver_pins.py", "tests/tuning/test_fedpop_score_pins.py",
                             *fedpop_nodes(
                                "test_fedpop.py", "test_sha_schedule_27_9_3_within_budget"), *fedpop_nodes(
                                "test_fedpop_pins.py", "test_sha_keeps_exactly_the_best_third_by_its_stage_scores")],
                            functions=["x_register", "x_tuner_class", "xǁTunerǁ*", "xǁFedPopǁafter_*",
                                       "xǁFedExǁinit_member", "xǁFedExǁafter_member_round", "xǁSHAStagesǁcheck_budget",
                                       "xǁSHAStagesǁsha_schedule", "xǁSuccessiveHalvingǁ_run_sha",
                                       "xǁSHAWrapperǁconfiguration_rounds", "xǁValidationScorerǁ*"]),
    # the final pick and what a run writes (val loss over all clients, Loc(beta^0) fine-tuning, results, plots)
    "fedpop_results": Target(["hfpfl/tuning/results.py", "hfpfl/tuning/fedex.py"],
                             ["tests/tuning/test_fedpop_results_pins.py"],
                             functions=["xǁPopulationResultsǁ*", "x_plot_population", "xǁFedExǁbest_extras"]),
    "fedpop_baselines": Target(["hfpfl/tuning/baselines.py"], ["tests/tuning/test_fedpop_pins.py"],
                               functions=["x__run", "x_random_search", "x_successive_halving", "x_fedex", "x_fedpop"],
                               k="baseline_entry"),
    "fedpop_models": Target(["hfpfl/tuning/models.py"], ["tests/tuning/test_fedpop_models_pins.py"]),
    "adapters": Target(["hfpfl/models/adapters/layer.py", "hfpfl/models/adapters/model.py"],
                       ["tests/models/test_adapters*.py", "tests/algorithms/test_fedadapter*.py", "tests/models/test_adapter_shortcut.py"]),
    # the engine's aggregation (weighted sums, FedAvg's aggregate/reduce) and FedOpt's server optimizer
    # FedBiP's server side (the classifier's budget, Eq. 6) and the real words of its ablation prompts, against the
    # tests that pin them: a run of minutes, where the whole fedbip target takes hours on 2 cores
    "fedbip_server": Target(["hfpfl/fedbip/method.py"],
                            ["tests/fedbip/test_fedbip_algorithm.py"],
                            functions=["xǁFedBiPǁaggregate", "xǁFedBiPǁwords"],
                            k="budget_is_the_server or learnt_it or keep_the_real_words or one_round_and_only or "
                              "given_domain or aggregate_called_directly"),
    # the real style word of each Digits domain in FedBiP's prompts (the rest of pool.py renders the LDM's
    # pretraining pool, not the method)
    "caption_word": Target(["hfpfl/fedbip/pool.py"], ["tests/fedbip/test_fedbip_algorithm.py"],
                           functions=["x_caption_word"], k="keep_the_real_words or given_domain or learnt_it"),
    # the rest of the fedbip target in parts of minutes each, every function mutmut mutates in exactly one part
    # (with fedbip_server; `--parts fedbip` checks it), each against the fast tests that pin it
    "fedbip_protocol": Target(["hfpfl/fedbip/protocol.py"], FEDBIP_FAST, functions=["*"],
                              k="pins or noise_to_the_samplers or out_of_range_timesteps or resolution_matched or "
                                "random_latent_rows or concept_lr_and_sigma or keep_the_real_words or "
                                "synthetic_set_size or aggregate_called_directly"),
    "fedbip_client": Target(["hfpfl/fedbip/latents.py", "hfpfl/fedbip/concepts.py", "hfpfl/fedbip/client.py"],
                            ["tests/fedbip/test_fedbip_pipeline.py", *FEDBIP_PINS],
                            functions=["*"]),
    "fedbip_pipeline": Target(["pipelines/pipeline_fedbip.py"], ["tests/fedbip/test_fedbip_pipeline.py", *FEDBIP_PINS],
                              functions=["*"]),
    # the client side of the engine plug-in: the client's images, Eq. 3's latents, Eq. 4's concepts, the upload,
    # against the pins on a stand-in self (mutmut runs a mutant's tests in name order: with the plug-in's federation
    # tests selected every mutant would first wait for a federation)
    "fedbip_concepts": Target(["hfpfl/fedbip/method.py"], FEDBIP_PINS,
                              functions=["xǁFedBiPǁtrain_concepts", "xǁFedBiPǁinstance_latents",
                                         "xǁFedBiPǁclient_update", "xǁFedBiPǁreal_images",
                                         "xǁFedBiPǁword_concepts"]),  # download / init_private_state: no mutants
    # the options' checks, the LDM's loading, the server's check and synthesis of an upload, the grid, evaluation
    "fedbip_rest": Target(["hfpfl/fedbip/config.py", "hfpfl/fedbip/method.py"], FEDBIP_FAST,
                          functions=["x__template_ok", "x__sampler_ok", "xǁFedBiPConfigǁ*", "x_load_ldm", "x__digest", "xǁFedBiPǁ__init__", "xǁFedBiPǁcheck_upload",
                                     "xǁFedBiPǁsynthesize", "xǁFedBiPǁreceive", "xǁFedBiPǁsave_grid",
                                     "xǁFedBiPǁload_personal", "xǁFedBiPǁpersonalize_new_client",
                                     "xǁFedBiPǁextra_metrics"]),
    # the one-shot baselines of FedBiP's Tables 1-2: DENSE and FedD3 (no LDM), FGL and FedDEO (FedBiP's pipeline)
    "oneshot_kd": Target(["hfpfl/algorithms/dense.py", "hfpfl/algorithms/fedd3.py"],
                         ["tests/algorithms/test_oneshot_baselines_pins.py"],
                         k="not zz_dense_engine"),  # the stand-in pins; DENSE's engine run takes minutes per mutant
    # FGL's captions (written on the client, read on the server) and FedDEO's words, against the fast pins (the
    # methods' engine runs, minutes per mutant on 2 cores, pin client_update / synthesize / word_concepts)
    "oneshot_ldm": Target(["hfpfl/fedbip/baselines/fgl.py", "hfpfl/fedbip/baselines/feddeo.py"],
                          ["tests/fedbip/test_fedbip_baselines.py"],
                          functions=["x_word_ids", "x_write_captions", "x_read_captions", "xǁFedDEOǁwords"],
                          k="captions_are or read_captions or feddeo_words"),
    "server": Target(["hfpfl/federated/aggregation.py", "hfpfl/federated/protocol.py"],
                     ["tests/federated/test_protocol.py", "tests/algorithms/test_baselines*.py", "tests/algorithms/test_baseline_pins.py",
                      "tests/algorithms/test_server_pins.py",
                      "tests/federated/test_vectorized.py::test_add_stacked_equals_one_add_per_client",
                      "tests/federated/test_vectorized.py::test_weighted_means_do_not_depend_on_how_clients_are_split_over_processes",
                      "tests/federated/test_vectorized.py::test_finite_checks_are_exact_when_the_sum_overflows",
                      "tests/federated/test_vectorized.py::test_an_upload_is_checked_tensor_by_tensor_with_one_wait",
                      "tests/federated/test_vectorized.py::test_sums_name_the_first_non_finite_upload_with_a_source",
                      "tests/federated/test_vectorized.py::test_a_non_finite_upload_found_as_the_sums_fold_it_names_its_client"],
                     functions=["x_server_optimizer_step", "x_all_finite", "x_all_finite_each", "x_weighted_average", "xǁWeightedSumsǁ*",
                                "xǁAlgorithmǁaggregation_weights", "xǁAlgorithmǁaccumulate",
                                "xǁAlgorithmǁreduce", "xǁAlgorithmǁaggregate"]),
}
# FedAvg's class only declares a name (hfpfl/algorithms/fedavg.py): its algorithm is the engine's aggregation and
# server step, so `fedavg` is the `server` target
TARGETS["fedavg"] = TARGETS["server"]


def expand(patterns: list[str]) -> list[str]:
    """File globs -> the files they match now (a ``file::test`` node id keeps its test part)."""
    out = []
    for p in patterns:
        path, sep, node = p.partition("::")
        hits = sorted(glob.glob(path, root_dir=ROOT)) if any(c in path for c in "*?[") else [path]
        out += [h + sep + node for h in hits if h + sep + node not in out]
    return out


def target_for(name: str) -> tuple[str, Target] | None:
    """A method name, or a core file (the target that holds it, restricted to that file); None if neither."""
    if name in TARGETS:
        return name, TARGETS[name]
    rel = os.path.relpath(Path(name).resolve(), ROOT) if Path(name).exists() else name
    for tname, t in TARGETS.items():
        if rel in expand(t.core):
            return Path(rel).stem, Target([rel], t.tests, t.functions, t.k)
    return None


def module_of(path: str) -> str:
    return str(Path(path).with_suffix("")).replace(os.sep, ".").removesuffix(".__init__")


def mutant_globs(t: Target) -> list[str]:
    files = expand(t.core)
    return [f"{module_of(f)}.{fn}__mutmut_*" for f in files for fn in (t.functions or ["*"])]


def mutmut_config(core: list[str], tests: list[str], k: str | None) -> str:
    def arr(xs):
        return "[" + ", ".join(json.dumps(x) for x in xs) + "]"
    add = ["-m", FAST, "-p", "no:cacheprovider"] + (["-k", k] if k else [])
    return ("\n[tool.mutmut]\n"
            f"source_paths = {arr(SOURCE_PATHS)}\n"
            f"only_mutate = {arr(core)}\n"
            f"also_copy = {arr(ALSO_COPY)}\n"
            f"pytest_add_cli_args = {arr(add)}\n"
            f"pytest_add_cli_args_test_selection = {arr(tests)}\n"
            "use_git_change_detection = false\n"
            'on_dependency_change = "ignore"\n')


def prepare(work: Path, core: list[str], tests: list[str], k: str | None, resume: bool) -> None:
    """The working directory mutmut runs in: links to the checkout's sources and tests, and a pyproject.toml that is
    the checkout's (pytest's markers and options) plus this target's [tool.mutmut] table."""
    if work.exists() and not resume:
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    for name in SOURCE_PATHS + ALSO_COPY + ["tests"]:
        link = work / name
        if not link.is_symlink() and (ROOT / name).exists():
            link.symlink_to(ROOT / name)
    text = (ROOT / "pyproject.toml").read_text()
    cut = text.find("\n[tool.mutmut]")  # a table of our own would clash with the generated one
    if cut >= 0:
        nxt = text.find("\n[", cut + 1)
        text = text[:cut] + (text[nxt:] if nxt >= 0 else "\n")
    (work / "pyproject.toml").write_text(text + mutmut_config(core, tests, k))
    # the copied tests must be the checkout's current ones. mutants/ must exist before mutmut starts: PYTHONPATH
    # names it, and Python caches a missing path entry as unusable for the whole process (the tests would then
    # import the editable install's unmutated sources and no mutant would find a test)
    shutil.rmtree(work / "mutants" / "tests", ignore_errors=True)
    (work / "mutants").mkdir(exist_ok=True)


SPINNER = re.compile(r"[⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏][^⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏\n]*")


def run_mutmut(work: Path, log: Path, *args: str) -> int:
    """``mutmut run`` in ``work``; its output (minus the spinner) goes to ``log``, and the lines worth reading to
    the terminal."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(work / "mutants")] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    cmd = [sys.executable, "-c", "import sys; from mutmut.__main__ import cli; sys.exit(cli())", "run", *args]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=work, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for line in proc.stdout:
            line = SPINNER.sub("", line)
            if line.strip():
                f.write(line)
                f.flush()
                if not line.startswith(("🎉", "🙁", "🫥", "⏰", "🤔", "🔇", "🧙", "💥", "     also copying")):
                    print("  " + line.rstrip()[:200], flush=True)
        return proc.wait()


def summarize(work: Path, files: list[str], globs: list[str]) -> dict:
    """Per core file: mutmut's verdict on each selected mutant, and each survivor's diff (read from mutmut's own
    files in ``work``)."""
    cwd = os.getcwd()
    os.chdir(work)  # mutmut reads its config and mutants/ relative to the working directory
    try:
        from mutmut.mutation.diff_apply import get_diff_for_mutant
        from mutmut.stats import status_by_exit_code
        return _summarize(files, globs, get_diff_for_mutant, status_by_exit_code)
    finally:
        os.chdir(cwd)


def _summarize(files, globs, get_diff_for_mutant, status_by_exit_code) -> dict:
    per_file = {}
    for f in files:
        meta = Path("mutants") / (f + ".meta")
        codes = json.loads(meta.read_text())["exit_code_by_key"] if meta.exists() else {}
        codes = {k: v for k, v in codes.items() if any(fnmatch.fnmatchcase(k, g) for g in globs)}
        statuses = {k: status_by_exit_code[v] for k, v in codes.items()}
        killed = sum(s in ("killed", "timeout") for s in statuses.values())
        survivors = []
        for k, s in sorted(statuses.items()):
            if s in ("killed", "timeout", "not checked"):
                continue
            survivors.append({"mutant": k, "status": s, "diff": get_diff_for_mutant(k, path=f)})
        per_file[f] = {"mutants": len(statuses), "killed": killed,
                       "timeout": sum(s == "timeout" for s in statuses.values()),
                       "survived": sum(s == "survived" for s in statuses.values()),
                       "no_tests": sum(s == "no tests" for s in statuses.values()),
                       "not_checked": sum(s == "not checked" for s in statuses.values()),
                       "other": sum(s not in ("killed", "timeout", "survived", "no tests", "not checked")
                                    for s in statuses.values()),
                       # over the mutants checked: an interrupted run scores what it got to
                       "score": round(killed / checked, 4) if (checked := sum(s != "not checked" for s in
                                                                               statuses.values())) else None,
                       "survivors": survivors}
    return per_file


#: the committed summaries (one ``<target>.json`` per target, copied there by ``--record``) and, beside each, the
#: page that classifies its surviving mutants: what docs/testing.md's table is generated from
RECORDS = ROOT / "docs" / "mutation"


def recorded_targets() -> list[str]:
    """The targets whose records make the tables: every target but an alias (``fedavg``) and a target split into
    parts (its parts' records replace it: together they mutate its whole core, each function once)."""
    return [n for n in TARGETS if n != "fedavg" and not parts_of(n)]


def file_scores(out: Path) -> dict[str, dict]:
    """Per core file: mutants and killed summed over the records of :func:`recorded_targets` that mutate it (they
    share no function), with the targets and whether any mutant went unchecked."""
    files: dict[str, dict] = {}
    for name in recorded_targets():
        js = out / f"{name}.json"
        if not js.exists():
            continue
        s = json.loads(js.read_text())
        for f, r in s["files"].items():
            e = files.setdefault(f, {"mutants": 0, "killed": 0, "not_checked": 0, "targets": []})
            e["mutants"] += r["mutants"]
            e["killed"] += r["killed"]
            e["not_checked"] += r.get("not_checked", 0)
            e["targets"].append(s["target"])
    return files


def file_table(out: Path) -> str:
    """One row per core file, all its targets together: the score the tests issue asks of each file."""
    rows = ["| core file | mutants | killed | score | targets |", "|---|---|---|---|---|"]
    for f, e in sorted(file_scores(out).items()):
        checked = e["mutants"] - e["not_checked"]
        score = f"{100 * e['killed'] / checked:.1f}%" if checked else "-"
        unchecked = f" ({e['not_checked']} not checked)" if e["not_checked"] else ""
        rows.append(f"| `{f}` | {e['mutants']}{unchecked} | {e['killed']} | {score} | "
                    + ", ".join(f"[{t}]({t}.md)" if (out / f"{t}.md").exists() else t for t in e["targets"]) + " |")
    return "\n".join(rows)


def markdown_table(out: Path) -> str:
    """Per core file, then one row per core file of every target's summary under ``out``: what docs/testing.md
    shows."""
    rows = [file_table(out), "",
            "| file | target | mutants | killed | score | surviving mutants (no tests: no selected test runs it) | commit |",
            "|---|---|---|---|---|---|---|"]
    for js in sorted(out / f"{name}.json" for name in recorded_targets()):
        if not js.exists():
            continue
        s = json.loads(js.read_text())
        for f, r in s["files"].items():
            by_fn: dict = {}
            for sv in r["survivors"]:
                fn, _, num = sv["mutant"].rsplit(".", 1)[1].partition("__mutmut_")
                fn = fn[2:].replace("ǁ", ".")  # x_function, xǁClassǁmethod -> function, Class.method
                by_fn.setdefault((fn, sv["status"]), []).append(int(num))
            names = "; ".join(f"`{fn}` " + (f"all {len(nums)} (no tests)" if st == "no tests" else
                                            " ".join(f"#{n}" for n in sorted(nums)))
                              for (fn, st), nums in sorted(by_fn.items()))
            score = f"{100 * r['score']:.1f}%" if r["score"] is not None else "-"
            unchecked = f" ({r['not_checked']} not checked: run interrupted)" if r.get("not_checked") else ""
            page = f"[{s['target']}]({s['target']}.md)" if (out / f"{s['target']}.md").exists() else s["target"]
            rows.append(f"| `{f}` | {page} | {r['mutants']}{unchecked} | {r['killed']} | {score} | {names or '-'} | "
                        f"{s['commit'][:7]}{'+' if s['dirty'] else ''} |")
    return "\n".join(rows)


def mutated_functions(files: list[str]) -> dict[str, dict[str, int]]:
    """Per file: the mutmut key of every function mutmut mutates in it (``x_f``, ``xǁClassǁmethod``) -> its number
    of mutants. mutmut's own generator finds the mutations; the keys follow its trampolines (module functions and
    the methods of an indented class body; a mutation elsewhere is dropped), without rendering the mutated files."""
    import tempfile

    import libcst as cst
    from mutmut import configuration
    from mutmut.mutation.file_mutation import create_mutations, group_by_top_level_node

    out, cwd = {}, os.getcwd()
    with tempfile.TemporaryDirectory() as d:
        Path(d, "pyproject.toml").write_text(mutmut_config(files, [], None))
        os.chdir(d)  # mutmut reads its configuration from the working directory
        configuration.reset_config()
        try:
            for f in files:
                module, mutations, _, _ = create_mutations(f, (ROOT / f).read_text())
                by_node = group_by_top_level_node(mutations)
                counts: dict[str, int] = {}
                for st in module.body:
                    if isinstance(st, cst.FunctionDef) and by_node.get(st):
                        counts[f"x_{st.name.value}"] = len(by_node[st])
                    elif isinstance(st, cst.ClassDef) and isinstance(st.body, cst.IndentedBlock):
                        for fn in st.body.body:
                            if isinstance(fn, cst.FunctionDef) and by_node.get(fn):
                                counts[f"xǁ{st.name.value}ǁ{fn.name.value}"] = len(by_node[fn])
                out[f] = counts
        finally:
            os.chdir(cwd)
            configuration.reset_config()
    return out


def parts_of(parent: str) -> dict[str, Target]:
    """The narrow targets ``<parent>_<part>`` that split a target's core by function."""
    return {n: t for n, t in TARGETS.items() if n.startswith(parent + "_")}


def check_parts(parent: str, fns: dict[str, dict[str, int]] | None = None) -> list[str]:
    """What is wrong with the split of ``parent`` into its parts: a mutated function of its core that no part
    mutates or that two parts mutate, a part's core file outside the parent's, a part's function glob that matches
    nothing. Empty when every mutant of the parent is in exactly one part. ``fns``: :func:`mutated_functions` of the
    parent's core, if already computed."""
    core = expand(TARGETS[parent].core)
    parts = parts_of(parent)
    problems = [f"{n}: {f} is not in {parent}'s core" for n, t in parts.items() for f in expand(t.core) if f not in core]
    fns = fns if fns is not None else mutated_functions(core)
    for f, counts in fns.items():
        for fn in sorted(counts):
            owners = [n for n, t in parts.items() if f in expand(t.core)
                      and any(fnmatch.fnmatchcase(fn, g) for g in (t.functions or ["*"]))]
            if len(owners) != 1:
                problems.append(f"{f}: {fn} ({counts[fn]} mutants) is in " + (" and ".join(owners) if owners else
                                                                                "no part"))
    for n, t in parts.items():
        for g in t.functions or ["*"]:
            if not any(fnmatch.fnmatchcase(fn, g) for f in expand(t.core) for fn in fns.get(f, {})):
                problems.append(f"{n}: function {g!r} matches no mutated function of {' '.join(expand(t.core))}")
    return problems


def git(*args: str) -> str:
    r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter,
                                epilog="Targets:\n" + "\n".join(f"  {n:10s} {' '.join(t.core)}" for n, t in
                                                                TARGETS.items()))
    p.add_argument("target", nargs="?", help="a method / target (see --list) or one of their core files")
    p.add_argument("--tests", nargs="+", help="test files (globs) instead of the target's")
    p.add_argument("-k", help="pytest -k expression narrowing the tests")
    p.add_argument("--max-children", type=int, default=os.cpu_count() or 2, help="parallel mutant workers")
    p.add_argument("--resume", action="store_true", help="keep earlier results; retest only changed functions")
    p.add_argument("--out", default=str(ROOT / "outputs" / "mutation"), help="where the work dirs and json go")
    p.add_argument("--summarize", action="store_true",
                   help="summarize the target's last (possibly interrupted) run again, without running mutmut")
    p.add_argument("--list", action="store_true", help="print the target table and exit")
    p.add_argument("--table", action="store_true",
                   help="print the markdown table of the recorded summaries (docs/mutation/, or --records) and exit")
    p.add_argument("--records", default=str(RECORDS), help="where --record copies summaries and --table reads them")
    p.add_argument("--record", action="store_true",
                   help="after the run, copy its summary to --records (the committed scores docs/testing.md shows)")
    p.add_argument("--parts", metavar="TARGET",
                   help="check that the targets TARGET_<part> mutate every function of TARGET's core exactly once, "
                        "print each part's functions and mutants, and exit (1 if a function is left out or doubled)")
    a = p.parse_args(argv)
    if a.parts:
        if a.parts not in TARGETS or not parts_of(a.parts):
            print(f"error: --parts {a.parts!r}: no target with parts {a.parts}_<part>; see --list", file=sys.stderr)
            return 2
        fns = mutated_functions(expand(TARGETS[a.parts].core))
        for n, t in parts_of(a.parts).items():
            mine = {fn: c for f in expand(t.core) for fn, c in fns.get(f, {}).items()
                    if any(fnmatch.fnmatchcase(fn, g) for g in (t.functions or ["*"]))}
            print(f"{n}: {sum(mine.values())} mutants in {len(mine)} functions ({' '.join(expand(t.core))})")
        problems = check_parts(a.parts, fns)
        for line in problems:
            print("error: " + line, file=sys.stderr)
        print(f"{a.parts}: {sum(sum(c.values()) for c in fns.values())} mutants; "
              + ("every function in exactly one part" if not problems else f"{len(problems)} problem(s)"))
        return 1 if problems else 0
    if a.table:
        print(markdown_table(Path(a.records)))
        return 0
    if not a.list and not a.target:
        p.error("name a target: a method or one of its core files (--list shows them)")
    if a.list:
        for n, t in TARGETS.items():
            fn = f" (functions {', '.join(t.functions)})" if t.functions else ""
            k = f" -k {t.k!r}" if t.k else ""
            print(f"{n}: core {' '.join(expand(t.core))}{fn}\n    tests {' '.join(expand(t.tests))}{k}")
        return 0
    if a.max_children < 1:
        print("error: --max-children must be >= 1", file=sys.stderr)
        return 2
    if a.target in TARGETS and parts_of(a.target) and not (a.tests or a.k or a.summarize):
        # a target split into parts runs each part against its own tests (the whole core against every test of
        # every part would take hours), then reports the core's files with all parts together
        codes = []
        for part in parts_of(a.target):
            print(f"== {part}", flush=True)
            codes.append(main([part, "--max-children", str(a.max_children), "--out", a.out, "--records", a.records]
                              + ["--resume"] * a.resume + ["--record"] * a.record))
        print(file_table(Path(a.out)))
        return max(codes)
    if Path(a.target).suffix == ".py" and a.tests and a.target not in TARGETS:
        name, t = Path(a.target).stem, Target([os.path.relpath(Path(a.target).resolve(), ROOT)], a.tests)
    elif target_for(a.target):
        name, t = target_for(a.target)
    else:
        print(f"error: unknown target {a.target!r}: pass a method ({', '.join(TARGETS)}) or one of their core files "
              "(--list), or any file with --tests", file=sys.stderr)
        return 2
    tests = expand(a.tests or t.tests)
    core = expand(t.core)
    missing = [f for f in core + tests if not (ROOT / f.partition("::")[0]).is_file()]
    if missing or not tests:
        print(f"error: {'missing file(s): ' + ', '.join(missing) if missing else 'no test file matches'}; "
              "fix the table in scripts/mutation.py or pass --tests", file=sys.stderr)
        return 2
    out = Path(a.out)
    work = out / name
    k = a.k if a.k is not None else (None if a.tests else t.k)
    if a.summarize and not (work / "mutants").is_dir():
        print(f"error: --summarize: no earlier run of {name} under {out}; run it first", file=sys.stderr)
        return 2
    # one run per work dir: a second run's prepare() deletes and recreates it under the first, whose mutmut then
    # works in a deleted directory and dies on its next relative write (FileNotFoundError: mutants/<file>.meta)
    out.mkdir(parents=True, exist_ok=True)
    lock = open(out / f"{name}.lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"error: another scripts/mutation.py run of {name} is using {work}; wait for it to finish, or pass "
              "--out DIR to run beside it", file=sys.stderr)
        return 2
    if not a.summarize:
        prepare(work, core, tests, k, a.resume)
    globs = mutant_globs(Target(core, tests, t.functions))
    print(f"mutation testing {name}: core {' '.join(core)}; tests {' '.join(tests)} (-m {FAST!r}"
          + (f", -k {k!r})" if k else ")"), flush=True)
    start = time.time()
    commit = git("rev-parse", "HEAD")  # what mutmut copies now; the checkout may move on while it runs
    dirty = bool(git("status", "--porcelain", "--", *core, *[t.partition("::")[0] for t in tests]))
    log = out / f"{name}.log"
    if a.summarize:
        earlier = json.loads((out / f"{name}.json").read_text()) if (out / f"{name}.json").exists() else {}
        code, wall = earlier.get("mutmut_exit_code", 0), earlier.get("wall_s", 0.0)
    else:
        print(f"  (mutmut's full output: {log})", flush=True)
        code = run_mutmut(work, log, "--max-children", str(a.max_children), *globs)
        wall = time.time() - start
    per_file = summarize(work, core, globs)
    killed = sum(f["killed"] for f in per_file.values())
    total = sum(f["mutants"] - f["not_checked"] for f in per_file.values())  # checked
    summary = {"target": name, "core": core, "functions": t.functions, "tests": tests, "pytest_k": k,
               "commit": commit, "dirty": dirty,
               "mutmut_exit_code": code, "wall_s": round(wall, 1), "killed": killed, "total": total,
               "score": round(killed / total, 4) if total else None, "files": per_file}
    if a.summarize and earlier:  # the commit the mutants were run at
        summary.update(commit=earlier["commit"], dirty=earlier["dirty"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
    if a.record:
        Path(a.records).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out / f"{name}.json", Path(a.records) / f"{name}.json")
    print()
    for f, s in per_file.items():
        for sv in s["survivors"]:
            print(f"--- {sv['status']}: {sv['mutant']}\n{sv['diff'].rstrip()}\n")
    print(f"{'file':48s} {'mutants':>7s} {'killed':>6s} {'score':>6s} survived no-tests")
    for f, s in per_file.items():
        score = f"{100 * s['score']:.1f}%" if s["score"] is not None else "-"
        print(f"{f:48s} {s['mutants']:7d} {s['killed']:6d} {score:>6s} {s['survived']:8d} {s['no_tests']:8d}")
    print(f"{name}: killed {killed} / {total} mutants"
          + (f" = {100 * killed / total:.1f}%" if total else "") + f" in {wall:.0f} s; summary {out / (name + '.json')}")
    if code != 0:
        print(f"error: mutmut exited with {code} (its output: {log})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
