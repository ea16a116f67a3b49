"""FedBN vs FedAvg / FedProx / local training on the Digits feature-shift benchmark.

The paper's numbers are the Digits rows of Table 2 in Chen's dissertation (FRAug chapter, section 4.1: MNIST, MNIST-M,
SVHN, USPS, one domain per client, 1% of the data, a 6-layer CNN, 3 seeds), where FedBN's row comes from FedBN's own
code (Li et al., ICLR 2021). The text (section 4.1.4) states FedBN's average gain over FedAvg as 1.5 points; on Digits
the table gives +1.49 (87.11 vs 85.62). Here: the built-in Digits benchmark (mnist, mnistm, syn, usps: SYN stands in
for SVHN), 600 images per domain at 28 px, 8 clients (two per domain), the tiny HF ResNet, 20 rounds of one local
epoch; every method trains one local epoch per round, so the rows are matched by optimizer steps."""
from hfpfl.experiments import Study, Variant, controls, greater, margin

FEDAVG = Variant("fedavg", ("--method", "fedavg"), label="FedAvg", paper="85.62 ± 0.2")
FEDPROX = Variant("fedprox", ("--method", "fedprox", "--mu", "0.01"), label="FedProx (mu 0.01)", paper="84.96 ± 0.3")
FEDBN = Variant("fedbn", ("--method", "fedbn"), label="FedBN", paper="87.11 ± 0.2")
LOCAL = Variant("local", ("--method", "local"), label="Single (local only)", paper="82.54 ± 0.1")

TABLE = "Chen 2025, FRAug chapter, Table 2 (Digits avg)"

STUDY = Study(
    name="baselines_digits",
    title="FedBN vs FedAvg, FedProx and local training on Digits (feature shift)",
    paper="FedBN (Li et al., ICLR 2021); numbers from Chen 2025 (dissertation), FRAug chapter, Table 2, Digits rows",
    description=__doc__.split("\n\n", 1)[1].replace("\n", " "),
    seeds=(0, 1, 2),
    common=("--dataset", "digits", "--partition", "feature_shift", "--num_clients", "8", "--max_per_domain", "600",
            "--image_size", "28", "--model", "tiny-resnet", "--num_rounds", "20", "--local_epochs", "1",
            "--batch_size", "32", "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9"),
    metrics={"personal_accuracy": "mean per-client accuracy", "global_accuracy": "global-model accuracy"},
    variants=(FEDBN, FEDAVG, FEDPROX, LOCAL, controls.chance(), controls.majority(), controls.untrained(FEDAVG)),
    matched_by="steps",
    claims=(
        greater("fedbn", "fedavg", paper=f"87.11 vs 85.62 ({TABLE}); FedBN's own claim"),
        margin("fedbn", "fedavg", 0.015, paper="FedBN's average gain over FedAvg: 1.5 points (section 4.1.4)"),
        greater("fedbn", "fedprox", paper=f"87.11 vs 84.96 ({TABLE})"),
        greater("fedavg", "local", paper=f"85.62 vs 82.54 ({TABLE}): collaboration helps scarce clients"),
        greater("fedbn", "local", paper=f"87.11 vs 82.54 ({TABLE})"),
        greater("fedavg", "untrained", paper="(control) federated training beats the initial model"),
        greater("fedbn", "majority", paper="(control) above the label-majority rate"),
    ),
    paper_ordering=("fedbn", "fedavg", "fedprox", "local"),
)
