"""FedBiP (one-shot FL with a personalized latent diffusion model; dissertation ch. 5; docs/methods/fedbip.md).

    python recipes/fedbip.py                       # the default comparison, one process per idle core (or GPU)
    python recipes/fedbip.py --num_processes 1     # in one process: the same numbers, ~1.4x the time on 2 cores
    accelerate launch recipes/fedbip.py            # in the processes accelerate starts (one on a CPU by default)
    python recipes/fedbip.py --seeds 0,1,2         # mean +- std over seeds, claims held / not held
    python recipes/fedbip.py --all_variants        # + FedBiP-M and the no-perturbation ablation
    python recipes/fedbip.py --compare false --multiplier 10         # FedBiP-L alone, results.json + grid
    python recipes/fedbip.py --config recipes/configs/fedbip_dirichlet.yaml   # label-space heterogeneity
    python recipes/fedbip.py --ldm CompVis/stable-diffusion-v1-4 --image_size 64 ...   # a real LDM (cached)
    python recipes/fedbip.py --help                # every option (run, data, FedBiP, recipe)

The comparison (variants, table, seeds) lives in :mod:`hfpfl.fedbip.compare`.
"""
from hfpfl.fedbip.compare import DEFAULTS, RecipeArguments, format_comparison, main, parse  # noqa: F401

RECIPE_OPTIONS = RecipeArguments  # this recipe's own options (docs/reference/options.md lists them)

if __name__ == "__main__":
    main()
