"""FedPop vs RS vs SHA vs FedEx at the same budget (R_t = N_c * R_c rounds), over seeds, on a Dirichlet label-skew
setting and on the Digits feature-shift setting. CPU toy scale: a tiny MLP (64-64, dropout) on 8x8 images.

    python scripts/compare_fedpop.py --setting dirichlet --seeds 0 1 2 3 4
    python scripts/compare_fedpop.py --setting digits --seeds 0 1 2

Prints and writes (``--output_dir``/table_<setting>.md, runs_<setting>.json) mean +- std of the best member's
validation loss (the selection criterion), global test accuracy and fine-tuned accuracy (A2.10), the rounds used and the
number of distinct (alpha, beta) vectors tried, and the soft check of spec A8: FedPop's best-member validation loss <=
RS's (median over seeds, and per seed).
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

SETTINGS = {
    "dirichlet": dict(dataset="usps", partition="dirichlet", num_clients=10, alpha=0.5, max_per_domain=600,
                      image_size=8, val_fraction=0.2),
    "digits": dict(dataset="digits", partition="feature_shift", num_clients=8, max_per_domain=200, image_size=8,
                   val_fraction=0.2),
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setting", choices=sorted(SETTINGS), default="dirichlet")
    p.add_argument("--tuners", nargs="+", default=["fedpop", "rs", "sha", "fedex"])
    p.add_argument("--method", default="fedavg")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    p.add_argument("--population_size", type=int, default=4)
    p.add_argument("--rounds_per_member", type=int, default=20)
    p.add_argument("--generation_rounds", type=int, default=2)
    p.add_argument("--clients_per_round", type=int, default=5)
    p.add_argument("--sha_start", type=int, default=27)
    p.add_argument("--output_dir", default="outputs/compare_fedpop")
    a = p.parse_args(argv)

    import torch
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from hfpfl.algorithms import get_algorithm
    from hfpfl.config import RunArguments
    from hfpfl.data import DataArguments, build_federated_dataset
    from hfpfl.tuning import Tuner, TunerArguments

    out = Path(a.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for seed in a.seeds:
        da = DataArguments(**SETTINGS[a.setting])
        fed = build_federated_dataset(da, seed=seed)
        for tuner in a.tuners:
            t0 = time.perf_counter()
            ra = RunArguments(method=a.method, model="tiny-mlp", seed=seed, clients_per_round=a.clients_per_round,
                              output_dir=str(out / a.setting / f"{tuner}_s{seed}"), progress=False,
                              overwrite_output_dir=True)
            ta = TunerArguments(tuner=tuner, population_size=a.population_size, rounds_per_member=a.rounds_per_member,
                                generation_rounds=a.generation_rounds, sha_start=a.sha_start)
            res = Tuner(ra, da, get_algorithm(a.method).Config(), ta, fed_data=fed).run()
            b = res["best_member"]
            row = {"seed": seed, "tuner": tuner, "val_loss": b["val_loss"], "global_accuracy": b["global_accuracy"],
                   "personal_accuracy": b["personal_accuracy"], "finetuned_accuracy": b["finetuned_accuracy"],
                   "rounds_used": res["budget"]["rounds_used"], "R_t": res["budget"]["R_t"],
                   "tried_pairs": res["tried"]["pairs"], "wall_s": time.perf_counter() - t0}
            runs.append(row)
            print(json.dumps(row), flush=True)
            (out / f"runs_{a.setting}.json").write_text(json.dumps(runs, indent=1))

    def ms(xs):
        return f"{np.mean(xs):.4f} ± {np.std(xs):.4f}"

    lines = [f"setting {a.setting} ({SETTINGS[a.setting]}), method {a.method}, tiny MLP, N_c={a.population_size}, "
             f"R_c={a.rounds_per_member}, T_g={a.generation_rounds}, K={a.clients_per_round}, seeds {a.seeds}", "",
             "| tuner | best-member val loss | global acc | fine-tuned acc | rounds used / R_t | tried (alpha,beta) |",
             "|---|---|---|---|---|---|"]
    for t in a.tuners:
        rs = [r for r in runs if r["tuner"] == t]
        lines.append(f"| {t} | {ms([r['val_loss'] for r in rs])} | {ms([r['global_accuracy'] for r in rs])} | "
                     f"{ms([r['finetuned_accuracy'] for r in rs])} | {rs[0]['rounds_used']}/{rs[0]['R_t']} | "
                     f"{np.mean([r['tried_pairs'] for r in rs]):.1f} |")
    if "fedpop" in a.tuners and "rs" in a.tuners:
        fp = {r["seed"]: r["val_loss"] for r in runs if r["tuner"] == "fedpop"}
        rsv = {r["seed"]: r["val_loss"] for r in runs if r["tuner"] == "rs"}
        wins = sum(fp[s] <= rsv[s] for s in fp)
        held = np.median(list(fp.values())) <= np.median(list(rsv.values()))
        lines += ["", f"soft check (spec A8): median best-member val loss FedPop {np.median(list(fp.values())):.4f} "
                      f"vs RS {np.median(list(rsv.values())):.4f}: {'held' if held else 'not held'} "
                      f"(FedPop <= RS on {wins}/{len(fp)} seeds)"]
    text = "\n".join(lines)
    print(text)
    (out / f"table_{a.setting}.md").write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
