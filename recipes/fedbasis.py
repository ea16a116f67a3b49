"""FedBasis on the PFLBED-style Digits setting (domain shift + Dirichlet class skew; new clients learn coefficients).

    accelerate launch recipes/fedbasis.py --output_dir outputs/fedbasis
    python recipes/fedbasis.py --training naive          # the collapse diagnostic (basis cosine, alpha entropy)
    python recipes/fedbasis.py --method fedavg --new_client_epochs 5   # FedAvg+FT on the same data
    python recipes/fedbasis.py --help

--num_clients / --num_new_clients are per domain (domains: mnist, usps, mnistm, syn); --alpha is the Dirichlet
concentration (default 0.3). results.json holds per-client and new-client accuracy on the domains' shared test sets
(unweighted; --label_weighted adds PFLBED's label-re-weighted accuracy), bytes per client and part, and the
diagnostics basis_cosine / basis_update_cosine / alpha_entropy in the final metrics.

The paper's new-client protocol (Sec. 6, Table 2: 20 epochs, lr from {0.005, 0.01, 0.05}, Last and Best by
validation), FedBasis learning the coefficients and the whole classifier, and FedAvg+FT on the same ResNet:
    python recipes/fedbasis.py --paper_new_clients true --new_client_epochs 20 --new_client_mode head
    python recipes/fedbasis.py --paper_new_clients true --new_client_epochs 20 --warm_fraction 1 --new_client_mode major_ft
"""
import dataclasses
from dataclasses import dataclass

from hfpfl.cli import run_recipe
from hfpfl.options import in_range, option

# the setting of the FedBasis study (hfpfl/experiments/studies/fedbasis_digits.py)
DEFAULTS = dict(num_clients=3, num_new_clients=2, alpha=0.3, max_per_domain=600, image_size=16, num_rounds=8,
                local_steps=5, batch_size=16, lr=0.01, momentum=0.9, weight_decay=1e-4, new_client_steps=30)


@dataclass
class PflbedOptions:
    label_weighted: bool = option(False, "Also report PFLBED's label-re-weighted accuracy (each shared domain test "
                                  "image weighted by the client's training label distribution), for the "
                                  "participants (personal_accuracy_lw) and the adapted new clients "
                                  "(new_client_accuracy_lw, new_start_accuracy_lw: before adapting).")
    paper_new_clients: bool = option(False, "The paper's new-client protocol (Sec. 6, Table 2): a class-stratified "
                                     "quarter of each domain's shared test split becomes the domain's shared "
                                     "validation split (the paper's 5 percent validation / 15 percent test); each "
                                     "new client trains --new_client_epochs epochs at every lr of "
                                     "--new_client_lr_grid (what it trains: --new_client_mode); the lr and the Best "
                                     "epoch are chosen on validation, never on test. Label-re-weighted: "
                                     "new_client_accuracy_lw = Last, new_best_accuracy_lw = Best, new_delta_lw = "
                                     "|Best - Last|, new_start_accuracy_lw = before training, new_last_lr<i>_lw / "
                                     "new_best_lr<i>_lw at grid lr i (Tables 4-5). Needs --method fedbasis.")
    new_client_fraction: float = option(1.0, "Share of each new client's training split it trains on in "
                                        "--paper_new_clients (a seeded random subset, at least one image): the "
                                        "paper's training sizes (Sec. 6 and suppl.: Small = 0.5, Moderate = 1).",
                                        check=in_range(0, 1, low_open=True))


RECIPE_OPTIONS = PflbedOptions  # this recipe's own options (docs/reference/options.md lists them)


#: the share of each domain's held-out images that is validation: the paper's 5 / (5 + 15) (Sec. 5, PFLBED)
VAL_SHARE = 0.25


def pflbed_data(run, data, opts=None):
    from hfpfl.data.benchmarks import pflbed
    if opts is not None and opts.paper_new_clients:
        if run.method != "fedbasis":
            raise ValueError(f"--paper_new_clients runs FedBasis' new-client protocol, got --method {run.method}: "
                             "use --method fedbasis (FedAvg+FT on the same ResNet: --warm_fraction 1 "
                             "--new_client_mode major_ft)")
        if run.new_client_epochs < 1:
            raise ValueError("--paper_new_clients needs --new_client_epochs >= 1 (the paper: 20), got "
                             f"{run.new_client_epochs}")
    fed = pflbed(clients_per_domain=data.num_clients, new_per_domain=data.num_new_clients, alpha=data.alpha,
                 max_per_domain=data.max_per_domain, image_size=data.image_size, num_channels=data.num_channels,
                 seed=run.seed)
    if opts is not None and opts.paper_new_clients:
        fed = with_domain_validation(fed, VAL_SHARE, seed=run.seed)
    return fed


def with_domain_validation(fed, share: float, seed: int):
    """Each domain's shared test split cut, class by class (seeded), into a shared validation split (round(share *
    n_c) images of class c) and the rest, the shared test split (PFLBED, Sec. 5: "a class-balanced
    test/validation set ... shared with all clients from this domain")."""
    import numpy as np
    from datasets import concatenate_datasets
    rng = np.random.default_rng([seed, 39])
    cuts, tests = {}, []
    for c in fed.clients + fed.new_clients:
        if c.domain in cuts:
            continue
        y = np.asarray(c.test.with_format(None)["labels"])
        val_idx = []
        for label in np.unique(y):
            idx = rng.permutation(np.flatnonzero(y == label))
            val_idx.extend(idx[:int(round(share * len(idx)))].tolist())
        test_idx = sorted(set(range(len(y))) - set(val_idx))
        cuts[c.domain] = (c.test.select(test_idx), c.test.select(sorted(val_idx)))
        tests.append(cuts[c.domain][0])

    def cut(c):
        test, val = cuts[c.domain]
        return dataclasses.replace(c, test=test, val=val)

    return dataclasses.replace(fed, clients=[cut(c) for c in fed.clients], new_clients=[cut(c) for c in fed.new_clients],
                               global_test=concatenate_datasets(tests))


def after(sim, results):
    if sim.recipe_settings.get("label_weighted"):
        results["final"].update(label_weighted_metrics(sim))
    if sim.recipe_settings.get("paper_new_clients"):
        results["final"].update(paper_new_client_metrics(sim))


def paper_new_client_metrics(sim) -> dict:
    """The paper's new-client protocol (Sec. 6, Table 2) on the final bases: every new client trains from the same
    start at each grid lr (the same seed: the same batches), scored after every epoch on its domain's validation
    and test splits (PFLBED's label-re-weighted accuracy); Last / Best as :func:`hfpfl.algorithms.fedbasis.
    best_and_last` chooses them (lr and epoch on validation only); the means over new clients."""
    import numpy as np

    from hfpfl.algorithms.fedbasis import best_and_last
    from hfpfl.data.benchmarks import label_weighted_accuracy
    fed, algo, n = sim.data, sim.algorithm, sim.num_clients
    grid, epochs = algo.config.lr_grid(), sim.args.new_client_epochs
    fraction = sim.recipe_settings.get("new_client_fraction", 1.0)
    rows = []
    for j, c in enumerate(fed.new_clients):
        cid, on_val = n + j, dataclasses.replace(c, test=c.val)

        def score(model, c=c, on_val=on_val):
            return (label_weighted_accuracy(model, on_val, fed.num_labels),
                    label_weighted_accuracy(model, c, fed.num_labels))

        data = sim.train_data(cid)
        if fraction < 1:
            data = training_share(data, fraction, seed=sim.seed_for(sim.round, cid, "new-client-size"))
        curves = []
        for lr in grid:
            sim.seed_torch(sim.seed_for(sim.round, cid, "new-client"))
            curves.append(algo.new_client_curve(cid, sim.server_state, data, sim.round, lr, epochs, score))
        rows.append(best_and_last(curves))
    algo.model.major_only = False
    if not rows:
        return {}
    out = {"new_client_accuracy_lw": float(np.mean([r["last"] for r in rows])),
           "new_best_accuracy_lw": float(np.mean([r["best"] for r in rows])),
           "new_start_accuracy_lw": float(np.mean([r["start"] for r in rows]))}
    out["new_delta_lw"] = abs(out["new_best_accuracy_lw"] - out["new_client_accuracy_lw"])
    for i in range(len(grid)):
        out[f"new_last_lr{i}_lw"] = float(np.mean([r["per_lr"][i]["last"] for r in rows]))
        out[f"new_best_lr{i}_lw"] = float(np.mean([r["per_lr"][i]["best"] for r in rows]))
    return out


def training_share(data, fraction: float, seed: int):
    """The first max(1, round(fraction * n)) images of a seeded permutation of ``data`` (in their original order);
    ``data`` itself at fraction 1 (the paper's Small / Moderate training sizes: 50 / 100 percent, Sec. 6)."""
    if fraction >= 1:
        return data
    import numpy as np
    n = len(data)
    import torch

    from hfpfl.training.tensor_data import TensorData
    keep = np.sort(np.random.default_rng(seed).permutation(n)[:max(1, int(round(fraction * n)))])
    return TensorData.of(**data.select(torch.as_tensor(keep)))


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
