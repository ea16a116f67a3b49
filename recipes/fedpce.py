"""FedPCE (and its same-loop baselines) on the degradation benchmark with held-out new clients per group.

    accelerate launch recipes/fedpce.py --output_dir outputs/fedpce
    python recipes/fedpce.py --method pce_fedbn --num_rounds 20
    python recipes/fedpce.py --benchmark lodo --held_out_domain syn --new_client_budget 8
    python recipes/fedpce.py --help

Benchmark options (besides the run/data/method flags listed by --help):
  --benchmark degradation|lodo   degradation groups of --dataset (default mnist; groups = --degradations,
                                 default noise,color,rotation; --num_clients collaborative and --num_new_clients
                                 held-out clients, both split evenly over the groups) or leave-one-domain-out Digits
                                 (--num_clients = clients per domain; every client of --held_out_domain is new)
  --new_client_budget K          new clients keep K training images per class (default: all)
  --levels paper|cycled          degradation strength: the paper's per-client settings (default; noise variances
                                 linspace(0.005, 1, M), jitter factors linspace(0.5, 1.5, M), hue +-0.5) or the
                                 earlier milder cycled levels (see hfpfl/data/benchmarks.py)
Results (results.json: accuracy per client and per new client, bytes per part and per client, wall time), the
resolved config and plots go to --output_dir; fedpce also writes embeddings_pca.png.
"""
import argparse
import sys

from hfpfl.cli import run_recipe

# the setting of the README's FedPCE table (scripts/compare_fedpce.py --rounds 10 --local_steps 10 --widths 8,16,32,64
# --new_client_steps 50): a few minutes on 2 CPU cores
DEFAULTS = dict(dataset="mnist", degradations="noise,color,rotation", num_clients=12, num_new_clients=3,
                max_per_domain=3000, image_size=16, num_rounds=10, local_steps=10, batch_size=32, optimizer="adam",
                lr=1e-3, weight_decay=1e-4, widths="8,16,32,64", depths="1,1,1,1", new_client_steps=50)


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
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--benchmark", choices=["degradation", "lodo"], default="degradation")
    pre.add_argument("--new_client_budget", type=int, default=None)
    pre.add_argument("--held_out_domain", default="syn")
    pre.add_argument("--levels", choices=["paper", "cycled"], default="paper")
    known, rest = pre.parse_known_args(sys.argv[1:] if argv is None else argv)
    return run_recipe(method="fedpce", argv=rest, defaults=DEFAULTS, script="recipes/fedpce.py", description=__doc__,
                      top_level=argv is None,
                      data_fn=lambda run, data: build_data(data, run.seed, known.benchmark, known.new_client_budget,
                                                           known.held_out_domain, known.levels),
                      recipe_settings=vars(known),
                      after=lambda sim, results: plot_embeddings(sim, sim.data) if sim.args.method == "fedpce" else None)


def plot_embeddings(sim, fed):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    emb = sim.algorithm.embeddings()
    if len(emb) < 3:
        return
    ids = sorted(emb)
    X = np.stack([emb[i].numpy() for i in ids])
    X = (X - X.mean(0)) / (X.std(0) + 1e-8)
    _, _, vt = np.linalg.svd(X, full_matrices=False)
    Z = X @ vt[:2].T
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
