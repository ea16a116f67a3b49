"""FedBasis on the PFLBED-style Digits setting (domain shift + Dirichlet(0.3) class skew, label-re-weighted shared
domain tests): improved vs naive training (collapse diagnostic, spec B3.3) and, for new clients, coefficients only
vs full fine-tuning (spec B8). Mean +- std over seeds.

    python scripts/compare_fedbasis.py --seeds 0 1 2 --output_dir outputs/compare_fedbasis
    python scripts/compare_fedbasis.py --trainings improved --sweep ...   # adaptation steps / lr chosen on validation

--sweep: each new client's training images are split 75/25 (seeded) into fit / validation; every (steps, lr) of the
grid adapts on fit and is scored on validation (plain accuracy: the validation images share the client's label
distribution); the best setting per mode (coefficients only / full fine-tuning), by mean validation accuracy over the
new clients, then adapts on all the client's training images and is scored once on the test split (new_coef_val /
new_full_val). The test split never chooses anything.
"""
import argparse
import json
import os
import time

import numpy as np
import torch

from hfpfl.algorithms import get_algorithm
from hfpfl.config import RunArguments
from hfpfl.data.benchmarks import label_weighted_accuracy, pflbed
from hfpfl.federated.engine import Simulation
from hfpfl.training import TensorData


def run_one(training, fed, seed, a):
    cfg = get_algorithm("fedbasis").Config(num_bases=a.num_bases, training=training, widths=a.widths,
                                           depths=a.depths, new_client_steps=a.new_client_steps)
    run = RunArguments(method="fedbasis", num_rounds=a.rounds, local_steps=a.local_steps, batch_size=16, lr=0.01,
                       momentum=0.9, weight_decay=1e-4, seed=seed, progress=False, checkpoint_every=0,
                       eval_every=a.rounds, overwrite_output_dir=True,
                       output_dir=os.path.join(a.output_dir, f"{training}_s{seed}"))
    sim = Simulation(run, None, cfg, fed_data=fed)
    res = sim.run()
    algo = sim.algorithm
    row = {k: res["final"][k] for k in ("basis_cosine", "basis_update_cosine", "alpha_entropy") if k in res["final"]}
    accs = []
    for i, c in enumerate(fed.clients):
        sim.ctx.load(sim.initial_private)
        model = algo.load_personal(i, sim.server_state, sim.store.get(i), sim.round)
        accs.append(label_weighted_accuracy(model, c, fed.num_labels))
    row["participants"] = float(np.mean(accs))
    for mode in ("coef", "full"):
        algo.config.new_client_mode = mode
        accs = []
        for c in fed.new_clients:
            sim.ctx.load(sim.initial_private)
            model = algo.personalize_new_client(c.client_id, sim.server_state, TensorData.from_dataset(c.train),
                                                sim.round)
            accs.append(label_weighted_accuracy(model, c, fed.num_labels))
        row[f"new_{mode}"] = float(np.mean(accs))
    if a.sweep:
        row.update(sweep(sim, fed, seed, a))
    algo.config.new_client_steps = 0
    accs = []
    for c in fed.new_clients:
        sim.ctx.load(sim.initial_private)
        model = algo.personalize_new_client(c.client_id, sim.server_state, None, sim.round)
        accs.append(label_weighted_accuracy(model, c, fed.num_labels))
    row["new_uniform"] = float(np.mean(accs))
    return row


def _adapt(sim, c, data, mode, steps, lr):
    algo = sim.algorithm
    algo.config.new_client_mode, algo.config.new_client_steps = mode, steps
    if mode == "coef":
        algo.config.lr_coef = lr
    else:
        algo.config.lr_full = lr
    sim.ctx.load(sim.initial_private)
    torch.manual_seed(sim.seed_for(sim.round, c.client_id, "new-client"))
    return algo.personalize_new_client(c.client_id, sim.server_state, data, sim.round)


def sweep(sim, fed, seed, a):
    algo = sim.algorithm
    saved = (algo.config.new_client_mode, algo.config.new_client_steps, algo.config.lr_coef, algo.config.lr_full)
    grids = {"coef": [(st, lr) for st in a.sweep_steps for lr in a.sweep_lr_coef],
             "full": [(st, lr) for st in a.sweep_steps for lr in a.sweep_lr_full]}
    out = {}
    for mode, grid in grids.items():
        val = {}
        for c in fed.new_clients:
            ds = c.train.with_format(None)
            n_val = max(1, len(ds) // 4)
            perm = np.random.default_rng([seed, 37, c.client_id]).permutation(len(ds))
            fit = TensorData.from_dataset(c.train.select(np.sort(perm[n_val:])))
            held = TensorData.from_dataset(c.train.select(np.sort(perm[:n_val])))
            for cfg in grid:
                model = _adapt(sim, c, fit, mode, *cfg)
                val.setdefault(cfg, []).append(sim.ctx.evaluate(model, held)["accuracy"])
        best = max(grid, key=lambda g: (np.mean(val[g]), -g[0]))     # ties: fewer steps
        accs = [label_weighted_accuracy(_adapt(sim, c, TensorData.from_dataset(c.train), mode, *best), c,
                                        fed.num_labels) for c in fed.new_clients]
        out[f"new_{mode}_val"] = float(np.mean(accs))
        out[f"sweep_{mode}"] = {"chosen": list(best), "val": {f"{st}@{lr}": float(np.mean(v))
                                                              for (st, lr), v in val.items()}}
        print(f"  sweep {mode}: chosen steps={best[0]} lr={best[1]} (val {np.mean(val[best]):.3f}); "
              f"test {out[f'new_{mode}_val']:.3f}", flush=True)
    (algo.config.new_client_mode, algo.config.new_client_steps, algo.config.lr_coef, algo.config.lr_full) = saved
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--local_steps", type=int, default=5)
    p.add_argument("--num_bases", type=int, default=3)
    p.add_argument("--widths", default="8,16,32,64")
    p.add_argument("--depths", default="1,1,1,1")
    p.add_argument("--new_client_steps", type=int, default=50)
    p.add_argument("--clients_per_domain", type=int, default=3)
    p.add_argument("--new_per_domain", type=int, default=2)
    p.add_argument("--max_per_domain", type=int, default=600)
    p.add_argument("--image_size", type=int, default=16)
    p.add_argument("--trainings", nargs="+", choices=["improved", "naive"], default=["improved", "naive"])
    p.add_argument("--sweep", action="store_true", help="Choose the new clients' steps / lr on a validation split.")
    p.add_argument("--sweep_steps", type=int, nargs="+", default=[30, 100, 300])
    p.add_argument("--sweep_lr_coef", type=float, nargs="+", default=[0.1, 1.0])
    p.add_argument("--sweep_lr_full", type=float, nargs="+", default=[0.01])
    p.add_argument("--output_dir", default="outputs/compare_fedbasis")
    p.add_argument("--merge", nargs="+", default=None, metavar="DIR",
                   help="Only summarize: merge the rows.json of earlier runs (e.g. one process per seed).")
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.merge:
        rows = {t: [] for t in a.trainings}
        for d in a.merge:
            with open(os.path.join(d, "rows.json")) as f:
                got = json.load(f)
            for t in rows:
                rows[t].extend(got.get(t, []))
        return summarize(rows, a)
    os.makedirs(a.output_dir, exist_ok=True)
    rows = {t: [] for t in a.trainings}
    t0 = time.time()
    for seed in a.seeds:
        fed = pflbed(clients_per_domain=a.clients_per_domain, new_per_domain=a.new_per_domain,
                     max_per_domain=a.max_per_domain, image_size=a.image_size, seed=seed)
        for tr in rows:
            rows[tr].append(run_one(tr, fed, seed, a))
            print(f"[{time.time() - t0:.0f}s] seed {seed} {tr}: {rows[tr][-1]}", flush=True)
            with open(os.path.join(a.output_dir, "rows.json"), "w") as f:
                json.dump(rows, f, indent=1)
    summarize(rows, a)


def summarize(rows, a):
    cols = ["participants", "new_uniform", "new_coef", "new_full", "basis_update_cosine", "alpha_entropy"]
    cols += ["new_coef_val", "new_full_val"] if any("new_coef_val" in r for rs in rows.values() for r in rs) else []
    print(f"\nmean +- std over {len(next(iter(rows.values())))} seeds")
    print(f"{'training':<10}" + "".join(f"{c:>22}" for c in cols))
    for tr, rs in rows.items():
        print(f"{tr:<10}" + "".join("{:>22}".format("%.3f+-%.3f" % (np.mean([r.get(c, np.nan) for r in rs]),
                                                                     np.std([r.get(c, np.nan) for r in rs])))
                                    for c in cols))


if __name__ == "__main__":
    main()
