"""The FedBiP main job's report: its terminal table and its files (``summary.json``, the figure, ``results.md``), in
the study runner's formats."""
from __future__ import annotations

import json
from pathlib import Path


def format_table(summary: dict) -> str:
    """The terminal table: one line per row (mean over the seeds), then the paper's ordering and every claim."""
    variants = summary["variants"]
    domains = sorted({d for e in variants.values() for d in e.get("per_domain", {})})
    n_seeds = len(summary["seeds"])
    cols = [("personal_accuracy", "mean"), ("global_accuracy", "global"), ("synthetic_fidelity_judge", "judge"),
            ("synthetic_style", "style"), ("mia_loss_gap", "MIA-loss")]
    width = 15 if n_seeds > 1 else 8
    labels = {n: variants[n]["label"] + (" [control]" if variants[n]["control"] else "") for n in summary["order"]}
    lw = max(len(x) for x in ["row", *labels.values()])
    head = (f"{'row':<{lw}} " + " ".join(f"{d[:8]:>8}" for d in domains) + " "
            + " ".join(f"{label:>{width}}" for _, label in cols) + f" {'steps':>6} {'time s':>7}")
    lines = [head, "-" * len(head)]

    def cell(ms):
        if not ms or ms.get("mean") is None:
            return f"{'-':>{width}}"
        text = f"{ms['mean']:.3f}" + (f" ± {ms['std']:.3f}" if n_seeds > 1 and ms.get("std") is not None else "")
        return f"{text:>{width}}"

    for name in summary["order"]:
        e = variants[name]
        steps = (e.get("budget") or {}).get("optimizer_steps_per_model")
        lines.append(f"{labels[name]:<{lw}} " + " ".join(f"{(e['per_domain'].get(d) or {}).get('mean', 0):>8.3f}"
                                                       for d in domains) + " "
                     + " ".join(cell(e["metrics"].get(k)) for k, _ in cols)
                     + f" {('-' if steps is None else f'{steps:g}'):>6} {e['seconds']:>7.1f}")
    lines.append("mean = mean per-client accuracy on the clients' real test images (per domain: that client); "
                 "judge = synthetic images the LDM's public-image judge reads as their label; style = synthetic "
                 "images a domain classifier (public splits) assigns to the client's domain; MIA-loss = |member - "
                 "non-member| mean loss (lower = less leakage); steps = optimizer steps of the classifier"
                 + (f"; mean ± sample std over seeds {', '.join(map(str, summary['seeds']))}" if n_seeds > 1 else
                    f"; seed {summary['seeds'][0]}"))
    order = summary.get("ordering") or {}
    if order.get("paper"):
        lines.append(f"paper's ordering: {' > '.join(variants[n]['label'] for n in order['paper'])}")
        lines.append(f"ours:             {' > '.join(variants[n]['label'] for n in order['ours'])}")
    for c in summary.get("claims", []):
        lines.append(f"  {c['verdict']:<12}  {c['claim']:<28} {c['detail']}   [{c['paper']}]")
    return "\n".join(lines)


def write_summary(out: Path, study, rows: dict) -> dict:
    """summary.json, the figure and results.md of the comparison (the runner's and the docs' own formats)."""
    from hfpfl import tracking
    from hfpfl.experiments import docs, runner

    summary = runner.summarize(study, rows)
    out.mkdir(parents=True, exist_ok=True)
    tracking.atomic_write_text(out / "summary.json", json.dumps(summary, indent=1, sort_keys=True) + "\n")
    (out / study.name).mkdir(exist_ok=True)
    runner.write_figure(study, summary, out / study.name / f"{study.name}.png")
    tracking.atomic_write_text(out / "results.md", docs.render(summary))
    return summary
