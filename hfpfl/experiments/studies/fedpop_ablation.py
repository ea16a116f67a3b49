"""FedPop's components: FedPop-L alone, FedPop-G alone, both, and FedPop-L windows of several rounds, at one budget.

The paper (Chen 2025, dissertation chapter 4, FedPop, AAAI 2025), Table 4: with the RS wrapper on CIFAR-10, each
component alone already beats RS and both together beat either, in every column -- Dir(0.5): RS 62.88, FedPop-G
65.63, FedPop-L 64.24, FedPop 67.01; Dir(1.0): 63.47 / 66.81 / 67.50 / 68.25; IID: 69.04 / 70.61 / 70.03 / 71.18. The
appendix ("Annealing process") runs FedPop-L only in the first r_0 = 0.2 T_g rounds of a new configuration (T_g = 0.1
R_c = 80 there, so a window of 16 rounds) and reports that this early stop is comparable to FedPop-L in every round
(no number). Here: the fedpop_tuning study's `dir` setting and tuner settings, unchanged (USPS, Dirichlet(0.5) over
10 clients, 600 images, 8x8, 20% validation splits, tiny MLP with dropout, FedAvg under the tuner, K = 5, N_c = 4,
R_c = 12, R_t = 48, T_g = 2), and the same with Dirichlet(1.0) (`dir1`) and an IID split (`iid`) for Table 4's other
two columns; the ablation switches are `--fedpop_l false` (FedPop-G alone) and `--fedpop_g false` (FedPop-L alone).
At T_g = 2 FedPop-L's window is ceil(0.2 * 2) = 1 round, so the rows that measure FedPop-L over several rounds are:
T_g = 10 (window ceil(0.2 * 10) = 2 rounds; FedPop-G fires once, at round 10) and `--local_window_frac 0` (FedPop-L
in every round, Algorithm 1: a window of all 12 rounds), alone and with FedPop-G, in the Dir(0.5) column only. The
window in rounds is in each row's label. Cut to fit: 3 seeds (the paper: 5), the 48-round budget of fedpop_tuning
(the paper: 4000 rounds), the window rows in one column. Rows: the best member (lowest validation loss) -- its global
model's test accuracy (primary, Table 4's metric) and fine-tuned on each client; all tuners spend the same 48
communication rounds (matched by rounds: each candidate trains with its own local epochs and batch size, so steps
differ by design)."""
from __future__ import annotations

from hfpfl.experiments import Study, Variant, greater, within
from hfpfl.experiments.studies.fedpop_tuning import KIND, RECIPE, SETTINGS, TUNE

T4 = "Chen 2025, ch. 4, Table 4 (CIFAR-10, RS wrapper)"
#: Table 4's columns: fedpop_tuning's `dir` setting, and the same data with Dirichlet(1.0) or an IID split
COLUMNS = {"dir": SETTINGS["dir"], "dir1": (*SETTINGS["dir"], "--alpha", "1.0"),
           "iid": ("--dataset", "usps", "--partition", "iid", "--num_clients", "10", "--max_per_domain", "600",
                   "--image_size", "8", "--val_fraction", "0.2")}
COLUMN_NAMES = {"dir": "Dir(0.5)", "dir1": "Dir(1.0)", "iid": "IID"}
#: Table 4 by column: RS, FedPop-G, FedPop-L, FedPop
PAPER4 = {"dir": ("62.88", "65.63", "64.24", "67.01"), "dir1": ("63.47", "66.81", "67.50", "68.25"),
          "iid": ("69.04", "70.61", "70.03", "71.18")}


def row(name: str, col: str, label: str, *flags: str, tuner: str = "fedpop", paper: str | None = None) -> Variant:
    return Variant(f"{name}_{col}", (*COLUMNS[col], *TUNE, "--tuner", tuner, *flags), kind=KIND, recipe=RECIPE,
                   label=f"{label}, {col}", paper=paper)


def column(col: str) -> tuple[Variant, ...]:
    """Table 4's four rows in one column."""
    rs, g, loc, both = PAPER4[col]
    return (row("rs", col, "RS", tuner="rs", paper=rs),
            row("fedpop_g", col, "FedPop-G only", "--fedpop_l", "false", paper=g),
            row("fedpop_l", col, "FedPop-L only (window 1 round)", "--fedpop_g", "false",
                paper=f"{loc} (window 16 rounds)"),
            row("fedpop", col, "FedPop (window 1 round)", paper=f"{both} (window 16 rounds)"))


def windows(col: str) -> tuple[Variant, ...]:
    """FedPop-L over several rounds: in every round (alone and with FedPop-G), and T_g = 10 (window 2)."""
    return (row("fedpop_l_every", col, "FedPop-L only (every round: 12)", "--fedpop_g", "false",
                "--local_window_frac", "0"),
            row("fedpop_every", col, "FedPop (FedPop-L every round: 12)", "--local_window_frac", "0"),
            row("fedpop_tg10", col, "FedPop, T_g = 10 (window 2 rounds)", "--generation_rounds", "10"))


def table4_claims(col: str) -> tuple:
    rs, g, loc, both = PAPER4[col]
    where = f"{T4}, {COLUMN_NAMES[col]}"
    return (greater(f"fedpop_g_{col}", f"rs_{col}", paper=f"FedPop-G alone beats RS: {g} vs {rs} ({where})"),
            greater(f"fedpop_l_{col}", f"rs_{col}", paper=f"FedPop-L alone beats RS: {loc} vs {rs} ({where})"),
            greater(f"fedpop_{col}", f"fedpop_g_{col}", paper=f"both beat FedPop-G alone: {both} vs {g} ({where})"),
            greater(f"fedpop_{col}", f"fedpop_l_{col}", paper=f"both beat FedPop-L alone: {both} vs {loc} ({where})"))


def window_claims(col: str) -> tuple:
    rs, g, loc, both = PAPER4[col]
    where = f"{T4}, {COLUMN_NAMES[col]}"
    return (greater(f"fedpop_l_every_{col}", f"rs_{col}",
                    paper=f"FedPop-L alone beats RS with a window of several rounds: {loc} vs {rs} ({where}, "
                          "window 16)"),
            within(f"fedpop_every_{col}", f"fedpop_{col}", 0.02,
                   paper="early-stopped FedPop-L is comparable to FedPop-L in every round (appendix, 'Annealing "
                         "process'; no number: ours within 0.02)"),
            greater(f"fedpop_tg10_{col}", f"rs_{col}",
                    paper=f"FedPop beats RS: {both} vs {rs} ({where}), here with T_g = 10 (FedPop-L window 2 "
                          "rounds)"))


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
        *column("dir"), *windows("dir"), *column("dir1"), *column("iid"),
        Variant("chance_dir", SETTINGS["dir"], kind="chance", label="chance (1 / labels), dir"),
        Variant("majority_dir", SETTINGS["dir"], kind="majority", label="label majority, dir"),
        Variant("majority_dir1", COLUMNS["dir1"], kind="majority", label="label majority, dir1"),
        Variant("majority_iid", COLUMNS["iid"], kind="majority", label="label majority, iid"),
    ),
    matched_by="rounds",
    per_domain=False,
    claims=(
        *table4_claims("dir"), *window_claims("dir"), *table4_claims("dir1"), *table4_claims("iid"),
        *(greater(f"fedpop_{c}", f"majority_{c}", paper="(control) above the pooled label-majority rate")
          for c in COLUMNS),
    ),
    # Table 4, Dir(0.5): 67.01 > 65.63 > 64.24 > 62.88
    paper_ordering=("fedpop_dir", "fedpop_g_dir", "fedpop_l_dir", "rs_dir"),
)
