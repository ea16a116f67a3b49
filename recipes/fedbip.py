"""FedBiP (one-shot FL with a personalized latent diffusion model; dissertation ch. 5; docs/methods/fedbip.md).

    python recipes/fedbip.py                       # prompt only, FedBiP-L, FGL, FedAvg, Central + controls, one table
    python recipes/fedbip.py --all_variants        # every row of Tables 1 and 3 (ablations, FedBiP-S/M/L, one-shot baselines)
    python recipes/fedbip.py --seeds 0,1,2         # mean +- sample std over seeds, claims held / not held
    python recipes/fedbip.py --num_processes 1     # in one process: the same numbers
    accelerate launch recipes/fedbip.py            # in the processes accelerate starts (one on a CPU by default)
    python recipes/fedbip.py --compare false --multiplier 10         # FedBiP-L alone, results.json + grid
    python recipes/fedbip.py --config recipes/configs/fedbip_dirichlet.yaml   # label-space heterogeneity
    python recipes/fedbip.py --ldm CompVis/stable-diffusion-v1-4 --image_size 64 ...   # a real LDM (cached)
    python recipes/fedbip.py --help                # every option (run, data, FedBiP, recipe)

The rows are the study fedbip_digits's (docs/results/fedbip_digits.md); the comparison lives in
:mod:`hfpfl.experiments.fedbip_compare`, its summary and claims in the study runner (:mod:`hfpfl.experiments`).
"""
from hfpfl.experiments.fedbip_compare import DEFAULTS, RecipeArguments, format_table, main, parse  # noqa: F401

RECIPE_OPTIONS = RecipeArguments  # this recipe's own options (docs/reference/options.md lists them)

if __name__ == "__main__":
    main()
