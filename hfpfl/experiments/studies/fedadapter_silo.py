"""Parallel adapters vs full fine-tuning, cross-silo, under FedAvg, FedProx and FedNova: accuracy and upload bytes.

The adapters paper (Elvebakken, Iosifidis and Esterle, "Adaptive Parameterization of Deep Learning Models for
Federated Learning") Table I, cross-silo (10 clients, all every round, E = 1, ResNet26 pretrained, 5 seeds): under
Dir(0.5) FedAvg with parallel adapters is 0.97 (SVHN), 0.06 (CIFAR-10) and 1.17 (FashionMNIST) points below full
fine-tuning; the three algorithms' average gaps under Dir(0.5) and Gau(0.1) are 0.30 to 1.44 points; the adapters'
upload (adapters + BN + classifier) is 2.58 MB against the full model's 22.2 MB, "almost a ninth" (section on
communication). Here, scaled to 2 shared CPU cores: the built-in Digits pool (MNIST, USPS, MNIST-M, SYN; at most 400 images per domain;
10 classes, 28 px)
under Dir(0.5) over 10 clients, all every round, {rounds} rounds of one local epoch, SGD with momentum 0.9 at a
constant lr 0.05 (the paper's schedule not run), batch 32, weight decay 0 (the paper's not stated), on the tiny
out-of-domain ResNet stand-in (hfpfl/tiny-resnet-ood; its shortcut convolutions and their BN stay frozen, unlike
ResNet26's adapter placement). "Within" is two-sided: |adapters - full| <= 1.5 points (the paper's largest
cross-silo Dir/Gau gap, 1.44, rounded up). Upload bytes are exact: the engine's ledger, per client per round.
FedProx's mu is the paper's 0.01. The paper's 5 seeds (0-4): mean and sample std over all five. The #M and
Gau(0.1) partitions are the study fedadapter_skews (with the paper's optimizer); cross-device (Table II) is the
study fedadapter_device. Every row trains the same optimizer steps (matched by steps)."""
from hfpfl.experiments import Study, Variant, controls, greater, within

ROUNDS = 15
HOOK = "hfpfl.experiments.studies.fedadapter_silo:upload_bytes"
T1 = "adapters paper, Table I (cross-silo, Dir(0.5), FedAvg: 0.06-1.17 points)"

PARALLEL = Variant("parallel", ("--adapter", "parallel"), label="FedAvg, parallel adapters",
                   paper="95.03 / 95.02 / 92.82 (SVHN / C10 / FMNIST)", metrics_hook=HOOK)
FULL = Variant("full", ("--adapter", "none"), label="FedAvg, full fine-tuning",
               paper="96.00 / 95.08 / 93.99", metrics_hook=HOOK)
PROX = ("--method", "fedprox", "--mu", "0.01")
PROX_PARALLEL = Variant("prox_parallel", (*PROX, "--adapter", "parallel"), label="FedProx, parallel adapters",
                        paper="95.27 / 94.93 / 93.14", metrics_hook=HOOK)
PROX_FULL = Variant("prox_full", (*PROX, "--adapter", "none"), label="FedProx, full fine-tuning",
                    paper="96.15 / 95.74 / 94.22", metrics_hook=HOOK)
NOVA_PARALLEL = Variant("nova_parallel", ("--method", "fednova", "--adapter", "parallel"),
                        label="FedNova, parallel adapters", paper="95.19 / 94.92 / 93.12", metrics_hook=HOOK)
NOVA_FULL = Variant("nova_full", ("--method", "fednova", "--adapter", "none"), label="FedNova, full fine-tuning",
                    paper="96.07 / 94.95 / 94.19", metrics_hook=HOOK)


def upload_bytes(sim, results) -> None:
    """Exact bytes uploaded per client per round (the ledger's total over every (round, client) upload)."""
    uploads = sum(len(per) for per in sim.ledger.rounds.values())
    results["final"]["upload_bytes"] = results["communication"]["bytes_up"] / max(1, uploads)


STUDY = Study(
    name="fedadapter_silo",
    title="Parallel adapters vs full fine-tuning, cross-silo FedAvg, FedProx, FedNova (Digits, Dir(0.5))",
    paper="Elvebakken, Iosifidis and Esterle, Adaptive Parameterization of Deep Learning Models for Federated "
          "Learning, Table I",
    description=__doc__.split("\n\n", 1)[1].replace("\n", " ").format(rounds=ROUNDS),
    seeds=(0, 1, 2, 3, 4),   # the paper's 5 seeds
    common=("--method", "fedavg", "--dataset", "digits", "--partition", "dirichlet", "--alpha", "0.5",
            "--num_clients", "10", "--min_partition_size", "10", "--max_per_domain", "400", "--image_size", "28",
            "--model", "hfpfl/tiny-resnet-ood", "--num_rounds", str(ROUNDS), "--client_fraction", "1.0",
            "--local_epochs", "1", "--batch_size", "32", "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9",
            "--weight_decay", "0", "--eval_every", str(ROUNDS)),
    metrics={"global_accuracy": "global-model accuracy", "upload_bytes": "bytes uploaded per client per round",
             "personal_accuracy": "mean per-client accuracy of the global model"},
    variants=(PARALLEL, FULL, PROX_PARALLEL, PROX_FULL, NOVA_PARALLEL, NOVA_FULL, controls.chance(),
              controls.majority(), controls.untrained(FULL)),
    matched_by="steps",
    claims=(
        within("parallel", "full", 0.015,
               paper=f"adapters within 0.30-1.44 points of full fine-tuning (average gaps, Dir/Gau; {T1})"),
        within("prox_parallel", "prox_full", 0.015,
               paper="the same under FedProx (adapters paper, Table I, Dir(0.5): 0.81-1.08 points)"),
        within("nova_parallel", "nova_full", 0.015,
               paper="the same under FedNova (adapters paper, Table I, Dir(0.5): 0.03-1.07 points)"),
        greater("full", "parallel", metric="upload_bytes",
                paper="adapters upload almost a ninth of the full model (2.58 MB vs 22.2 MB, ResNet26)"),
        greater("parallel", "untrained", paper="(control) federated training beats the stand-in before it"),
        greater("parallel", "majority", paper="(control) above the label-majority rate"),
    ),
    per_domain=False,   # Dirichlet clients mix the four domains
    paper_ordering=("full", "parallel"),
)
