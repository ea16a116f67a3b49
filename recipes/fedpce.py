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
from hfpfl.data.benchmarks import GROUPS
from hfpfl.options import Check, at_least, option

# a quick CPU setting (a few minutes on 2 CPU cores); the FedPCE studies (hfpfl/experiments/studies/fedpce_*.py) add
# the paper's groups, augmentation and new-client test size to it
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
    few_shot: int | None = option(None, "Also adapt each new client on only this many training images per class "
                                  "and report it (final new_few_shot_accuracy), with the new clients' accuracy per "
                                  "degradation group (new_<group>_accuracy), before adaptation (new_start_accuracy) "
                                  "and, for fedpce, the embeddings' silhouette by group (embedding_silhouette): the "
                                  "columns of the paper's Table 2 and Fig. 3-4.", check=at_least(1))
    groups: str | None = option(None, "--benchmark degradation: the client groups, comma-separated, from noise, "
                                "color, rotation, imbalance (the paper's: noise,color,imbalance; imbalance needs an "
                                "even number of clients per group); default: --degradations.",
                                check=Check(lambda v: all(g.strip() in GROUPS for g in str(v).split(",")),
                                            "comma-separated groups from " + ", ".join(GROUPS)))
    new_client_test_size: int | None = option(None, "Each held-out client tests on this many images of the source's "
                                              "test split through its own degradation (the paper's 20-percent fold "
                                              "holds about 400; use >= 100); default: a quarter of its own images.",
                                              check=at_least(1))


RECIPE_OPTIONS = BenchmarkOptions  # this recipe's own options (docs/reference/options.md lists them)


def benchmark_data(run, data, opts: BenchmarkOptions):
    return build_data(data, run.seed, opts.benchmark, opts.new_client_budget, opts.held_out_domain, opts.levels,
                      opts.groups, opts.new_client_test_size)


def build_data(data, seed, benchmark, budget, held_out, levels="paper", groups=None, new_client_test_size=None):
    from hfpfl.data.benchmarks import degradation_benchmark, leave_one_domain_out, with_new_client_budget
    if benchmark == "lodo":
        fed = leave_one_domain_out(held_out, clients_per_domain=data.num_clients, max_per_domain=data.max_per_domain,
                                   image_size=data.image_size, num_channels=data.num_channels, seed=seed)
    else:
        groups = [g.strip() for g in (groups or data.degradations or "noise,color,rotation").split(",") if g.strip()]
        if data.num_clients % len(groups) or data.num_new_clients % len(groups):
            raise ValueError(f"--num_clients and --num_new_clients must be multiples of the {len(groups)} groups")
        fed = degradation_benchmark(data.dataset, groups, data.num_clients // len(groups),
                                    data.num_new_clients // len(groups), max_per_domain=data.max_per_domain,
                                    image_size=data.image_size, num_channels=data.num_channels, seed=seed,
                                    levels=levels, new_client_test_size=new_client_test_size)
    return with_new_client_budget(fed, budget, seed=seed)


def main(argv=None):
    return run_recipe(method="fedpce", argv=argv, defaults=DEFAULTS, script="recipes/fedpce.py", description=__doc__,
                      recipe_options=BenchmarkOptions, data_fn=benchmark_data, after=after)


def after(sim, results):
    few_shot = sim.recipe_settings.get("few_shot")
    if few_shot:
        results["final"].update(study_metrics(sim, results, few_shot))
    embeddings_figure(sim, results)


def study_metrics(sim, results, few_shot: int) -> dict:
    """Table 2's per-group new-client accuracy (from the engine's own new-client scores), the new clients before
    adaptation (0 steps: the embedding init for fedpce, the global model's norms for the others), after adapting on
    ``few_shot`` images per class (Fig. 4), and the silhouette of the fedpce embeddings by degradation group (Fig. 3,
    in the embedding space itself)."""
    import numpy as np

    from hfpfl.data.benchmarks import with_new_client_budget
    fed, algo, n = sim.data, sim.algorithm, sim.num_clients
    out = {}
    groups: dict = {}
    for cid, acc in (results.get("new_client_accuracy") or {}).items():
        groups.setdefault(str(fed.new_clients[int(cid) - n].domain).split("-")[0], []).append(acc)
    out.update({f"new_{g}_accuracy": float(np.mean(v)) for g, v in sorted(groups.items())})

    def adapt_all(data_of, steps):
        saved = algo.config.new_client_steps
        algo.config.new_client_steps = steps
        try:
            accs = []
            for j in range(len(fed.new_clients)):
                cid = n + j
                sim.seed_torch(sim.seed_for(sim.round, cid, "new-client"))
                sim.ctx.load(sim.initial_private)
                model = algo.personalize_new_client(cid, sim.server_state, data_of(j), sim.round)
                accs.append(sim.ctx.evaluate(model, sim.test_data(cid))["accuracy"])
            return float(np.mean(accs))
        finally:
            algo.config.new_client_steps = saved

    from hfpfl.training import TensorData
    out["new_start_accuracy"] = adapt_all(lambda j: sim.train_data(n + j), 0)
    small = with_new_client_budget(fed, few_shot, seed=sim.args.seed)
    out["new_few_shot_accuracy"] = adapt_all(lambda j: TensorData.from_dataset(small.new_clients[j].train),
                                             algo.config.new_client_steps)
    if sim.args.method == "fedpce":
        emb = algo.embeddings()
        ids = sorted(emb)
        X = np.stack([emb[i].numpy().reshape(-1) for i in ids])
        out["embedding_silhouette"] = silhouette(X, [str(fed.clients[i].domain).split("-")[0] for i in ids])
    return out


def silhouette(X, labels) -> float:
    """Mean silhouette (Rousseeuw 1987) of the rows of X under ``labels``, Euclidean: per point (b - a) / max(a, b),
    a = mean distance to its own group's other points, b = the smallest mean distance to another group."""
    import numpy as np
    labels = np.asarray(labels)
    d = np.sqrt(((X[:, None, :] - X[None, :, :]) ** 2).sum(-1))
    s = []
    for i in range(len(X)):
        same = (labels == labels[i]) & (np.arange(len(X)) != i)
        if not same.any():
            s.append(0.0)
            continue
        a = d[i, same].mean()
        b = min(d[i, labels == g].mean() for g in set(labels.tolist()) if g != labels[i])
        s.append(float((b - a) / max(a, b)) if max(a, b) > 0 else 0.0)
    return float(np.mean(s))


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
