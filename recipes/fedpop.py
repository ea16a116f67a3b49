"""FedPop: population-based hyperparameter tuning while federated training runs, over any registered method,
with the RS, SHA and FedEx baselines at the same budget (dissertation ch. 4).

    accelerate launch recipes/fedpop.py --method fedavg                  # FedPop, defaults: CPU toy scale
    python recipes/fedpop.py --method fedprox --tuner sha --output_dir outputs/sha
    python recipes/fedpop.py --tuner fedpop_sha --output_dir outputs/fedpop-sha   # FedPop wrapped in SHA (27 -> 9 -> 3)
    python recipes/fedpop.py --search_space my_space.yaml --population_size 5 --rounds_per_member 40
    python recipes/fedpop.py --resume_from_checkpoint latest --output_dir outputs/fedpop-...   # continue a killed run

Writes to --output_dir (default outputs/fedpop-<timestamp>; a folder holding a run is reused only with
--resume_from_checkpoint latest or --overwrite_output_dir): config.yaml, search_space.yaml, results.json (best member +
every member: validation loss, global / personal / fine-tuned accuracy, final alpha and beta^0, budget, number of
tried vectors, FedPop-G events), curves.png (per-member local validation loss per round), hparams.png (alpha and beta^0
of every member over rounds), population.pt (the whole population, saved atomically every generation) and
members/mXX/ (each member's own files). The tuner's own options (--tuner, --population_size, ...) are listed by --help.
Defaults: digits (sklearn 8x8) Dirichlet(0.5) label skew over 10 clients with 20% val splits, a tiny MLP with dropout,
N_c = 4, R_c = 30, K = 5, T_g = 3 (a CPU-scale budget).
"""
import dataclasses
import os

from hfpfl.tuning import TunerArguments as RECIPE_OPTIONS  # this recipe's own options (docs/reference/options.md)

RECIPE_DEFAULTS = {"model": "tiny-mlp", "dataset": "usps", "partition": "dirichlet", "num_clients": 10, "alpha": 0.5,
                   "clients_per_round": 5, "val_fraction": 0.2, "image_size": 8, "progress": False}
POPULATION_FILES = ("population.pt", "search_space.yaml", "curves.png", "hparams.png")


def recipe_defaults(algo_cls) -> dict:
    """RECIPE_DEFAULTS, and momentum / weight decay 0 for a method that does not read them (SCAFFOLD's option II
    requires plain SGD); a flag or a --config file still sets them."""
    unused = {k: 0.0 for k in ("momentum", "weight_decay") if k not in algo_cls.uses_client_hparams}
    return {**RECIPE_DEFAULTS, **unused}


def main(argv=None):
    from hfpfl.arguments import parse_run_args
    from hfpfl.cli import USER_ERRORS, fail
    from hfpfl.runtime import cleanup_on_failure, prepare_output_dir, resolve_output_dir
    from hfpfl.tuning import Tuner
    from hfpfl.tuning.models import TINY_MLP

    try:
        run, data, method_cfg, targs = parse_run_args(
            argv, method="fedavg", prog="recipes/fedpop.py", description=__doc__.split("\n\n")[0],
            defaults=recipe_defaults, recipe_options=RECIPE_OPTIONS, extra_models=(TINY_MLP,))
        if run.resume_from_checkpoint:
            targs = dataclasses.replace(targs, resume=True)
        run = dataclasses.replace(run, output_dir=resolve_output_dir(run.output_dir, "fedpop"))
        out = run.output_dir
        with cleanup_on_failure(out):  # a population that cannot start leaves no folder behind
            # the one output-folder rule (hfpfl.runtime); the population checkpoint marks a started run
            prepare_output_dir(out, overwrite=run.overwrite_output_dir, resume=targs.resume,
                               run_files=POPULATION_FILES)
            tuner = Tuner(run, data, method_cfg, targs)
        res = tuner.run()
    except USER_ERRORS as e:
        fail(e)
    if tuner.accelerator.is_main_process:
        b = res["best_member"]
        print(f"{res['tuner']} over {res['method']}: budget {res['budget']['rounds_used']}/{res['budget']['R_t']} rounds,"
              f" tried {res['tried']['alpha']} alpha / {res['tried']['beta']} beta vectors")

        def f(x):
            return "n/a" if x is None else f"{x:.4f}"
        print(f"best member m{b['member']}: val loss {f(b['val_loss'])}  global acc {f(b['global_accuracy'])}  "
              f"personal acc {f(b['personal_accuracy'])}  fine-tuned acc {f(b['finetuned_accuracy'])}")
        print(f"  alpha {b['alpha']}\n  beta0 {b['beta0']}")
        print(f"results: {os.path.join(out, 'results.json')}")
    return res


if __name__ == "__main__":
    main()
