#!/usr/bin/env python
"""FedDAT vs its baselines on the easy-vqa splits, over seeds: the claims of spec 2.11 (a)-(e).

    python scripts/compare_feddat.py                                  # ViLT, function/scene/domain, seeds 0 1 2
    python scripts/compare_feddat.py --backbone blip --seeds 0 --splits scene
    python scripts/compare_feddat.py --from_runs                      # only summarise the runs already there
    python scripts/compare_feddat.py --methods feddat vqa_adapter vqa_peft:lora vqa_peft:bias --seeds 0

Every run is ``recipes/feddat.py`` with the same settings (one process, sequentially; a finished run, i.e. a
``results.json`` in its folder, is reused, so the script continues after an interruption). Methods:
``feddat``, ``feddat_nomkd`` (feddat --mutual false), ``vqa_adapter`` (Adapter), ``vqa_adapter_local`` (Adapter-L),
and any ``vqa_peft:<kind>`` (lora, prompt, bias, full, head). Writes ``summary.json`` and ``summary.md`` (tables with
mean +- std of the mean per-client accuracy, the claims held / not held, compute per local step) to ``--output_dir``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = {"feddat": ["--method", "feddat"], "feddat_nomkd": ["--method", "feddat", "--mutual", "false"],
           "vqa_adapter": ["--method", "vqa_adapter"], "vqa_adapter_local": ["--method", "vqa_adapter_local"]}
LABELS = {"feddat": "FedDAT", "feddat_nomkd": "w/o MKD", "vqa_adapter": "Adapter", "vqa_adapter_local": "Adapter-L"}


def method_args(name: str) -> list[str]:
    if name in METHODS:
        return METHODS[name]
    if name.startswith("vqa_peft:"):
        return ["--method", "vqa_peft", "--peft", name.split(":", 1)[1]]
    raise SystemExit(f"compare_feddat.py: error: --methods: unknown method {name!r}; use {', '.join(METHODS)} or "
                     "vqa_peft:<lora|prompt|bias|full|head>")


def recipe():
    spec = importlib.util.spec_from_file_location("feddat_recipe", ROOT / "recipes" / "feddat.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def mean_std(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def fmt(xs):
    m, s = mean_std(xs)
    return "-" if m is None else f"{m:.3f} ± {s:.3f} (n={len([x for x in xs if x is not None])})"


def load_run(path: Path) -> dict | None:
    f = path / "results.json"
    if not f.is_file():
        return None
    res = json.loads(f.read_text())
    hist = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()] \
        if (path / "metrics.jsonl").is_file() else []
    curve = {h["round"]: h["personal_accuracy"] for h in hist if "personal_accuracy" in h and "round" in h}
    return {"acc": res["final"]["personal_accuracy"], "bytes_up": res["communication"]["bytes_up"],
            "per_client": res.get("per_client_accuracy"), "curve": curve,
            **{k: res["final"].get(k) for k in ("inference_shared", "inference_dat", "inference_local")}}


def step_cost(backbone: str, seed: int = 0, repeats: int = 3) -> dict:
    """ms per local step of FedDAT and Adapter on the same client and data (the plug-ins' own client_update)."""
    import torch

    from hfpfl.algorithms import get_algorithm
    from hfpfl.config import RunArguments
    from hfpfl.data.vqa import vqa_benchmark
    from hfpfl.federated.engine import Simulation

    fed = vqa_benchmark("scene", seed=seed, train_per_client=160, test_per_client=20)
    out = {}
    for method in ("vqa_adapter", "feddat"):
        run = RunArguments(method=method, model=backbone, num_rounds=1, batch_size=32, lr=1e-3, optimizer="adamw",
                           output_dir=str(ROOT / "outputs" / f"step-cost-{method}"), overwrite_output_dir=True,
                           progress=False, checkpoint_every=0)
        sim = Simulation(run, None, get_algorithm(method).Config(), fed_data=fed)
        sim.setup()
        times = []
        for _ in range(repeats):
            torch.manual_seed(0)
            down = sim.algorithm.download(sim.server_state, 0)
            upd = sim.algorithm.client_update(0, down, sim.algorithm.init_private_state(0), 1)
            times.append(upd.metrics["ms_per_step"])
        out[method] = statistics.median(times)
    out["ratio"] = out["feddat"] / out["vqa_adapter"]
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backbone", choices=["vilt", "blip"], default="vilt")
    p.add_argument("--splits", nargs="+", default=["function", "scene", "domain"],
                   choices=["function", "scene", "domain"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--methods", nargs="+", default=list(METHODS))
    p.add_argument("--output_dir", default="outputs/compare_feddat")
    p.add_argument("--from_runs", action="store_true", help="Only summarise the runs already in --output_dir.")
    p.add_argument("--step_cost", action="store_true", help="Also measure ms per local step (claim e).")
    p.add_argument("--num_rounds", type=int, default=6, help="Rounds per run (recipe default 8; here 6).")
    p.add_argument("--train_per_client", type=int, default=200, help="Training questions per client.")
    p.add_argument("--test_per_client", type=int, default=150, help="Test questions per client.")
    p.add_argument("extra", nargs="*", help="More recipe flags after --, e.g. -- --lr 3e-3")
    a = p.parse_args(argv)
    for m in a.methods:
        method_args(m)
    base = Path(a.output_dir) / a.backbone
    rec = None
    rows = {}
    for split in a.splits:
        for m in a.methods:
            for seed in a.seeds:
                out = base / split / m.replace(":", "-") / f"seed{seed}"
                res = load_run(out)
                if res is None and not a.from_runs:
                    rec = rec or recipe()
                    t0 = time.time()
                    rec.main(["--backbone", a.backbone, "--vqa_split", split, "--seed", str(seed), "--output_dir",
                              str(out), "--overwrite_output_dir", "true", "--progress", "false", *method_args(m),
                              "--num_rounds", str(a.num_rounds), "--train_per_client", str(a.train_per_client),
                              "--test_per_client", str(a.test_per_client), *a.extra])
                    print(f"[compare_feddat] {split} {m} seed {seed}: {time.time() - t0:.0f} s", flush=True)
                    res = load_run(out)
                if res is not None:
                    rows.setdefault(split, {}).setdefault(m, {})[seed] = res
    summary = summarise(rows, a)
    if a.step_cost:
        summary["step_cost_ms"] = step_cost(a.backbone)
    base.mkdir(parents=True, exist_ok=True)
    (base / "summary.json").write_text(json.dumps(summary, indent=2))
    md = to_markdown(summary)
    (base / "summary.md").write_text(md)
    print(md)


def summarise(rows, a) -> dict:
    table, claims = {}, {}
    for split, by_m in rows.items():
        table[split] = {m: {"acc": [r["acc"] for r in by_s.values()], "seeds": sorted(by_s),
                            "bytes_up": sorted({r["bytes_up"] for r in by_s.values()}),
                            **{k: [r[k] for r in by_s.values() if r.get(k) is not None]
                               for k in ("inference_shared", "inference_dat", "inference_local")}}
                        for m, by_s in by_m.items()}
        curves = {m: [r["curve"] for r in by_s.values()] for m, by_s in by_m.items()}
        early = {}
        for m, cs in curves.items():
            if cs and cs[0]:
                R = max(cs[0])
                r25 = max(1, math.ceil(0.25 * R))
                early[m] = {"round": r25, "acc": [c.get(r25) for c in cs]}
        table[split]["_early"] = early
    mean = {s: {m: mean_std(v["acc"])[0] for m, v in t.items() if not m.startswith("_")} for s, t in table.items()}
    have = lambda s, *ms: all(mean[s].get(m) is not None for m in ms)  # noqa: E731
    splits = [s for s in mean if have(s, "feddat", "vqa_adapter", "vqa_adapter_local")]
    if splits:
        ok = [s for s in splits if mean[s]["feddat"] >= mean[s]["vqa_adapter"] >= mean[s]["vqa_adapter_local"]]
        claims["a_ordering"] = {"held_on": ok, "of": splits, "held": len(ok) > len(splits) / 2}
        ok_fa = [s for s in splits if mean[s]["feddat"] >= mean[s]["vqa_adapter"]]
        claims["a_feddat_ge_adapter"] = {"held_on": ok_fa, "of": splits, "held": len(ok_fa) > len(splits) / 2}
        gain = {s: mean[s]["feddat"] - mean[s]["vqa_adapter"] for s in splits}
        claims["a_largest_gain_where_shift_strongest"] = {
            "gain": gain, "held": max(gain, key=gain.get) in ("scene", "domain")}
    splits_b = [s for s in mean if have(s, "feddat", "feddat_nomkd", "vqa_adapter")]
    if splits_b:
        ok = [s for s in splits_b if mean[s]["feddat"] > mean[s]["feddat_nomkd"] > mean[s]["vqa_adapter"]]
        claims["b_ablation_order"] = {"held_on": ok, "of": splits_b, "held": len(ok) > len(splits_b) / 2}
        inf = {s: {k: mean_std(table[s]["feddat"][k])[0] for k in ("inference_shared", "inference_dat",
                                                                    "inference_local")} for s in splits_b}
        ok = [s for s in splits_b if None not in inf[s].values()
              and inf[s]["inference_shared"] >= inf[s]["inference_dat"] >= inf[s]["inference_local"]]
        claims["b_inference_As_ge_DAT_ge_Ac"] = {"means": inf, "held_on": ok, "of": splits_b,
                                                "held": len(ok) > len(splits_b) / 2}
        comm = {s: (table[s]["feddat"]["bytes_up"], table[s]["vqa_adapter"]["bytes_up"]) for s in splits_b}
        claims["c_equal_communication"] = {"bytes_up": comm, "held": all(x == y for x, y in comm.values())}
        early = {}
        for s in splits_b:
            e = table[s]["_early"]
            if "feddat" in e and "vqa_adapter" in e:
                early[s] = {"round": e["feddat"]["round"], "feddat": mean_std(e["feddat"]["acc"])[0],
                            "adapter": mean_std(e["vqa_adapter"]["acc"])[0]}
        claims["d_early_convergence"] = {"at_25pct_rounds": early,
                                         "held": bool(early) and sum(v["feddat"] > v["adapter"] for v in
                                                                     early.values()) > len(early) / 2}
    return {"backbone": a.backbone, "seeds": a.seeds, "num_rounds": a.num_rounds, "train_per_client":
            a.train_per_client, "test_per_client": a.test_per_client, "extra_flags": a.extra, "table": table,
            "claims": claims}


def to_markdown(summary) -> str:
    t = summary["table"]
    methods = [m for m in LABELS if any(m in v for v in t.values())] + sorted(
        {m for v in t.values() for m in v if m not in LABELS and not m.startswith("_")})
    splits = list(t)
    lines = [f"backbone {summary['backbone']}, seeds {summary['seeds']}: mean per-client accuracy (mean ± std over "
             "seeds)", "", "| method | " + " | ".join(splits) + " |", "|---|" + "---|" * len(splits)]
    for m in methods:
        lines.append(f"| {LABELS.get(m, m)} | " + " | ".join(fmt(t[s][m]["acc"]) if m in t[s] else "-"
                                                          for s in splits) + " |")
    if any("feddat" in t[s] for s in splits):
        lines += ["", "FedDAT inference path (Table 4 rows): A_s / DAT / A_c", "",
                  "| split | A_s | DAT | A_c |", "|---|---|---|---|"]
        for s in splits:
            if "feddat" in t[s]:
                f = t[s]["feddat"]
                lines.append(f"| {s} | {fmt(f['inference_shared'])} | {fmt(f['inference_dat'])} | "
                             f"{fmt(f['inference_local'])} |")
    lines += ["", "Claims:", ""]
    for k, v in summary["claims"].items():
        detail = {kk: vv for kk, vv in v.items() if kk != "held"}
        lines.append(f"- {k}: {'held' if v['held'] else 'NOT held'} ({json.dumps(detail, default=str)})")
    if "step_cost_ms" in summary:
        c = summary["step_cost_ms"]
        lines.append(f"- e_compute_per_step: FedDAT {c['feddat']:.1f} ms vs Adapter {c['vqa_adapter']:.1f} ms per "
                     f"local step (x{c['ratio']:.2f}; spec expects about 2.5)")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
