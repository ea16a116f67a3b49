"""Running a study: seeds x variants through the engine, one resumable row per (variant, seed), then the summary.

Rows live in ``<store>/<study>/rows.jsonl``, one JSON line each, written whole with one ``write`` and ``fsync``; a line
that does not end in a newline (an interrupted write) is cut off on the next load, so a partial row never counts.
A row whose key (its kind and full command line) no longer matches the spec is stale and runs again."""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

from . import claims as claims_mod
from . import controls


# ---------------------------------------------------------------------------------------------- provenance
def _git(*args) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    except Exception:  # noqa: BLE001 - not a checkout (an installed package): no commit to name
        return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def provenance() -> dict:
    """Where and with what a row was computed: commit (and whether the tree had changes), date, machine."""
    import torch
    commit = _git("rev-parse", "HEAD")
    # the study pages and stored rows are the runner's own output: a resumed study whose rows.jsonl is tracked and
    # growing was computed by clean code all the same
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no", "--", ":(top)",
                      ":(top,exclude)docs/results")) if commit else None
    return {"commit": commit, "dirty": dirty,
            "date": _now(),
            "cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
            # the kernel family torch dispatches to (AVX2, AVX512, ...): the same code gives rows that differ beyond
            # their last bits on CPUs of another family (CHANGELOG.md, the FRAug table), so a row names it
            "kernels": torch.backends.cpu.get_cpu_capability(),
            "python": platform.python_version()}


# ---------------------------------------------------------------------------------------------- rows
class RowStore:
    """``rows.jsonl`` of one study."""

    def __init__(self, store: str | Path, study: str):
        self.dir = Path(store) / study
        self.path = self.dir / "rows.jsonl"

    def load(self) -> list[dict]:
        """Every complete row (an unterminated last line is an interrupted write: it is removed)."""
        if not self.path.exists():
            return []
        raw = self.path.read_bytes()
        if raw and not raw.endswith(b"\n"):
            raw = raw[: raw.rfind(b"\n") + 1]
            with open(self.path, "r+b") as f:
                f.truncate(len(raw))
        rows = []
        for line in raw.decode().splitlines():
            if line.strip():
                rows.append(json.loads(line))
        return rows

    def append(self, row: dict) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        data = (json.dumps(row, sort_keys=True) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)


def current_rows(study, rows: list[dict]) -> dict:
    """(variant, seed) -> the latest stored row whose key matches the spec."""
    out = {}
    for r in rows:
        try:
            v = study.variant(r["variant"])
        except KeyError:
            continue
        if r.get("key") == study.row_key(v, r["seed"]):
            out[(r["variant"], r["seed"])] = r
    return out


# ---------------------------------------------------------------------------------------------- one row
def _load_recipe(path: str):
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"hfpfl_recipe_{Path(path).stem}", path)
    if spec is None or not Path(path).is_file():
        raise FileNotFoundError(f"recipe {path!r} not found; run from the repository root")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_engine(study, variant, seed: int, out_dir: Path) -> dict:
    """One trained row, exactly as ``hfpfl run <flags>`` (or the recipe named by ``--recipe``) computes it."""
    from ..cli import run_recipe
    argv = [*study.argv(variant, seed), "--output_dir", str(out_dir), "--overwrite_output_dir", "true",
            "--checkpoint_every", "0", "--progress", "false", "--num_processes", "1"]
    if variant.recipe:
        res = _load_recipe(variant.recipe).main(argv)
    else:
        res = run_recipe(argv=argv, top_level=False, after=_hook(variant.metrics_hook))
    return controls.row_from_results(res)


def _hook(spec: str | None):
    if not spec:
        return None
    import importlib
    module, _, name = spec.partition(":")
    if not name:
        raise ValueError(f"metrics_hook {spec!r}: write it as 'package.module:function'")
    return getattr(importlib.import_module(module), name)


def run_row(study, variant, seed: int, work_dir: Path, prov: dict | None = None) -> dict:
    """One row. ``prov``: the provenance of the code this process loaded (taken when the study started: a commit made
    while it runs does not change what runs); the date is the row's own."""
    out_dir = Path(work_dir) / f"{variant.name}-seed{seed}"
    t0 = time.perf_counter()
    if variant.kind == "run":
        fields = run_engine(study, variant, seed, out_dir)
    else:
        if variant.kind not in controls.RUNNERS:
            raise ValueError(f"study {study.name!r}: control kind {variant.kind!r} of {variant.name!r} has no "
                             f"runner; register one with hfpfl.experiments.controls.register (known: "
                             f"{', '.join(sorted(controls.RUNNERS))})")
        fields = controls.RUNNERS[variant.kind](study, variant, seed, out_dir)
    return {"study": study.name, "variant": variant.name, "seed": seed, "kind": variant.kind,
            "key": study.row_key(variant, seed), "argv": study.argv(variant, seed), **fields,
            "seconds": time.perf_counter() - t0,
            "provenance": {**(prov or provenance()), "date": _now(), "load": _load()}}


def _load() -> float | None:
    """The 1-minute load average when the row ended: on a shared box it says how far the runtime is inflated."""
    try:
        return round(os.getloadavg()[0], 1)
    except OSError:
        return None


def run_study(study, store, *, seeds=None, variants=None, work_dir=None, log=print) -> dict:
    """Run the missing rows (seeds x variants), then write ``summary.json`` and the figure. Returns the summary."""
    seeds = list(study.seeds if seeds is None else seeds)
    chosen = [study.variant(n) for n in variants] if variants else list(study.variants)
    rows = RowStore(store, study.name)
    have = current_rows(study, rows.load())
    todo = [(v, s) for s in seeds for v in chosen if (v.name, s) not in have]
    log(f"study {study.name}: {len(chosen) * len(seeds) - len(todo)} rows stored, {len(todo)} to run")
    work = Path(work_dir) if work_dir else Path("outputs") / "studies" / study.name
    prov = provenance() if todo else None
    for i, (v, s) in enumerate(todo, 1):
        row = run_row(study, v, s, work, prov)
        rows.append(row)
        log(f"[{i}/{len(todo)}] {v.name} seed {s}: "
            + ", ".join(f"{k} {row['metrics'][k]:.4f}" for k in study.metrics if k in row["metrics"])
            + f" ({row['seconds']:.0f} s)")
    return write_summary(study, store)


# ---------------------------------------------------------------------------------------------- summary
def mean_std(values: list[float]) -> dict:
    """Mean and SAMPLE standard deviation (n - 1 in the denominator; None for a single value)."""
    vals = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    n = len(vals)
    if n == 0:
        return {"mean": None, "std": None, "n": 0}
    mean = sum(vals) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in vals) / (n - 1)) if n > 1 else None
    return {"mean": mean, "std": std, "n": n}


def summarize(study, rows: dict) -> dict:
    """rows: (variant, seed) -> row. Per variant: every metric's mean / sample std / n / seeds / values, per-domain
    and per-client means of the personal accuracy, the budget per trained model (mean over seeds), wall time. Only
    the study's seeds count (a row run for another seed stays in rows.jsonl, outside the table)."""
    rows = {k: r for k, r in rows.items() if k[1] in study.seeds}
    variants = {}
    for v in study.variants:
        rs = sorted((r for (name, _), r in rows.items() if name == v.name), key=lambda r: r["seed"])
        if not rs:
            continue
        entry = {"kind": v.kind, "control": controls.is_control(v.kind), "label": v.title(), "paper": v.paper, "seeds": [r["seed"] for r in rs],
                 "metrics": {}, "per_domain": {}, "per_client": {}, "budget": {}}
        for m in sorted({k for r in rs for k in r.get("metrics", {})}):
            have = [r for r in rs if r["metrics"].get(m) is not None]
            entry["metrics"][m] = {**mean_std([r["metrics"][m] for r in have]), "seeds": [r["seed"] for r in have],
                                   "values": [r["metrics"][m] for r in have]}
        for part in ("per_domain", "per_client"):
            if part == "per_domain" and not study.per_domain:
                continue   # a partition that mixes domains: a client's "domain" is no domain the paper reports
            keys = sorted({k for r in rs for k in (r.get(part) or {})}, key=lambda k: (len(k), k))
            entry[part] = {k: mean_std([(r.get(part) or {}).get(k) for r in rs]) for k in keys}
        for k in ("optimizer_steps_per_model", "examples_seen_per_model", "epochs_per_model", "trained_models",
                  "rounds_used"):
            vals = [(r.get("budget") or {}).get(k) for r in rs]
            entry["budget"][k] = None if any(x is None for x in vals) else sum(vals) / len(vals)
            entry["budget"][k + "_varies"] = len({x for x in vals}) > 1
        entry["seconds"] = sum(r.get("seconds", 0.0) for r in rs)
        variants[v.name] = entry
    summary = {"study": study.name, "title": study.title, "paper": study.paper, "description": study.description,
               "primary": study.primary,
               "metrics": [[k, label] for k, label in study.metrics.items()],   # a list: the study's column order
               "order": [v.name for v in study.variants if v.name in variants], "seeds": list(study.seeds), "matched_by": study.matched_by,
               "common": list(study.common), "command": study.default_command(), "variants": variants}
    summary["claims"] = claims_mod.evaluate_all(study, summary)
    ours = [n for n in study.paper_ordering if n in variants and variants[n]["metrics"].get(study.primary)]
    summary["ordering"] = {"paper": list(study.paper_ordering),
                           "ours": sorted(ours, key=lambda n: -variants[n]["metrics"][study.primary]["mean"])}
    provs = [r["provenance"] for r in sorted(rows.values(), key=lambda r: (r["variant"], r["seed"]))
             if r.get("provenance")]
    summary["provenance"] = _merge_provenance(provs)
    summary["seconds"] = sum(e["seconds"] for e in variants.values())
    return summary


def _merge_provenance(provs: list[dict]) -> dict:
    if not provs:
        return {}
    def distinct(k):
        return sorted({str(p.get(k)) for p in provs})
    dates = sorted(p["date"] for p in provs)
    loads = sorted(p["load"] for p in provs if p.get("load") is not None)
    machines = sorted({f"{p['cpu']}, {p['cores']} cores" + (f", {p['kernels']} kernels" if p.get("kernels") else "")
                       for p in provs})
    return {**({"load": [loads[0], loads[-1]]} if loads else {}),
            "commits": distinct("commit"), "dirty": any(p.get("dirty") for p in provs),
            "dates": [dates[0], dates[-1]], "machines": machines,
            "torch": distinct("torch"), "python": distinct("python")}


def write_summary(study, store) -> dict:
    rows = RowStore(store, study.name)
    summary = summarize(study, current_rows(study, rows.load()))
    rows.dir.mkdir(parents=True, exist_ok=True)
    _atomic_write(rows.dir / "summary.json", json.dumps(summary, indent=1, sort_keys=True) + "\n")
    if summary["variants"]:
        write_figure(study, summary, rows.dir / f"{study.name}.png")
    return summary


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)   # mkstemp's 0600 would make a committed summary private to its writer
    os.replace(tmp, path)


def write_figure(study, summary: dict, path: Path) -> None:
    """The primary metric per trained variant (mean, sample-std error bars), controls as horizontal lines."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    m = study.primary
    runs = [(n, e) for n, e in summary["variants"].items() if not e["control"] and m in e["metrics"]]
    ctrl = [(n, e) for n, e in summary["variants"].items() if e["control"] and m in e["metrics"]]
    fig, ax = plt.subplots(figsize=(1.6 + 1.0 * max(1, len(runs)), 3.4))
    xs = range(len(runs))
    ax.bar(xs, [e["metrics"][m]["mean"] for _, e in runs], yerr=[e["metrics"][m]["std"] or 0 for _, e in runs],
           capsize=4, color="tab:blue")
    ax.set_xticks(list(xs), [e["label"] for _, e in runs], rotation=20, ha="right")
    styles = ["--", ":", "-."]
    for i, (_, e) in enumerate(ctrl):
        ax.axhline(e["metrics"][m]["mean"], color="gray", ls=styles[i % 3], label=e["label"])
    ax.set_ylabel(study.metrics[m])
    ax.set_title(study.title, fontsize=9)
    if ctrl:
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- verify
def verify(study, variant_name: str, seed: int, store, *, tolerance: float = 1e-6, work_dir=None) -> tuple[bool, list]:
    """Re-run one stored row and compare each of the study's metrics with the stored value (absolute tolerance)."""
    v = study.variant(variant_name)
    stored = current_rows(study, RowStore(store, study.name).load()).get((v.name, seed))
    if stored is None:
        raise ValueError(f"verify: no stored row for {v.name!r} seed {seed} in {Path(store) / study.name}; "
                         f"run `python -m hfpfl.experiments run {study.name} --seeds {seed}` first")
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        new = run_row(study, v, seed, Path(tmp))
    checks = []
    for m in study.metrics:
        a, b = stored["metrics"].get(m), new["metrics"].get(m)
        if a is None and b is None:
            continue
        ok = a is not None and b is not None and abs(a - b) <= tolerance
        checks.append({"metric": m, "stored": a, "now": b, "ok": ok})
    return all(c["ok"] for c in checks) and bool(checks), checks


def borrow_rows(source, study, store: str) -> list[str]:
    """Copy into ``study``'s store the rows of ``source`` whose row key (kind, recipe, full flags, metrics hook)
    equals one of ``study``'s (variant, seed) keys: the same computation, already stored. Each copied row keeps its
    provenance and names its source (``borrowed_from``); rows ``study`` already holds are left alone."""
    have = {r["key"]: r for r in current_rows(source, RowStore(store, source.name).load()).values()}
    dst = RowStore(store, study.name)
    mine = current_rows(study, dst.load())
    done = []
    for v in study.variants:
        for s in study.seeds:
            row = have.get(study.row_key(v, s))
            if (v.name, s) in mine or row is None:
                continue
            dst.append({**row, "study": study.name, "variant": v.name,
                        "borrowed_from": f"{source.name}/{row['variant']}"})
            done.append(f"{study.name}: {v.name} seed {s} <- {source.name}/{row['variant']}")
    return done
