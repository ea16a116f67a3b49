"""Scaled-down adapter comparisons on the embedded Digits data with the pretrained tiny ResNet (prints a table, writes
JSON). All runs share one federated dataset and seed; evaluation only after the last round.

  1. PerAda global-adapter accuracy with vs without server KD (paper Tab. 2: KD improves the global model);
  2. PerAda vs FedAvg+FT (full model) personal accuracy on corrupted client test sets (paper Tab. 1, CIFAR-10-C);
  3. parallel adapters vs full-model FedAvg: upload bytes and accuracy, same rounds (adapters paper, A8 check 4).

    python scripts/compare_adapters.py --num_rounds 5 --output outputs/compare_adapters.json
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num_rounds", type=int, default=5)
    ap.add_argument("--num_clients", type=int, default=8)
    ap.add_argument("--clients_per_round", type=int, default=4)
    ap.add_argument("--partition", default="dirichlet")
    ap.add_argument("--alpha", type=float, default=0.1)
    ap.add_argument("--max_per_domain", type=int, default=300)
    ap.add_argument("--corruption", default="noise:3", help="kind:severity for the corrupted personal test sets")
    ap.add_argument("--kd_steps", type=int, default=50)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default="outputs/compare_adapters.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    from hfpfl.algorithms import get_algorithm
    from hfpfl.algorithms.perada import PerAdaConfig, corrupted_personal_accuracy
    from hfpfl.config import RunArguments
    from hfpfl.data import DataArguments, build_federated_dataset
    from hfpfl.federated.engine import Simulation
    from hfpfl.models.pretrained import default_repo_id, ensure_pretrained

    backbone = ensure_pretrained(default_repo_id("tiny-resnet", "digits"))
    data = DataArguments(num_clients=args.num_clients, partition=args.partition, alpha=args.alpha,
                         min_partition_size=5, max_per_domain=args.max_per_domain)
    fed = build_federated_dataset(data, seed=args.seed)
    out_root = os.path.splitext(args.output)[0] + "_runs"

    def run(name, method, cfg=None, corrupted=False, **kw):
        ra = RunArguments(method=method, model=backbone, num_rounds=args.num_rounds, seed=args.seed, lr=args.lr,
                          clients_per_round=args.clients_per_round, eval_every=args.num_rounds, checkpoint_every=0,
                          output_dir=os.path.join(out_root, name), overwrite_output_dir=True, progress=False, **kw)
        sim = Simulation(ra, data, cfg if cfg is not None else get_algorithm(method).Config(), fed_data=fed)
        if corrupted and not getattr(sim.algorithm.config, "eval_corrupted", None):  # e.g. FedAvg+FT
            algo = sim.algorithm
            algo.extra_metrics = lambda r, s: corrupted_personal_accuracy(algo, r, s, args.corruption)
        t = time.perf_counter()
        res = sim.run()
        f = res["final"]
        row = {"run": name, "method": method, "adapter": ra.adapter, "global_accuracy": f.get("global_accuracy"),
               "personal_accuracy": f.get("personal_accuracy"),
               "personal_accuracy_corrupted": f.get("personal_accuracy_corrupted"),
               "bytes_up": res["communication"]["bytes_up"], "trainable": res["parameters"]["trainable"],
               "wall_s": round(time.perf_counter() - t, 1)}
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        return row

    pa = dict(eval_corrupted=args.corruption, kd_steps=args.kd_steps)
    rows = [
        run("perada_kd", "perada", PerAdaConfig(**pa), adapter="residual", momentum=0.0),
        run("perada_nokd", "perada", PerAdaConfig(use_kd=False, **pa), adapter="residual", momentum=0.0),
        run("fedavg_ft_full", "fedavg_ft", corrupted=True, adapter="none"),
        run("fedavg_full", "fedavg", adapter="none"),
        run("fedavg_parallel", "fedavg", adapter="parallel"),
    ]
    hdr = f"{'run':<18}{'adapter':<10}{'global':>8}{'personal':>10}{'pers.corr':>10}{'bytes up':>14}{'trainable':>11}{'wall s':>8}"
    print("\n" + hdr + "\n" + "-" * len(hdr))
    fmt = lambda v: f"{v:.4f}" if isinstance(v, float) else "-"  # noqa: E731
    for r in rows:
        print(f"{r['run']:<18}{r['adapter']:<10}{fmt(r['global_accuracy']):>8}{fmt(r['personal_accuracy']):>10}"
              f"{fmt(r['personal_accuracy_corrupted']):>10}{r['bytes_up']:>14,}{r['trainable']:>11,}{r['wall_s']:>8}")
    full, par = rows[3], rows[4]
    summary = {"settings": vars(args), "backbone": backbone, "rows": rows,
               "kd_gain_global": rows[0]["global_accuracy"] - rows[1]["global_accuracy"],
               "perada_vs_fedavg_ft_corrupted": rows[0]["personal_accuracy_corrupted"] - rows[2]["personal_accuracy_corrupted"],
               "upload_ratio_full_over_parallel": full["bytes_up"] / par["bytes_up"],
               "parallel_minus_full_global": par["global_accuracy"] - full["global_accuracy"]}
    print(f"\nKD gain (global): {summary['kd_gain_global']:+.4f}   PerAda - FedAvg+FT (corrupted personal): "
          f"{summary['perada_vs_fedavg_ft_corrupted']:+.4f}   upload full/parallel: "
          f"{summary['upload_ratio_full_over_parallel']:.2f}x   parallel - full (global): "
          f"{summary['parallel_minus_full_global']:+.4f}")
    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(summary, f, indent=2)
    print(f"wrote {args.output}")
    return summary


if __name__ == "__main__":
    main()
