"""Results contract: resolved config, per-round metrics, results.json, plots; optional accelerate trackers."""
from __future__ import annotations

import json
import os
from pathlib import Path

import yaml


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_config(output_dir: Path, **configs) -> None:
    """``config.yaml``: every option of the run, flat -- a valid ``--config`` input that reproduces the run
    (``--config <output_dir>/config.yaml --output_dir <new>``). Never replaces a config.yaml hfpfl did not write."""
    from .config import config_for_file
    from .runtime import CONFIG_MARKER, CONFIG_NAME, is_hfpfl_config

    path = Path(output_dir) / CONFIG_NAME
    if path.exists() and not is_hfpfl_config(path):
        raise FileExistsError(f"--output_dir {str(output_dir)!r} holds a {CONFIG_NAME} that hfpfl did not write; it "
                              f"is never overwritten: pass another --output_dir")
    flat = config_for_file(*configs.values())
    text = (f"{CONFIG_MARKER} ({', '.join(configs)} options). Reproduce the run with:\n"
            f"#   --config {path} --output_dir <new folder>\n" + yaml.safe_dump(flat, sort_keys=False))
    atomic_write_text(path, text)


# ------------------------------------------------------------------------------------------------ plain-text log
def describe_model(model: str, adapter: str = "none") -> str:
    """The model and where it comes from, for the run header."""
    import os

    from .models.names import TINY_CLASSIFIER_NAMES as TINY_CLASSIFIERS, TINY_VQA_MODELS

    if model in TINY_CLASSIFIERS or model in TINY_VQA_MODELS:
        src = "built-in config, random init"
    elif os.path.isdir(model):
        src = "local folder"
    elif model.startswith("hfpfl/"):
        src = "pretrained stand-in published by hfpfl to the local Hub cache"
    else:
        src = "Hub checkpoint"
    return f"{model} ({src})" + (f" + {adapter} adapters" if adapter and adapter != "none" else "")


def describe_run_model(sim) -> str:
    """The model this run trains: ``--model`` as :func:`describe_model` says, or, where the method builds its own
    (``Algorithm.build_model``: FedBasis's basis combination, FedPop's tiny MLP, a user's plain ``nn.Module``), its
    class, and ``--model`` only if the method built around it."""
    a = sim.args
    given = describe_model(a.model, a.adapter)
    if sim.model_is_default:
        return given
    built = f"{type(sim.model).__name__}, built by the method {a.method}"
    return f"{built} around {given}" if getattr(sim, "default_model_built", False) else f"{built} (--model unused)"


def _fmt_count(n: int) -> str:
    return f"{n:,}"


def run_header(sim) -> str:
    """A few plain lines a person reads first: method, model and its source, data, clients, parameters."""
    a, d = sim.args, sim.data_args
    counts = sim.parameter_counts()
    data = sim.data
    clients = len(data.clients)
    m = a.clients_per_round or max(1, int(round(a.client_fraction * clients)))
    domains = sorted({str(c.domain) for c in data.clients if c.domain is not None})
    lines = [
        f"hfpfl run: {a.method}" + (" (one-shot)" if getattr(sim.algorithm, "one_shot", False) else "")
        + f", {a.num_rounds} round{'s' if a.num_rounds != 1 else ''}, seed {a.seed}",
        f"  model      {describe_run_model(sim)}",
        f"  dataset    {getattr(d, 'dataset', 'custom')}: {data.num_labels} labels, "
        f"{data.num_channels}x{data.image_size}x{data.image_size} images"
        + (f", domains {', '.join(domains)}" if domains else ""),
        f"  partition  {getattr(d, 'partition', 'custom')}" + (
            f" (alpha {d.alpha})" if getattr(d, "partition", None) in ("dirichlet", "quantity") else ""),
        f"  clients    {clients} ({min(m, clients)} per round)"
        + (f" + {len(data.new_clients)} held-out new" if data.new_clients else "")
        + f"; train sizes {min(len(c.train) for c in data.clients)}-{max(len(c.train) for c in data.clients)}",
        f"  parameters {_fmt_count(counts['total'])} total, {_fmt_count(counts['trainable'])} trainable, "
        f"{_fmt_count(counts['global_state_elements'])} communicated per client per direction",
        f"  output     {sim.output_dir}",
    ]
    return "\n".join(lines)


def _kib(n) -> str:
    return f"{n / 1024:,.1f} KiB" if n < 1024 * 1024 else f"{n / 1024 / 1024:,.2f} MiB"


def round_line(metrics: dict, seconds: float, num_rounds: int) -> str:
    """One plain line per round: round, train loss, accuracies, bytes up/down, seconds."""
    w = len(str(num_rounds))
    parts = [f"round {metrics['round']:>{w}}/{num_rounds}"]
    if metrics.get("train_loss") is not None:
        parts.append(f"train_loss {metrics['train_loss']:.4f}")
    for k in ("global_accuracy", "personal_accuracy", "new_client_accuracy"):
        if isinstance(metrics.get(k), float):
            parts.append(f"{k.replace('_accuracy', '_acc')} {metrics[k]:.4f}")
    parts.append(f"up {_kib(metrics.get('bytes_up', 0))}")
    parts.append(f"down {_kib(metrics.get('bytes_down', 0))}")
    parts.append(f"{seconds:.1f} s")
    return " | ".join(parts)


def log_run_header(sim) -> None:
    if sim.accelerator.is_main_process:
        print(run_header(sim), flush=True)


def log_round(sim, metrics: dict, seconds: float) -> None:
    if sim.accelerator.is_main_process:
        print(round_line(metrics, seconds, sim.args.num_rounds), flush=True)


def show_progress_bars(enabled: bool) -> bool:
    """Progress bars only on a terminal: a redirected log gets the plain lines, not bar redraws."""
    import sys

    return bool(enabled) and sys.stderr.isatty()


def write_history(output_dir: Path, history: list[dict], written: int = 0) -> int:
    """``metrics.jsonl``, one line per round. ``written``: how many of ``history``'s rounds this process has already
    written; those stay and only the new ones are appended (rewriting every round each round grows with rounds x
    clients: 2 ms of a 25 ms 100-client round at round 40). ``written == 0`` (a fresh or resumed run) rewrites the
    whole file atomically, so a resumed run drops any line a crash left after its checkpoint. Returns the new count."""
    path = output_dir / "metrics.jsonl"
    if written == 0 or not path.exists():
        atomic_write_text(path, "".join(json.dumps(h) + "\n" for h in history))
    else:
        with open(path, "a") as f:
            f.write("".join(json.dumps(h) + "\n" for h in history[written:]))
    return len(history)


def write_results(output_dir: Path, results: dict) -> None:
    atomic_write_text(output_dir / "results.json", json.dumps(results, indent=2))


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_curves(output_dir: Path, history: list[dict], title: str = "", num_labels: int | None = None) -> Path | None:
    """``accuracy_curve.png``: every accuracy metric per round, the mean train loss on a second axis and the chance
    line (1 / num_labels). A run of one round (one-shot methods) gets a bar chart of its final accuracies instead."""
    keys = sorted({k for h in history for k, v in h.items() if k.endswith("accuracy") and isinstance(v, float)})
    if not keys:
        return None
    plt = _plt()
    chance = 1.0 / num_labels if num_labels else None
    rounds = sorted({h["round"] for h in history})
    fig, ax = plt.subplots(figsize=(6.5, 4))
    if len(rounds) == 1:
        last = history[-1]
        vals = [last.get(k) for k in keys]
        bars = ax.bar(range(len(keys)), [v or 0 for v in vals], color="tab:blue")
        ax.set_xticks(range(len(keys)), [k.replace("_", " ") for k in keys], rotation=15, ha="right")
        for b, v in zip(bars, vals):
            if v is not None:
                ax.text(b.get_x() + b.get_width() / 2, v + 0.01, f"{v:.3f}", ha="center", va="bottom", fontsize=8)
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("accuracy")
        ax.set_title(title + f" (one round{', train loss %.3f' % last['train_loss'] if last.get('train_loss') else ''})")
        if chance:
            ax.axhline(chance, color="grey", ls="--", lw=1, label=f"chance (1/{num_labels})")
            ax.legend(loc="upper right", fontsize=8)
    else:
        from matplotlib.ticker import MaxNLocator
        for k in keys:
            pts = [(h["round"], h[k]) for h in history if h.get(k) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=k.replace("_", " "))
        if chance:
            ax.axhline(chance, color="grey", ls="--", lw=1, label=f"chance (1/{num_labels})")
        ax.set_ylim(0, 1.05)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("round")
        ax.set_ylabel("accuracy")
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        loss = [(h["round"], h["train_loss"]) for h in history if isinstance(h.get("train_loss"), (int, float))]
        if loss:
            ax2 = ax.twinx()
            (line,) = ax2.plot(*zip(*loss), color="tab:red", ls=":", marker=".", label="train loss (right)")
            ax2.set_ylabel("mean train loss", color="tab:red")
            ax2.set_ylim(bottom=0)
            handles, labels = handles + [line], labels + [line.get_label()]
        ax.legend(handles, labels, fontsize=8, loc="center right")
        ax.set_title(title)
    path = Path(output_dir) / "accuracy_curve.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_client_bars(output_dir: Path, per_client: dict[str, float], title: str = "",
                     domains: dict[str, str | None] | None = None, num_labels: int | None = None) -> Path | None:
    """``client_accuracy.png``: personal test accuracy per client, each bar labelled with the client and its domain
    (and coloured by domain), with the chance line."""
    if not per_client:
        return None
    plt = _plt()
    domains = domains or {}
    ids = list(per_client)
    doms = [domains.get(c) for c in ids]
    palette = plt.get_cmap("tab10")
    uniq = sorted({d for d in doms if d})
    colors = [palette(uniq.index(d) % 10) if d else "tab:blue" for d in doms]
    fig, ax = plt.subplots(figsize=(max(4.5, 0.55 * len(ids)), 3.8))
    ax.bar(range(len(ids)), list(per_client.values()), color=colors)
    ax.set_xticks(range(len(ids)), [f"{c}\n{d}" if d else c for c, d in zip(ids, doms)],
                  fontsize=8 if len(ids) <= 16 else 6, rotation=0 if len(ids) <= 12 else 90)
    if num_labels:
        ax.axhline(1.0 / num_labels, color="grey", ls="--", lw=1, label=f"chance (1/{num_labels})")
        ax.legend(fontsize=8, loc="upper right")
    ax.set_xlabel("client (domain)" if uniq else "client")
    ax.set_ylabel("personal test accuracy")
    ax.set_ylim(0, 1.05)
    ax.set_title(title)
    path = Path(output_dir) / "client_accuracy.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_run(sim, final_eval: dict) -> None:
    """The plots a finished run writes (accuracy curve with loss and chance, per-client bars by domain)."""
    a = sim.args
    dataset = getattr(sim.data_args, "dataset", "custom") if sim.data_args is not None else "custom"
    num_labels = getattr(sim.data, "num_labels", None)
    plot_curves(sim.output_dir, sim.history, title=f"{a.method} on {dataset}", num_labels=num_labels)
    per_client = final_eval.get("per_client", {}) or {}
    domains = {}
    for cid in per_client:
        try:
            domains[cid] = sim.data.clients[int(cid)].domain
        except (ValueError, IndexError, AttributeError):
            domains[cid] = None
    plot_client_bars(sim.output_dir, per_client, title=f"{a.method}: personal accuracy per client",
                     domains=domains, num_labels=num_labels)
