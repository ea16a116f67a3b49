"""Compare baselines on one federated benchmark over several seeds (default: the Digits feature-shift
benchmark, where FedBN's paper claims FedBN >= FedAvg in mean per-client accuracy).

    python scripts/compare_baselines.py --methods fedavg fedbn --seeds 0 1 2 --num_rounds 20
    python scripts/compare_baselines.py --methods fedavg fedprox fedbn local ditto fedper fedrep scaffold -- --partition dirichlet

Extra flags after `--` go to every run (any RunArguments / DataArguments option). Writes
<output_dir>/comparison.json and comparison.png (per-domain accuracy bars) and prints a table.
"""
import argparse
import json
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main():
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=["fedavg", "fedbn"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--num_rounds", type=int, default=20)
    p.add_argument("--output_dir", default="outputs/compare_baselines")
    a = p.parse_args(argv)

    from hfpfl.config import parse_run_args
    from hfpfl.federated.engine import Simulation

    rows = {}
    for method in a.methods:
        for seed in a.seeds:
            out = Path(a.output_dir) / f"{method}-seed{seed}"
            run, data, mcfg = parse_run_args(["--method", method, "--seed", str(seed), "--num_rounds",
                                              str(a.num_rounds), "--output_dir", str(out), "--overwrite_output_dir",
                                              "true", "--checkpoint_every", "0", "--progress", "false", *extra])
            res = Simulation(run, data, mcfg).run()
            rows.setdefault(method, []).append(res)
            print(f"{method:<10} seed {seed}: personal {res['final']['personal_accuracy']:.4f}  "
                  f"global {res['final'].get('global_accuracy', float('nan')):.4f}  {res['wall_time_s']:.0f}s",
                  flush=True)

    summary = {}
    for method, results in rows.items():
        pers = [r["final"]["personal_accuracy"] for r in results]
        domains = sorted(results[0]["per_domain_accuracy"])
        summary[method] = {
            "personal_accuracy_mean": statistics.mean(pers),
            "personal_accuracy_std": statistics.stdev(pers) if len(pers) > 1 else 0.0,
            "per_domain": {d: statistics.mean(r["per_domain_accuracy"][d] for r in results) for d in domains},
            "bytes_up": results[0]["communication"]["bytes_up"],
            "seeds": a.seeds,
        }
    Path(a.output_dir).mkdir(parents=True, exist_ok=True)
    (Path(a.output_dir) / "comparison.json").write_text(json.dumps(summary, indent=2))

    domains = list(next(iter(summary.values()))["per_domain"])
    print(f"\n{'method':<10} {'mean per-client acc':>20} " + " ".join(f"{d:>8}" for d in domains) + f" {'MB up':>8}")
    for m, s in summary.items():
        print(f"{m:<10} {s['personal_accuracy_mean']:>12.4f} ± {s['personal_accuracy_std']:.4f} "
              + " ".join(f"{s['per_domain'][d]:>8.4f}" for d in domains) + f" {s['bytes_up'] / 2**20:>8.1f}")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    fig, ax = plt.subplots(figsize=(1.5 + 1.2 * len(domains), 3.5))
    w = 0.8 / len(summary)
    for i, (m, s) in enumerate(summary.items()):
        ax.bar(np.arange(len(domains)) + i * w, [s["per_domain"][d] for d in domains], w, label=m)
    ax.set_xticks(np.arange(len(domains)) + w * (len(summary) - 1) / 2, domains)
    ax.set_ylabel("mean personal test accuracy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(Path(a.output_dir) / "comparison.png", dpi=100)


if __name__ == "__main__":
    main()
