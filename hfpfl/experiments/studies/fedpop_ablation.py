"""FedPop's components: FedPop-L alone, FedPop-G alone, both, and FedPop-L windows of several rounds, at one budget.

The paper (Chen 2025, dissertation chapter 4, FedPop, AAAI 2025), Table 4: with the RS wrapper on CIFAR-10, each
component alone already beats RS and both together beat either -- Dir(0.5): RS 62.88, FedPop-G 65.63, FedPop-L
64.24, FedPop 67.01 (IID 69.04 / 70.61 / 70.03 / 71.18; Dir(1.0) 63.47 / 66.81 / 67.50 / 68.25). The appendix
("Annealing process") runs FedPop-L only in the first r_0 = 0.2 T_g rounds of a new configuration (T_g = 0.1 R_c = 80
there, so a window of 16 rounds) and reports that this early stop is comparable to FedPop-L in every round (no
number). Here: the fedpop_tuning study's `dir` setting and tuner settings, unchanged (USPS, Dirichlet(0.5) over 10
clients, 8x8 images, tiny MLP with dropout, FedAvg under the tuner, K = 5, N_c = 4, R_c = 12, R_t = 48, T_g = 2);
the ablation switches are `--fedpop_l false` (FedPop-G alone) and `--fedpop_g false` (FedPop-L alone). At T_g = 2
FedPop-L's window is ceil(0.2 * 2) = 1 round, so the rows that measure FedPop-L over several rounds are: T_g = 10
(window ceil(0.2 * 10) = 2 rounds; FedPop-G fires once, at round 10) and `--local_window_frac 0` (FedPop-L in every
round, Algorithm 1: a window of all 12 rounds), alone and with FedPop-G. The window in rounds is in each row's
label. Cut to fit: only the Dir(0.5) column (the `dir` setting; Table 4's IID and Dir(1.0) columns are not run),
3 seeds (the paper: 5). Rows: the best member (lowest validation loss) -- its global model's test accuracy (primary,
Table 4's metric) and fine-tuned on each client; all tuners spend the same 48 communication rounds (matched by
rounds: each candidate trains with its own local epochs and batch size, so steps differ by design)."""
from __future__ import annotations

from hfpfl.experiments import Study, Variant, greater, within
from hfpfl.experiments.studies.fedpop_tuning import KIND, RECIPE, SETTINGS, TUNE

T4 = "Chen 2025, ch. 4, Table 4 (CIFAR-10 Dir(0.5), RS wrapper)"


def row(name: str, label: str, *flags: str, tuner: str = "fedpop", paper: str | None = None) -> Variant:
    return Variant(f"{name}_dir", (*SETTINGS["dir"], *TUNE, "--tuner", tuner, *flags), kind=KIND, recipe=RECIPE,
                   label=f"{label}, dir", paper=paper)


STUDY = Study(
    name="fedpop_ablation",
    title="FedPop-L alone, FedPop-G alone and both, with FedPop-L windows of 1, 2 and 12 rounds (Table 4)",
    paper="FedPop: Federated Population-based Hyperparameter Tuning (AAAI 2025); Chen 2025 (dissertation), ch. 4, "
          "Table 4 and appendix (FedPop-L's window)",
    description=__doc__.split("\n\n", 1)[1].replace("\n", " "),
    seeds=(0, 1, 2),
    metrics={"global_accuracy": "best member's global model", "finetuned_accuracy": "fine-tuned on each client",
             "val_loss": "best member's validation loss", "tried_configs": "(alpha, beta) vectors tried"},
    variants=(
        row("rs", "RS", tuner="rs", paper="62.88"),
        row("fedpop_g", "FedPop-G only", "--fedpop_l", "false", paper="65.63"),
        row("fedpop_l", "FedPop-L only (window 1 round)", "--fedpop_g", "false", paper="64.24 (window 16 rounds)"),
        row("fedpop", "FedPop (window 1 round)", paper="67.01 (window 16 rounds)"),
        row("fedpop_l_every", "FedPop-L only (every round: 12)", "--fedpop_g", "false", "--local_window_frac", "0"),
        row("fedpop_every", "FedPop (FedPop-L every round: 12)", "--local_window_frac", "0"),
        row("fedpop_tg10", "FedPop, T_g = 10 (window 2 rounds)", "--generation_rounds", "10"),
        Variant("chance_dir", SETTINGS["dir"], kind="chance", label="chance (1 / labels), dir"),
        Variant("majority_dir", SETTINGS["dir"], kind="majority", label="label majority, dir"),
    ),
    matched_by="rounds",
    per_domain=False,
    claims=(
        greater("fedpop_g_dir", "rs_dir", paper=f"FedPop-G alone beats RS: 65.63 vs 62.88 ({T4}; every column)"),
        greater("fedpop_l_dir", "rs_dir", paper=f"FedPop-L alone beats RS: 64.24 vs 62.88 ({T4}; every column)"),
        greater("fedpop_dir", "fedpop_g_dir", paper=f"both beat FedPop-G alone: 67.01 vs 65.63 ({T4}; every column)"),
        greater("fedpop_dir", "fedpop_l_dir", paper=f"both beat FedPop-L alone: 67.01 vs 64.24 ({T4}; every column)"),
        greater("fedpop_l_every_dir", "rs_dir",
                paper=f"FedPop-L alone beats RS with a window of several rounds: 64.24 vs 62.88 ({T4}, window 16)"),
        within("fedpop_every_dir", "fedpop_dir", 0.02,
               paper="early-stopped FedPop-L is comparable to FedPop-L in every round (appendix, 'Annealing "
                     "process'; no number: ours within 0.02)"),
        greater("fedpop_tg10_dir", "rs_dir",
                paper="FedPop beats RS (Table 4), here with T_g = 10 (FedPop-L window 2 rounds)"),
        greater("fedpop_dir", "majority_dir", paper="(control) above the pooled label-majority rate"),
    ),
    # Table 4, Dir(0.5): 67.01 > 65.63 > 64.24 > 62.88
    paper_ordering=("fedpop_dir", "fedpop_g_dir", "fedpop_l_dir", "rs_dir"),
)
