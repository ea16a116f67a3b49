"""FedPop: population-based hyperparameter tuning while federated training runs, over any registered method,
with the RS, SHA and FedEx baselines at the same budget (spec PART A; dissertation ch. 4).

    accelerate launch recipes/fedpop.py --method fedavg                  # FedPop, defaults: CPU toy scale
    python recipes/fedpop.py --method fedprox --tuner sha --output_dir outputs/sha
    python recipes/fedpop.py --search_space my_space.yaml --population_size 5 --rounds_per_member 40
    python recipes/fedpop.py --resume true ...                           # continue a killed run (population.pt)

Writes to --output_dir: config.yaml, search_space.yaml, results.json (best member + every member: validation loss,
global / personal / fine-tuned accuracy, final alpha and beta^0, budget, number of tried vectors, FedPop-G events),
curves.png (per-member local validation loss per round), hparams.png (alpha and beta^0 of every member over rounds),
population.pt (the whole population, saved atomically every generation) and members/mXX/ (each member's own files).
Defaults: digits (sklearn 8x8) Dirichlet(0.5) label skew over 10 clients with 20% val splits, a tiny MLP with dropout,
N_c = 4, R_c = 30, K = 5, T_g = 3 (spec A8).
"""
import argparse
import os
import sys

RECIPE_DEFAULTS = {"model": "tiny-mlp", "dataset": "usps", "partition": "dirichlet", "num_clients": 10, "alpha": 0.5,
                   "clients_per_round": 5, "val_fraction": 0.2, "image_size": 8, "output_dir": "outputs/fedpop",
                   "progress": False}


def main(argv=None):
    from hfpfl.config import _OptionParser as HfArgumentParser  # leaves the declared checks out of argparse

    from hfpfl.algorithms import get_algorithm
    from hfpfl.config import RunArguments, load_config_file
    from hfpfl.data import DataArguments
    from hfpfl.tuning import Tuner, TunerArguments

    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--method", default="fedavg")
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    algo = get_algorithm(known.method)
    types = [RunArguments, DataArguments, algo.Config, TunerArguments]
    parser = HfArgumentParser(types, prog="fedpop.py", description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", default=None, help="YAML/JSON file of options; flags override it.")
    file_values = load_config_file(known.config, types) if known.config else {}
    # a method that does not read client momentum / weight decay gets 0 (SCAFFOLD's option II requires plain SGD)
    unused = {k: 0.0 for k in ("momentum", "weight_decay") if k not in algo.uses_client_hparams}
    parser.set_defaults(**{**RECIPE_DEFAULTS, **unused, **file_values, "method": known.method})
    run, data, method_cfg, targs, _ = parser.parse_args_into_dataclasses(args=argv)
    if run.resume_from_checkpoint:
        targs.resume = True
    out = run.output_dir
    exists = any(os.path.exists(os.path.join(out, f)) for f in ("results.json", "population.pt"))
    if exists and not targs.resume and not run.overwrite_output_dir:
        print(f"error: {out!r} holds a tuning run; pass --resume true to continue it, --overwrite_output_dir to "
              "replace it, or another --output_dir", file=sys.stderr)
        raise SystemExit(2)
    if run.overwrite_output_dir and not targs.resume:
        for f in ("results.json", "population.pt"):
            if os.path.exists(os.path.join(out, f)):
                os.remove(os.path.join(out, f))
    try:
        tuner = Tuner(run, data, method_cfg, targs)
        res = tuner.run()
    except (ValueError, KeyError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if tuner.accelerator.is_main_process:
        b = res["best_member"]
        print(f"{res['tuner']} over {res['method']}: budget {res['budget']['rounds_used']}/{res['budget']['R_t']} rounds,"
              f" tried {res['tried']['alpha']} alpha / {res['tried']['beta']} beta vectors")
        def f(x):
            return "n/a" if x is None else f"{x:.4f}"
        print(f"best member m{b['member']}: val loss {f(b['val_loss'])}  global acc {f(b['global_accuracy'])}  "
              f"personal acc {f(b['personal_accuracy'])}  fine-tuned acc {f(b['finetuned_accuracy'])}")
        print(f"  alpha {b['alpha']}\n  beta0 {b['beta0']}" + (f"\n  method {b['method']}" if b.get("method") else ""))
        print(f"results: {os.path.join(out, 'results.json')}")
    return res


if __name__ == "__main__":
    main()
