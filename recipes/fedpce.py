"""FedPCE (and its same-loop baselines) on the degradation benchmark with held-out new clients per group.

    accelerate launch recipes/fedpce.py --output_dir outputs/fedpce
    python recipes/fedpce.py --method pce_fedbn --num_rounds 20
    python recipes/fedpce.py --benchmark lodo --held_out_domain syn --new_client_budget 8
    python recipes/fedpce.py --help

The benchmark's own options (--benchmark, --new_client_budget, --held_out_domain, --levels) are listed by --help
with the run, data and method options; they go in a --config file and config.yaml like any other.
Results (results.json: accuracy per client and per new client, bytes per part and per client, wall time), the
resolved config and plots go to --output_dir; fedpce also writes embeddings_pca.png.
"""
from dataclasses import dataclass

from hfpfl.cli import run_recipe
from hfpfl.options import at_least, option

# the setting of the README's FedPCE table (scripts/compare_fedpce.py --rounds 10 --local_steps 10 --widths 8,16,32,64
# --new_client_steps 50): a few minutes on 2 CPU cores
DEFAULTS = dict(dataset="mnist", degradations="noise,color,rotation", num_clients=12, num_new_clients=3,
                max_per_domain=3000, image_size=16, num_rounds=10, local_steps=10, batch_size=32, optimizer="adam",
                lr=1e-3, weight_decay=1e-4, widths="8,16,32,64", depths="1,1,1,1", new_client_steps=50)


@dataclass
class BenchmarkOptions:
    benchmark: str = option("degradation", "degradation: degradation groups of --dataset (default mnist; groups = "
                            "--degradations, default noise,color,rotation; --num_clients collaborative and "
                            "--num_new_clients held-out clients, both split evenly over the groups) | lodo: "
                            "leave-one-domain-out Digits (--num_clients = clients per domain; every client of "
                            "--held_out_domain is new).", choices=["degradation", "lodo"])
    new_client_budget: int | None = option(None, "New clients keep this many training images per class (>= 1; "
                                           "default: all).", check=at_least(1))
    held_out_domain: str = option("syn", "--benchmark lodo: the Digits domain whose clients are all new.",
                                  choices=["mnist", "usps", "mnistm", "syn"])
    levels: str = option("paper", "Degradation strength: paper (the paper's per-client settings: noise variances "
                         "linspace(0.005, 1, M), jitter factors linspace(0.5, 1.5, M), hue +-0.5) | cycled (the "
                         "earlier milder cycled levels, hfpfl/data/benchmarks.py).", choices=["paper", "cycled"])


RECIPE_OPTIONS = BenchmarkOptions  # this recipe's own options (docs/reference/options.md lists them)


def benchmark_data(run, data, opts: BenchmarkOptions):
    return build_data(data, run.seed, opts.benchmark, opts.new_client_budget, opts.held_out_domain, opts.levels)


def build_data(data, seed, benchmark, budget, held_out, levels="paper"):
    from hfpfl.data.benchmarks import degradation_benchmark, leave_one_domain_out, with_new_client_budget
    if benchmark == "lodo":
        fed = leave_one_domain_out(held_out, clients_per_domain=data.num_clients, max_per_domain=data.max_per_domain,
                                   image_size=data.image_size, num_channels=data.num_channels, seed=seed)
    else:
        groups = [g.strip() for g in (data.degradations or "noise,color,rotation").split(",") if g.strip()]
        if data.num_clients % len(groups) or data.num_new_clients % len(groups):
            raise ValueError(f"--num_clients and --num_new_clients must be multiples of the {len(groups)} groups")
        fed = degradation_benchmark(data.dataset, groups, data.num_clients // len(groups),
                                    data.num_new_clients // len(groups), max_per_domain=data.max_per_domain,
                                    image_size=data.image_size, num_channels=data.num_channels, seed=seed,
                                    levels=levels)
    return with_new_client_budget(fed, budget, seed=seed)


def main(argv=None):
    return run_recipe(method="fedpce", argv=argv, defaults=DEFAULTS, script="recipes/fedpce.py", description=__doc__,
                      recipe_options=BenchmarkOptions, data_fn=benchmark_data, after=embeddings_figure)


def embeddings_figure(sim, results):
    """FedPCE's embeddings plot, once results.json is written: a plot that fails is a warning, never a failed run."""
    if sim.args.method != "fedpce":
        return
    try:
        plot_embeddings(sim, sim.data)
    except Exception as e:  # noqa: BLE001 - the results are complete; only the figure is lost
        import logging
        logging.getLogger("hfpfl").warning("embeddings_pca.png not written (%s: %s); the run's results are complete",
                                           type(e).__name__, e)


def plot_embeddings(sim, fed):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    emb = sim.algorithm.embeddings()
    if len(emb) < 3:
        return
    ids = sorted(emb)
    X = np.stack([emb[i].numpy().reshape(-1) for i in ids])
    if X.shape[1] == 0:  # nothing to project
        return
    X = (X - X.mean(0)) / (X.std(0) + 1e-8)
    _, _, vt = np.linalg.svd(X, full_matrices=False)
    Z = X @ vt[:2].T
    if Z.shape[1] < 2:  # a one-dimensional embedding: its values along x
        Z = np.concatenate([Z, np.zeros((len(Z), 2 - Z.shape[1]))], axis=1)
    kinds = [str(fed.clients[i].domain).split("-")[0] for i in ids]
    fig, ax = plt.subplots(figsize=(4, 4))
    for j, k in enumerate(sorted(set(kinds))):
        idx = [n for n, kk in enumerate(kinds) if kk == k]
        ax.scatter(Z[idx, 0], Z[idx, 1], label=k, color=f"C{j}")
    ax.legend()
    ax.set_title("FedPCE client embeddings (PCA)")
    fig.savefig(f"{sim.output_dir}/embeddings_pca.png", dpi=120, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    main()
