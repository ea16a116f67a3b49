"""The micro-study the tests run end to end (seconds): FedBN vs FedAvg, 1 round, 4 Digits clients of 100 images per
domain at 16 px, two seeds, with the three generic controls. Not a paper result: it exercises the runner."""
from hfpfl.experiments import Study, Variant, controls, greater, within

FEDAVG = Variant("fedavg", ("--method", "fedavg"), label="FedAvg")
FEDBN = Variant("fedbn", ("--method", "fedbn"), label="FedBN")

STUDY = Study(
    name="micro_digits",
    title="Micro-study (test fixture): FedBN vs FedAvg, 1 round",
    paper="none (exercises the study runner)",
    description="4 Digits clients (one domain each), 100 images per domain, 16 px, one round of one local epoch.",
    seeds=(0, 1),
    common=("--dataset", "digits", "--num_clients", "4", "--max_per_domain", "100", "--image_size", "16",
            "--num_rounds", "1", "--batch_size", "16", "--lr", "0.05"),
    metrics={"personal_accuracy": "mean per-client accuracy", "global_accuracy": "global-model accuracy"},
    variants=(FEDAVG, FEDBN, controls.chance(), controls.majority(), controls.untrained(FEDAVG)),
    matched_by="steps",
    claims=(greater("fedbn", "fedavg", paper="FedBN > FedAvg"),
            within("fedbn", "fedavg", 0.5, paper="a two-sided check"),
            greater("fedavg", "untrained", paper="training helps")),
    paper_ordering=("fedbn", "fedavg"),
)
