"""FedBasis on the PFLBED-style Digits setting (domain shift + Dirichlet(0.3) class skew, label-re-weighted shared
domain tests): improved vs naive training (collapse diagnostic, spec B3.3) and, for new clients, coefficients only
vs full fine-tuning (spec B8). Mean +- std over seeds.

    python scripts/compare_fedbasis.py --seeds 0 1 2 --output_dir outputs/compare_fedbasis
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
    algo.config.new_client_steps = 0
    accs = []
    for c in fed.new_clients:
        sim.ctx.load(sim.initial_private)
        model = algo.personalize_new_client(c.client_id, sim.server_state, None, sim.round)
        accs.append(label_weighted_accuracy(model, c, fed.num_labels))
    row["new_uniform"] = float(np.mean(accs))
    return row


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
    p.add_argument("--output_dir", default="outputs/compare_fedbasis")
    a = p.parse_args()
    torch.set_num_threads(1)
    os.makedirs(a.output_dir, exist_ok=True)
    rows = {"improved": [], "naive": []}
    t0 = time.time()
    for seed in a.seeds:
        fed = pflbed(clients_per_domain=a.clients_per_domain, new_per_domain=a.new_per_domain,
                     max_per_domain=a.max_per_domain, image_size=a.image_size, seed=seed)
        for tr in rows:
            rows[tr].append(run_one(tr, fed, seed, a))
            print(f"[{time.time() - t0:.0f}s] seed {seed} {tr}: {rows[tr][-1]}", flush=True)
            with open(os.path.join(a.output_dir, "rows.json"), "w") as f:
                json.dump(rows, f, indent=1)
    cols = ["participants", "new_uniform", "new_coef", "new_full", "basis_update_cosine", "alpha_entropy"]
    print(f"\nmean +- std over seeds {a.seeds}")
    print(f"{'training':<10}" + "".join(f"{c:>22}" for c in cols))
    for tr, rs in rows.items():
        print(f"{tr:<10}" + "".join("{:>22}".format("%.3f+-%.3f" % (np.mean([r.get(c, np.nan) for r in rs]),
                                                                     np.std([r.get(c, np.nan) for r in rs])))
                                    for c in cols))


if __name__ == "__main__":
    main()
