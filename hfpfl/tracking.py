"""Results contract: resolved config, per-round metrics, results.json, plots; optional accelerate trackers."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import yaml


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_config(output_dir: Path, **configs) -> None:
    resolved = {name: dataclasses.asdict(c) if dataclasses.is_dataclass(c) else c for name, c in configs.items()}
    atomic_write_text(output_dir / "config.yaml", yaml.safe_dump(resolved, sort_keys=False))


def write_history(output_dir: Path, history: list[dict]) -> None:
    atomic_write_text(output_dir / "metrics.jsonl", "".join(json.dumps(h) + "\n" for h in history))


def write_results(output_dir: Path, results: dict) -> None:
    atomic_write_text(output_dir / "results.json", json.dumps(results, indent=2))


def plot_curves(output_dir: Path, history: list[dict], title: str = "") -> Path | None:
    """Accuracy vs round for every *accuracy* metric logged."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({k for h in history for k, v in h.items() if k.endswith("accuracy") and isinstance(v, float)})
    if not keys:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for k in keys:
        pts = [(h["round"], h[k]) for h in history if h.get(k) is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=k)
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    path = output_dir / "accuracy_curve.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_client_bars(output_dir: Path, per_client: dict[str, float], title: str = "") -> Path | None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not per_client:
        return None
    fig, ax = plt.subplots(figsize=(max(4, 0.4 * len(per_client)), 3.5))
    ax.bar(range(len(per_client)), list(per_client.values()), tick_label=list(per_client))
    ax.set_xlabel("client")
    ax.set_ylabel("personal test accuracy")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    path = output_dir / "client_accuracy.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
