"""FedBasis on the PFLBED-style Digits setting (domain shift + Dirichlet class skew; new clients learn coefficients).

    accelerate launch recipes/fedbasis.py --output_dir outputs/fedbasis
    python recipes/fedbasis.py --training naive          # the collapse diagnostic (basis cosine, alpha entropy)
    python recipes/fedbasis.py --method fedavg --new_client_epochs 5   # FedAvg+FT on the same data
    python recipes/fedbasis.py --help

--num_clients / --num_new_clients are per domain (domains: mnist, usps, mnistm, syn); --alpha is the Dirichlet
concentration (default 0.3). results.json holds per-client and new-client accuracy on the domains' shared test sets
(unweighted; --label_weighted adds PFLBED's label-re-weighted accuracy), bytes per client and part, and the
diagnostics basis_cosine / basis_update_cosine / alpha_entropy in the final metrics.
"""
from dataclasses import dataclass

from hfpfl.cli import run_recipe
from hfpfl.options import option

# the setting of the FedBasis study (hfpfl/experiments/studies/fedbasis_digits.py)
DEFAULTS = dict(num_clients=3, num_new_clients=2, alpha=0.3, max_per_domain=600, image_size=16, num_rounds=8,
                local_steps=5, batch_size=16, lr=0.01, momentum=0.9, weight_decay=1e-4, new_client_steps=30)


@dataclass
class PflbedOptions:
    label_weighted: bool = option(False, "Also report PFLBED's label-re-weighted accuracy (each shared domain test "
                                  "image weighted by the client's training label distribution), for the "
                                  "participants (personal_accuracy_lw) and the adapted new clients "
                                  "(new_client_accuracy_lw, new_start_accuracy_lw: before adapting).")


RECIPE_OPTIONS = PflbedOptions  # this recipe's own options (docs/reference/options.md lists them)


def pflbed_data(run, data, opts=None):
    from hfpfl.data.benchmarks import pflbed
    return pflbed(clients_per_domain=data.num_clients, new_per_domain=data.num_new_clients, alpha=data.alpha,
                  max_per_domain=data.max_per_domain, image_size=data.image_size, num_channels=data.num_channels,
                  seed=run.seed)


def after(sim, results):
    if sim.recipe_settings.get("label_weighted"):
        results["final"].update(label_weighted_metrics(sim))


def label_weighted_metrics(sim) -> dict:
    """PFLBED's metric for the participants' personal models (as the engine loads them) and for the new clients,
    adapted as the engine adapts them (same seed) and before adapting (0 steps / epochs)."""
    import numpy as np

    from hfpfl.data.benchmarks import label_weighted_accuracy
    fed, algo, n = sim.data, sim.algorithm, sim.num_clients
    out = {}
    accs = [label_weighted_accuracy(model, fed.clients[i], fed.num_labels)
            for i, model in sim.evaluator.personal_models(range(n), sim.server_state, sim.round)]
    out["personal_accuracy_lw"] = float(np.mean(accs))

    def new_clients(adapt: bool) -> float:
        cfg, args = getattr(algo, "config", None), sim.args
        saved = (getattr(cfg, "new_client_steps", None), args.new_client_epochs)
        if not adapt:
            if saved[0] is not None:
                cfg.new_client_steps = 0
            object.__setattr__(args, "new_client_epochs", 0)
        try:
            accs = []
            for j, c in enumerate(fed.new_clients):
                sim.seed_torch(sim.seed_for(sim.round, n + j, "new-client"))
                sim.ctx.load(sim.initial_private)
                model = algo.personalize_new_client(n + j, sim.server_state, sim.train_data(n + j), sim.round)
                accs.append(label_weighted_accuracy(model, c, fed.num_labels))
            return float(np.mean(accs))
        finally:
            if saved[0] is not None:
                cfg.new_client_steps = saved[0]
            object.__setattr__(args, "new_client_epochs", saved[1])

    if fed.new_clients:
        out["new_client_accuracy_lw"] = new_clients(True)
        out["new_start_accuracy_lw"] = new_clients(False)
    return out


def main(argv=None):
    return run_recipe(method="fedbasis", argv=argv, defaults=DEFAULTS, data_fn=pflbed_data, description=__doc__,
                      recipe_options=PflbedOptions, after=after,
                      script=None if argv is None else "recipes/fedbasis.py")


if __name__ == "__main__":
    main()
