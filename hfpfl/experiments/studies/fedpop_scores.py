"""How FedPop combines a member's round scores into the one that ranks it: power law (Eq. 5), average, last.

The paper (Chen 2025, dissertation chapter 4, FedPop, AAAI 2025), appendix Table 5 ("Ablation Study on Score
Computation", FedPop wrapped in SHA on CIFAR-10): the member's list of per-round validation losses is combined by the
power-law decay of Eq. 5 (weights 0.9^(R - r)), by its plain average, or by its last score. Power law is best in
two of three columns and beats the average in all three -- Dir(0.5): power law 74.88 (72.41), avg 74.41 (72.54),
last 73.76 (71.88); IID 81.47 / 78.97 / 80.03; Dir(1.0) 76.42 / 75.68 / 77.58 -- and the text says averaging is
worse ("the scores increase with higher rate at the initial stage"). Here `--score power_law|avg|last` sets the rule
for FedPop-G's ranking and for SHA's eliminations (hfpfl/tuning/fedpop.py, eq5_score). Setting: the fedpop_tuning
study's `dir` setting and budget (USPS, Dirichlet(0.5) over 10 clients, 8x8 images, tiny MLP with dropout, FedAvg
under the tuner, K = 5, R_t = N_c * R_c = 4 * 12 = 48 rounds), `--tuner fedpop_sha`, with two changes so that the
rule has lists to act on: 9 starting configurations (9 -> 3 -> 1: 2 rounds each, then 10 rounds for the 3
survivors; fedpop_tuning's 27 -> 9 -> 3 -> 1 leaves stages of 1, 1 and 4 rounds, where the three rules barely differ)
and T_g = 4 (FedPop-G at rounds 4 and 8 over 4-round lists; the last stage's elimination over up to 10 rounds). Plain
SHA at the same schedule (its elimination by Eq. 5) is shown for reference. Cut to fit: only the Dir(0.5) column,
3 seeds (the paper: 5), 9 starting configurations instead of 27. Rows: the best member (lowest validation loss) --
its global model's test accuracy (primary) and fine-tuned on each client (the paper's brackets); every row spends
the same 48 communication rounds (matched by rounds)."""
from __future__ import annotations

from hfpfl.experiments import Study, Variant, greater
from hfpfl.experiments.studies.fedpop_tuning import KIND, RECIPE, SETTINGS, TUNE

T5 = "Chen 2025, ch. 4, appendix Table 5 (CIFAR-10 Dir(0.5), SHA wrapper)"
SHA9 = ("--sha_start", "9", "--generation_rounds", "4")


def row(name: str, label: str, *flags: str, tuner: str = "fedpop_sha", paper: str | None = None) -> Variant:
    return Variant(f"{name}_dir", (*SETTINGS["dir"], *TUNE, *SHA9, "--tuner", tuner, *flags), kind=KIND,
                   recipe=RECIPE, label=f"{label}, dir", paper=paper)


STUDY = Study(
    name="fedpop_scores",
    title="FedPop's member score: power law (Eq. 5), average or last round (appendix Table 5)",
    paper="FedPop: Federated Population-based Hyperparameter Tuning (AAAI 2025); Chen 2025 (dissertation), ch. 4, "
          "appendix Table 5",
    description=__doc__.split("\n\n", 1)[1].replace("\n", " "),
    seeds=(0, 1, 2),
    metrics={"global_accuracy": "best member's global model", "finetuned_accuracy": "fine-tuned on each client",
             "val_loss": "best member's validation loss", "tried_configs": "(alpha, beta) vectors tried"},
    variants=(
        row("power_law", "FedPop+SHA, power law (Eq. 5)", "--score", "power_law", paper="74.88 (72.41)"),
        row("avg", "FedPop+SHA, average", "--score", "avg", paper="74.41 (72.54)"),
        row("last", "FedPop+SHA, last round", "--score", "last", paper="73.76 (71.88)"),
        row("sha", "SHA alone (reference)", tuner="sha"),
        Variant("majority_dir", SETTINGS["dir"], kind="majority", label="label majority, dir"),
    ),
    matched_by="rounds",
    per_domain=False,
    claims=(
        greater("power_law_dir", "avg_dir",
                paper=f"power law beats the average: 74.88 vs 74.41 ({T5}; every column)"),
        greater("power_law_dir", "last_dir",
                paper=f"power law beats the last score: 74.88 vs 73.76 ({T5}; IID too, not Dir(1.0))"),
        greater("power_law_dir", "majority_dir", paper="(control) above the pooled label-majority rate"),
    ),
    # appendix Table 5, Dir(0.5): 74.88 > 74.41 > 73.76
    paper_ordering=("power_law_dir", "avg_dir", "last_dir"),
)
