"""FedBasis on the PFLBED-style Digits setting (domain shift + Dirichlet class skew; new clients learn coefficients).

    accelerate launch recipes/fedbasis.py --output_dir outputs/fedbasis
    python recipes/fedbasis.py --training naive          # the collapse diagnostic (basis cosine, alpha entropy)
    python recipes/fedbasis.py --help

--num_clients / --num_new_clients are per domain (domains: mnist, usps, mnistm, syn); --alpha is the Dirichlet
concentration (default 0.3). results.json holds per-client and new-client accuracy on the domains' shared test sets
(unweighted; scripts/compare_fedbasis.py reports PFLBED's label-re-weighted accuracy), bytes per client and part,
and the diagnostics basis_cosine / basis_update_cosine / alpha_entropy in the final metrics.
"""
from hfpfl.cli import run_recipe

# the setting of the README's FedBasis table (scripts/compare_fedbasis.py --rounds 8 --local_steps 5
# --new_client_steps 30)
DEFAULTS = dict(num_clients=3, num_new_clients=2, alpha=0.3, max_per_domain=600, image_size=16, num_rounds=8,
                local_steps=5, batch_size=16, lr=0.01, momentum=0.9, weight_decay=1e-4, new_client_steps=30)


def pflbed_data(run, data):
    from hfpfl.data.benchmarks import pflbed
    return pflbed(clients_per_domain=data.num_clients, new_per_domain=data.num_new_clients, alpha=data.alpha,
                  max_per_domain=data.max_per_domain, image_size=data.image_size, num_channels=data.num_channels,
                  seed=run.seed)


def main(argv=None):
    return run_recipe(method="fedbasis", argv=argv, defaults=DEFAULTS, data_fn=pflbed_data, description=__doc__,
                      script=None if argv is None else "recipes/fedbasis.py")


if __name__ == "__main__":
    main()
