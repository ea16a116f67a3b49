"""The FedBiP comparison behind ``recipes/fedbip.py``: argument parsing, the variant runner, the table printer and the
mean +- std aggregation over seeds (the recipe itself only calls :func:`main`).

Default setting (feature-space heterogeneity, the paper's §5.1 scaled down): 3 clients, one Digits domain each among
``usps``, ``mnistm``, ``syn`` (source ``digits-nomnist``), ``shots_per_class`` real train images per class per client,
each client's own real test split for per-domain accuracy, and the global test set. The frozen tiny LDM
(``hfpfl/tiny-ldm-digits-broad``, pretrained on the broad public pool of :mod:`hfpfl.fedbip.pool`; the snapshot ships
with hfpfl, see :data:`hfpfl.fedbip.ldm.SHIPPED_LDM_DIRS`) is published to the local Hub cache on first use.

Seeds: ``--seed`` (or ``--seeds 0,1,2`` for mean +- std) drives the few-shot draw of every client's images, the
latents, the concepts, the synthesis and the classifier. The *data split* seed of the built-in sources stays at
``--data_seed 0``: the LDM's pool is the public split of that seed, so a client split of another seed could overlap
it (the pool must share nothing with the clients).

With ``--compare true`` (default) every variant is one ``Simulation`` on the same federated data and the same
classifier recipe (model, optimizer, lr, batch, epochs), and one table + ``comparison.json`` report:
  prompt-only | V-only | S-only | concept-only | instance-only | FedBiP-S (2x) | FedBiP-L (10x)   (paper Table 3 / 1)
  [+ FedBiP-M (5x), FedBiP-S without S perturbation with --all_variants]
  FedAvg (multi-round, real data) | Local-only | Central (oracle: the classifier on the union of the train sets).
Ablations synthesise ``--multiplier`` (default 10) images per real image, FedBiP-L's amount: the paper's Table 3's
full-FedBiP row is Table 1's FedBiP-L (PACS 62.67 and OfficeHome 61.52 in both tables), so its ablation rows are
read at 10x.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from hfpfl.options import Check, at_least, option

logger = logging.getLogger("hfpfl")

DEFAULTS = {
    # data: feature-space heterogeneity, few shots; the LDM saw each domain's *public* split among many styles, under
    # generic captions only (within reach, not renderable from words: the SD-vs-DomainNet relation)
    "dataset": "digits-nomnist", "partition": "feature_shift", "num_clients": 3, "max_per_domain": 400,
    "test_fraction": 0.5, "image_size": 32,
    # few shots per class (the paper: 16), drawn by the run seed; the split itself at data seed 0: the tiny LDM's
    # pretraining pool is the public split of data seed 0 and must share nothing with the clients
    "shots_per_class": 5, "data_seed": 0,
    # classifier recipe shared by every variant (random-init tiny ResNet: the pretrained tiny backbone
    # hfpfl/tiny-resnet-digits was trained on labelled digits of these very domains)
    "method": "fedbip", "model": "tiny-resnet", "optimizer": "sgd", "lr": 0.05, "momentum": 0.9, "batch_size": 32,
    "checkpoint_every": 0,  # output_dir default: outputs/fedbip-<timestamp> (hfpfl.runtime)
    # FedBiP, scaled down for 2 CPU cores (paper: 50 concept epochs, 50 classifier epochs; steps and guidance are
    # not stated in the paper). 20 PNDM steps (the authors' validation setting in their train.py; the steps the shipped LDM's
    # plain-prompt fidelity was certified at) and guidance 3, chosen on the public judge's fidelity of FedBiP-L's
    # synthetic set (no client test data): guidance 1 / 10 steps 0.414 and 5 / 10 0.361 (seeds 0-2), seed 0
    # probes 1 / 20 0.382 and 3 / 20 0.661 (CHANGELOG.md). Concepts stay randomly
    # initialised as in the paper (the authors' code initialises them from words: --concept_init words, 0.739 at 3 / 20).
    "concept_epochs": 20, "classifier_epochs": 20, "num_inference_steps": 20, "guidance_scale": 3.0,
    # the ablation rows (and a --compare false run) at FedBiP-L's 10x: the paper's Table 3 compares its ablations with the
    # full FedBiP at 10x (its full row equals Table 1's FedBiP-L); FedBiP-S / -M / -L set their own 2 / 5 / 10
    "multiplier": 10,
    # the tiny LDM was pretrained on captions "a [style word] photo of the digit seven": a Table-5-style template
    "prompt_template": "a [S] photo of the digit [V]",
}


def _seed_list(text) -> bool:
    if not str(text).strip():  # empty: the single --seed
        return True
    parts = [x.strip() for x in str(text).split(",")]
    return all(x.isdigit() and int(x) < 2 ** 32 for x in parts)


@dataclass
class RecipeArguments:
    compare: bool = option(True, "Run the comparison (ablations, FedBiP-S/L, FedAvg, Local-only, Central) and print one "
                           "table; false = only the configured FedBiP run.")
    all_variants: bool = option(False, "Also FedBiP-M (5x) and FedBiP-S without the perturbation of S (slower); "
                                "needs --compare true.")
    seeds: str | None = option(None, "Comma-separated run seeds (e.g. 0,1,2): the comparison per seed under "
                               "<output_dir>/seed<k>/, then a mean +- std table (summary.json); needs --compare true. "
                               "Default: the single --seed.",
                               check=Check(_seed_list, "comma-separated whole numbers in [0, 2**32), e.g. 0,1,2"))
    variants: str | None = option(None, "Comma-separated subset of the comparison's rows to run, e.g. prompt-only,"
                                  "instance-only,FedBiP-S,FedBiP-L,FedAvg,Local-only,Central (default: all); needs "
                                  "--compare true. syn-fid needs Central.")
    baseline_rounds: int | None = option(None, "Rounds of FedAvg / Local-only (1 local epoch each) and Central epochs; "
                                         "default = classifier_epochs, so every classifier sees its training data "
                                         "the same number of epochs; needs --compare true.", check=at_least(1))


#: options that shape the comparison only: set under --compare false they would be ignored
COMPARISON_ONLY = ("all_variants", "seeds", "variants", "baseline_rounds")


def check_recipe_options(rec: RecipeArguments) -> None:
    if not rec.compare:
        defaults = RecipeArguments()
        for name in COMPARISON_ONLY:
            if getattr(rec, name) != getattr(defaults, name):
                raise ValueError(f"--{name} shapes the comparison, which --compare false does not run; pass "
                                 f"--compare true, or leave --{name} out")


def check_words(cfg, num_clients: int, num_new_clients: int = 0, num_labels: int | None = None) -> None:
    """--domain_words: one word (every client) or one per client; --class_words: one per class (``num_labels``,
    when known). One line naming the option and the count it needs."""
    for name, value in (("domain_words", cfg.domain_words), ("class_words", cfg.class_words)):
        if value and any(not w.strip() for w in value.split(",")):
            raise ValueError(f"--{name} has an empty word in {value!r}; pass comma-separated words, e.g. "
                             f"{'usps,mnistm,syn' if name == 'domain_words' else 'zero,one,...'}")
    if cfg.domain_words:
        n = len(cfg.domain_words.split(","))
        allowed = sorted({1, num_clients, num_clients + num_new_clients})
        if n not in allowed:
            raise ValueError(f"--domain_words has {n} words for {num_clients} clients; pass one word for every "
                             f"client or one per client ({' or '.join(map(str, allowed))} words)")
    if cfg.class_words and num_labels is not None:
        n = len(cfg.class_words.split(","))
        if n != num_labels:
            raise ValueError(f"--class_words has {n} words but the data has {num_labels} classes; pass "
                             f"{num_labels} comma-separated words, one per class in label order")


def builtin_num_labels(dataset: str) -> int | None:
    """The number of classes of a built-in source (known without loading it); None for other sources."""
    from hfpfl.data.sources import DIGIT_NAMES, SOURCES, _parse_name

    return len(DIGIT_NAMES) if _parse_name(dataset)[0] in SOURCES else None


def parse(argv=None):
    """The run, data, FedBiP and recipe options, by hfpfl's one parser (--config files, HFPFL_NUM_PROCESSES, the
    declared checks), then the checks that read several of them. Every bad value is one ValueError line."""
    from hfpfl.config import parse_run_args

    run, data, cfg, rec = parse_run_args(argv, method="fedbip", prog="recipes/fedbip.py",
                                         description=__doc__.split("\n")[0], defaults=DEFAULTS,
                                         recipe_options=RecipeArguments)
    if run.method != "fedbip":
        raise ValueError(f"recipes/fedbip.py runs FedBiP (got --method {run.method}); use recipes/run.py otherwise")
    check_recipe_options(rec)
    check_words(cfg, data.num_clients, data.num_new_clients, builtin_num_labels(data.dataset))
    return run, data, cfg, rec


def variants(run, cfg, rec):
    """(name, run_args, method_config) for every row of the comparison."""
    from hfpfl.algorithms.central import CentralConfig

    out_root = Path(run.output_dir)
    base = dict(overwrite_output_dir=True, checkpoint_every=0)
    one = dict(num_rounds=1)
    rounds = rec.baseline_rounds or cfg.classifier_epochs

    def fb(name, **kw):
        return (name, dataclasses.replace(run, output_dir=str(out_root / name), **base, **one),
                dataclasses.replace(cfg, **kw))

    rows = [fb("prompt-only", personalization="none"), fb("V-only", personalization="class"),
            fb("S-only", personalization="domain"), fb("concept-only", personalization="concept"),
            fb("instance-only", personalization="instance"), fb("FedBiP-S", personalization="full", multiplier=2)]
    if rec.all_variants:
        rows += [fb("FedBiP-S-no-perturb", personalization="full", multiplier=2, concept_noise_sigma=0.0),
                 fb("FedBiP-M", personalization="full", multiplier=5)]
    rows.append(fb("FedBiP-L", personalization="full", multiplier=10))

    def baseline(name, method, **kw):
        return (name, dataclasses.replace(run, method=method, output_dir=str(out_root / name), **{**base, **kw}),
                None)

    rows += [baseline("FedAvg", "fedavg", num_rounds=rounds, local_epochs=1, local_steps=None),
             baseline("Local-only", "local", num_rounds=rounds, local_epochs=1, local_steps=None)]
    rows.append(("Central", dataclasses.replace(run, method="central", output_dir=str(out_root / "Central"), **base,
                                                 **one),
                 CentralConfig(epochs=cfg.classifier_epochs)))
    if rec.variants:
        wanted = [v.strip() for v in rec.variants.split(",") if v.strip()]
        unknown = sorted(set(wanted) - {r[0] for r in rows})
        if unknown:
            raise ValueError(f"--variants: unknown {', '.join(unknown)}; choose among {', '.join(r[0] for r in rows)}")
        rows = [r for r in rows if r[0] in wanted]
    return rows


@contextlib.contextmanager
def variant_folder(path):
    """A variant's folder exists only as a finished run: if the variant is interrupted (Ctrl-C, SIGTERM) or fails
    before its ``results.json`` is written, the folder it created is removed again (a folder that existed before is
    left alone), so that a killed comparison leaves no folder that looks like a started run. SIGKILL cannot be
    caught; the LDM's pretraining (the long first step) runs before any variant folder is created."""
    out = Path(path)
    existed = out.exists()
    try:
        yield out
    except BaseException:
        if not existed and out.is_dir() and not (out / "results.json").exists():
            import shutil  # the folder did not exist before this variant: everything in it is this variant's

            shutil.rmtree(out, ignore_errors=True)
        raise


def summarize(name, sim, res, cfg, mia: dict | None = None) -> dict:
    """One row of the comparison; ``mia``: the real-data baselines' membership-inference gap
    (:func:`~hfpfl.fedbip.privacy.membership_inference_gap`, which every process computes together)."""
    final = res["final"]
    row = {"variant": name, "method": res["method"], "mean_accuracy": final.get("personal_accuracy"),
           "global_accuracy": final.get("global_accuracy"), "per_domain": res["per_domain_accuracy"],
           "bytes_up": res["communication"]["bytes_up"], "bytes_down": res["communication"]["bytes_down"],
           "wall_time_s": res["wall_time_s"]}
    if res["method"] == "fedbip":
        row.update({"personalization": cfg.personalization, "multiplier": cfg.multiplier,
                    "num_synthetic": final.get("num_synthetic")})
        for k in ("mia_loss_gap", "mia_entropy_gap", "syn_nn_dist_mean", "syn_nn_dist_min", "real_test_nn_dist_mean"):
            row[k] = final.get(k)
    else:  # the same MIA measure for the real-data baselines
        row.update(mia or {})
    return row


def format_comparison(rows: list[dict]) -> str:
    domains = sorted({d for r in rows for d in r["per_domain"]})
    head = (f"{'variant':<20} " + " ".join(f"{d[:8]:>8}" for d in domains) +
            f" {'mean':>6} {'global':>6} {'#syn':>5} {'syn-fid':>7} {'judge':>6} {'style':>6} {'up KiB':>8}"
            f" {'MIA-loss':>8} {'MIA-ent':>7}"
            f" {'NN-dist':>7}"
            f" {'time s':>6}")
    lines = [head, "-" * len(head)]

    def f(v, w, p=3):
        return f"{v:>{w}.{p}f}" if isinstance(v, (int, float)) and v is not None else f"{'-':>{w}}"

    for r in rows:
        lines.append(f"{r['variant']:<20} " + " ".join(f(r["per_domain"].get(d), 8) for d in domains) +
                     f" {f(r['mean_accuracy'], 6)} {f(r['global_accuracy'], 6)}"
                     f" {(str(r.get('num_synthetic')) if r.get('num_synthetic') else '-'):>5}"
                     f" {f(r.get('synthetic_fidelity'), 7)} {f(r.get('synthetic_fidelity_judge'), 6)}"
                     f" {f(r.get('synthetic_style'), 6)}"
                     f" {r['bytes_up'] / 1024:>8.1f} {f(r.get('mia_loss_gap'), 8)} {f(r.get('mia_entropy_gap'), 7)}"
                     f" {f(r.get('syn_nn_dist_mean'), 7)} {r['wall_time_s']:>6.1f}")
    lines.append("accuracy per domain = the classifier on that client's real test split; mean = over clients; "
                 "syn-fid = accuracy of the Central (real-data) classifier on the variant's synthetic set (are the "
                 "images of their label?); judge = the same read by the LDM's quality judge (trained on public "
                 "images only, shipped as judge.pt; '-' when the LDM has none); style = share of each client's "
                 "synthetic images that a domain classifier trained on the domains' public splits assigns to the "
                 "client's domain (mean over clients); MIA gaps = |member - non-member| "
                 "mean loss / entropy (lower = less leakage); NN-dist = RMS pixel distance of synthetic images to "
                 "the nearest client train image")
    return "\n".join(lines)


PAPER_ORDER = ("the paper's Table 3: prompt-only < V-only < S-only < instance-only < instance+concept (no perturb.) < FedBiP; "
               "Table 1: FedBiP-S < -M < -L, FedBiP-L above FedAvg on average, below Central")


@functools.lru_cache(maxsize=2)
def _style_judge(image_size: int):
    import torch

    from .quality import train_style_judge

    with torch.random.fork_rng(devices=[]):  # seeds its own training: the variants' random draws stay as they were
        judge, acc = train_style_judge(image_size)
    logger.info("style judge (domain classifier on the public splits): held-out accuracy %.3f", acc)
    return judge


def shared_style_judge(image_size: int, client_domains: dict) -> "torch.nn.Module | None":
    """The style judge of :func:`~hfpfl.fedbip.quality.train_style_judge` at the clients' image size, trained once per
    process (a few seconds; every seed of a comparison reuses it); None when no client's domain is one it knows."""
    from .quality import STYLE_DOMAINS

    if not any(d in STYLE_DOMAINS for d in client_domains.values()):
        return None
    return _style_judge(int(image_size))


def run_comparison(run, data, cfg, rec, fed, main: bool = True) -> dict:
    """Every variant on the same federated data; returns {"rows": [...], ...} and writes comparison.json.
    ``main=False`` (a worker process of a several-process run): the variants run (the clients this process holds),
    nothing is read from the synthetic sets (they live on the main process), printed or written."""
    from hfpfl import tracking
    from hfpfl.federated.engine import Simulation
    from hfpfl.federated.training import TensorData, evaluate

    from hfpfl.algorithms.fedbip import resolve_ldm

    t0 = time.perf_counter()
    rows, main_res, syn_sets = [], None, {}
    main_name = {2: "FedBiP-S", 5: "FedBiP-M", 10: "FedBiP-L"}.get(cfg.multiplier, "FedBiP-L")
    # the LDM first (on a first run: minutes of pretraining), before any variant folder exists
    from .quality import load_ldm_judge

    judge = load_ldm_judge(resolve_ldm(cfg.ldm))
    style_judge = shared_style_judge(data.image_size, {c.client_id: c.domain for c in fed.clients}) if main else None
    for name, r_args, m_cfg in variants(run, cfg, rec):
        t = time.perf_counter()
        with variant_folder(r_args.output_dir):
            sim = Simulation(r_args, data, m_cfg, fed_data=fed)
            res = sim.run()
        mia = None
        if res["method"] != "fedbip":  # every process: each scores the clients (and private states) it holds
            from hfpfl.fedbip.privacy import membership_inference_gap

            mia = membership_inference_gap(sim.algorithm, sim.server_state, sim.args.num_rounds)
        if not main:
            continue
        rows.append(summarize(name, sim, res, m_cfg, mia))
        if res["method"] == "fedbip":
            syn = syn_sets[name] = sim.algorithm.synthetic
            x = syn["images"].expand(-1, 3, -1, -1) if syn["images"].shape[1] == 1 else syn["images"]  # judges: RGB
            if judge is not None:  # a second, client-independent reading of the synthetic labels
                from .quality import judge_accuracy

                rows[-1]["synthetic_fidelity_judge"] = judge_accuracy(judge, x, syn["labels"])
            if style_judge is not None:  # are a client's synthetic images in its domain (the grids' style, read)
                from .quality import style_fidelity

                style = style_fidelity(style_judge, x, syn["clients"], {c.client_id: c.domain for c in fed.clients})
                rows[-1]["synthetic_style"] = style.pop("mean", None)
                rows[-1]["synthetic_style_per_domain"] = style
        if name == "Central":  # class fidelity of every synthetic set: the real-data oracle's accuracy on it
            model = sim.algorithm.load_global(sim.server_state)
            for row in rows:
                if row["variant"] in syn_sets:
                    s_ = syn_sets[row["variant"]]
                    row["synthetic_fidelity"] = evaluate(model, TensorData(s_["images"], s_["labels"]),
                                                         device=sim.device)["accuracy"]
        print(f"[{name}] mean accuracy {res['final'].get('personal_accuracy'):.4f} "
              f"({time.perf_counter() - t:.1f} s)", flush=True)
        if name == main_name:
            main_res = res
    if not main:
        return {"rows": rows}
    out = Path(run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    total = time.perf_counter() - t0
    comparison = {"rows": rows, "wall_time_s": total, "shots_per_class": data.shots_per_class, "seed": run.seed,
                  "config": {"run": dataclasses.asdict(run), "data": dataclasses.asdict(data),
                             "fedbip": dataclasses.asdict(cfg), "recipe": dataclasses.asdict(rec)}}
    tracking.atomic_write_text(out / "comparison.json", json.dumps(comparison, indent=2))
    if main_res is not None:
        tracking.write_results(out, {**main_res, "comparison": rows, "wall_time_total_s": total})
    tracking.write_config(out, run=run, data=data, method=cfg, recipe=rec)
    print(format_comparison(rows))
    print(f"wall time {total:.1f} s; comparison: {out / 'comparison.json'}; grids: {out}/FedBiP-*/synthetic_grid.png")
    return comparison


def aggregate_seeds(comparisons: list[dict]) -> list[dict]:
    """mean / std over seeds of every row's mean accuracy, global accuracy and synthetic fidelity."""
    import numpy as np

    names = [r["variant"] for r in comparisons[0]["rows"]]
    out = []
    for name in names:
        rows = [next(r for r in c["rows"] if r["variant"] == name) for c in comparisons]
        agg = {"variant": name, "seeds": [c["seed"] for c in comparisons]}
        for k in ("mean_accuracy", "global_accuracy", "synthetic_fidelity", "synthetic_fidelity_judge",
                  "synthetic_style"):
            vals = [r.get(k) for r in rows if r.get(k) is not None]
            if vals:
                agg[k] = float(np.mean(vals))
                agg[k + "_std"] = float(np.std(vals))
                agg[k + "_all"] = vals
        domains = sorted({d for r in rows for d in r["per_domain"]})
        agg["per_domain"] = {d: float(np.mean([r["per_domain"][d] for r in rows])) for d in domains}
        out.append(agg)
    return out


def claims(summary: list[dict]) -> list[tuple[str, bool | None]]:
    """The issue's acceptance checks on the mean over seeds: True (held), False (not held) or None (not measured: a
    row it reads was not run, e.g. ``--variants`` without FedAvg, or a field the run has not got, e.g. the
    Central-classifier fidelity without Central)."""
    m = {r["variant"]: r for r in summary}

    def value(variant, key="mean_accuracy"):
        return m.get(variant, {}).get(key)

    def check(test, *needed):
        vals = [value(*n) if isinstance(n, tuple) else value(n) for n in needed]
        return None if any(v is None for v in vals) else bool(test(*vals))

    # accuracies are fractions of the test-set size: a mean exactly on a line must not fail by float rounding
    # (0.6373... vs 0.5873... + 0.05 differ by 1e-16 in floats and by nothing as fractions)
    tol = 1e-9
    return [("FedBiP-L >= prompt-only + 0.05", check(lambda fl, p: fl >= p + 0.05 - tol, "FedBiP-L", "prompt-only")),
            ("FedBiP-L >= FedBiP-S", check(lambda fl, s: fl >= s - tol, "FedBiP-L", "FedBiP-S")),
            ("instance-only > prompt-only", check(lambda i, p: i > p, "instance-only", "prompt-only")),
            ("FedBiP-L synthetic fidelity >= 0.6", check(lambda f: f >= 0.6, ("FedBiP-L", "synthetic_fidelity"))),
            ("FedBiP-L synthetic fidelity >= 0.6 under the LDM's public-image judge",
             check(lambda f: f >= 0.6, ("FedBiP-L", "synthetic_fidelity_judge"))),
            ("FedBiP-L > FedAvg (paper, on average)", check(lambda fl, a: fl > a, "FedBiP-L", "FedAvg")),
            ("FedBiP-L < Central (paper)", check(lambda fl, c: fl < c, "FedBiP-L", "Central"))]


def format_summary(summary: list[dict]) -> str:
    domains = sorted({d for r in summary for d in r["per_domain"]})
    head = (f"{'variant':<20} {'mean acc':>15} {'syn-fid':>15} {'judge-fid':>15} {'style':>15} " +
            " ".join(f"{d[:8]:>8}" for d in domains))
    lines = [head, "-" * len(head)]

    def pm(r, k):
        return f"{r[k]:.3f} ± {r[k + '_std']:.3f}" if k in r else "-"

    for r in summary:
        lines.append(f"{r['variant']:<20} {pm(r, 'mean_accuracy'):>15} {pm(r, 'synthetic_fidelity'):>15} "
                     f"{pm(r, 'synthetic_fidelity_judge'):>15} {pm(r, 'synthetic_style'):>15} " +
                     " ".join(f"{r['per_domain'][d]:>8.3f}" for d in domains))
    lines.append(f"seeds {summary[0]['seeds']}; paper ordering: {PAPER_ORDER}")
    for text, ok in claims(summary):
        word = "not measured" if ok is None else "held" if ok else "NOT held"
        lines.append(f"  {word:<12}  {text}")
    return "\n".join(lines)


def main(argv=None):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from hfpfl.cli import USER_ERRORS, _setup_logging, fail
    from hfpfl.runtime import Interrupted, interruptible

    _setup_logging(diffusers=True)  # loads LDM pipelines: their loading bars off a terminal too
    from hfpfl.cli import worker_exits

    started: dict = {}  # output_dir once resolved, and whether it existed before this run
    workers: list = []  # hfpfl.launch.Workers once --num_processes forked this process
    try:
        with worker_exits(workers), interruptible():
            try:
                return _main(argv, started, workers)
            except USER_ERRORS as e:  # every process meets the same bad input: each exits 2, the main one says it
                if started.get("output_dir") and not started.get("existed"):
                    remove_empty_dirs(started["output_dir"])  # found by a variant's set-up: no empty folder stays
                fail(e)
    except KeyboardInterrupt as e:
        if started.get("output_dir") and not started.get("existed"):
            remove_empty_dirs(started["output_dir"])  # unfinished variants removed themselves (variant_folder)
        print(f"interrupted ({e}): finished variants keep their folders; unfinished ones were removed",
              file=sys.stderr, flush=True)
        raise SystemExit(128 + (e.signum if isinstance(e, Interrupted) else 2)) from None


def remove_empty_dirs(root) -> None:
    """Remove every empty folder under ``root`` (and ``root`` itself if it ends empty); files are never touched."""
    root = Path(root)
    if not root.is_dir():
        return
    for d, _, _ in os.walk(root, topdown=False):  # children before parents
        try:
            os.rmdir(d)  # only succeeds on an empty folder
        except OSError:
            pass


def _main(argv, started: dict, workers: list):
    import torch

    from hfpfl import tracking
    from hfpfl.algorithms.fedbip import resolve_ldm
    from hfpfl.cli import _processes_to_launch, format_table, start_processes
    from hfpfl.data import build_federated_dataset
    from hfpfl.data.federated import few_shot
    from hfpfl.federated.engine import Simulation
    from hfpfl.runtime import check_output_dir, resolve_output_dir  # the one output-folder rule

    run, data, cfg, rec = parse(argv)
    run = dataclasses.replace(run, output_dir=resolve_output_dir(run.output_dir, "fedbip"))
    started.update(output_dir=run.output_dir, existed=Path(run.output_dir).exists())
    if rec.compare:  # a finished comparison (results.json) is reused only with --overwrite_output_dir
        variants(run, cfg, rec)  # a bad --variants fails here, before minutes of work
        check_output_dir(run.output_dir, overwrite=run.overwrite_output_dir, resume=False)
    resolve_ldm(cfg.ldm)  # a first run pretrains and publishes the tiny LDM here: once, before any fork
    # every variant in N processes: the clients (their training and the synthesis of their images) spread over them;
    # decided on one FedBiP variant as it runs (one round: the run's --num_rounds is not what a variant trains)
    start_processes(_processes_to_launch(dataclasses.replace(run, num_rounds=1), data, top_level=argv is None),
                    workers, run.output_dir)
    main = int(os.environ.get("RANK", "0")) == 0  # a worker (forked or launched): no prints, no files
    torch.set_num_threads(max(1, run.num_threads))
    # the split once (fixed by --data_seed); each seed's few-shot draw from it
    split = build_federated_dataset(dataclasses.replace(data, shots_per_class=None), seed=run.seed)
    # a source whose classes are known only once loaded (a Hub dataset): the class words checked here, before any
    # folder or file is written
    check_words(cfg, len(split.clients), len(split.new_clients), split.num_labels)
    if not rec.compare:
        fed = few_shot(split, data.shots_per_class, run.seed)
        if main:
            print(fed.summary(), flush=True)
        res = Simulation(run, data, cfg, fed_data=fed).run()
        if main:
            print(format_table(res))
            print(f"results: {os.path.join(run.output_dir, 'results.json')}")
        return res
    seeds = [int(x) for x in rec.seeds.split(",")] if rec.seeds and rec.seeds.strip() else [run.seed]
    comparisons = []
    for seed in seeds:
        # one seed (--seeds 1 alone) runs in output_dir itself, but with that seed everywhere, not only in the
        # few-shot draw
        r = dataclasses.replace(run, seed=seed) if len(seeds) == 1 else dataclasses.replace(
            run, seed=seed, output_dir=str(Path(run.output_dir) / f"seed{seed}"))
        fed = few_shot(split, data.shots_per_class, seed)
        if main:
            print(fed.summary(), flush=True)
        comparisons.append(run_comparison(r, data, cfg, rec, fed, main))
    if len(seeds) == 1 or not main:
        return comparisons[0] if len(seeds) == 1 else {"comparisons": comparisons}
    summary = aggregate_seeds(comparisons)
    out = Path(run.output_dir)
    tracking.atomic_write_text(out / "summary.json", json.dumps(
        {"summary": summary, "claims": [{"claim": t, "held": ok} for t, ok in claims(summary)],
         "paper_order": PAPER_ORDER}, indent=2))
    print(format_summary(summary))
    print(f"summary: {out / 'summary.json'}")
    return {"summary": summary, "comparisons": comparisons}
