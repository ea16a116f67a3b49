"""Parallel adapters vs full fine-tuning, cross-silo FedAvg, under the paper's quantity-based label skew #M and its
noise-based feature skew Gau(0.1).

The adapters paper (Elvebakken, Iosifidis and Esterle, "Adaptive Parameterization of Deep Learning Models for
Federated Learning") Table I, cross-silo FedAvg (10 clients, all every round, E = 1, ResNet26, 5 seeds): under
Gau(0.1) adapters end 0.75 (SVHN), 1.44 (CIFAR-10) and 1.34 (FashionMNIST) points below full fine-tuning; under #M = 2
full fine-tuning is ahead on every dataset (81.93 vs 77.22, 75.66 vs 64.30, 56.90 vs 55.40); under #M = 1 both stay
near chance (8.8-20.8%), and accuracy rises with M (#M = 1 < 2 < 3, section IV-B). Here, at the CPU scale of the
study fedadapter_silo (the built-in Digits pool, at most 400 images per domain, 28 px, 10 clients, {rounds} rounds of
one local epoch, batch 32, on hfpfl/tiny-resnet-ood, whose frozen shortcut convolutions and BN differ from ResNet26's
placement) with the paper's optimizer: SGD, momentum 0.9, weight decay 5e-4, initial lr 0.1 (Gau) and 0.01 (#M), x 0.1
from round {milestone} (the paper's round 30 of 50, scaled to {rounds} rounds). #M: NIID-Bench's assignment (client
i's first label i mod 10; --partition label_quantity); Gau(0.1): an iid split, client i of 10 with noise of variance
0.1 i / 10 on its images (--noise_skew 0.1, the paper's rule). Each skew has its own label-majority control. "Within"
is two-sided, 1.5 points (the paper's largest cross-silo Gau gap, 1.44, rounded up). Cut to fit the time: FedProx and
FedNova, cross-device (Table II), seeds 3 and 4. Every row trains the same optimizer steps within its skew."""
from hfpfl.experiments import Study, Variant, controls, greater, within

ROUNDS = 15
MILESTONE = 10
T1 = "adapters paper, Table I (cross-silo FedAvg; SVHN / CIFAR-10 / FashionMNIST)"
SCHEDULE = ("--lr_milestones", str(MILESTONE), "--lr_gamma", "0.1")
ACROSS_M = ("the partitions differ: #M splits each label's images among the clients that hold it, so the clients' "
            "sizes, and their steps per epoch, differ by partition (45 to 45.5 steps per model)")


def skew(m: int | None) -> tuple:
    """A skew's partition and the paper's initial lr for it (#M: 0.01, Gau: 0.1; section IV-A)."""
    if m is None:
        return ("--partition", "iid", "--noise_skew", "0.1", "--lr", "0.1", *SCHEDULE)
    return ("--partition", "label_quantity", "--classes_per_client", str(m), "--lr", "0.01", *SCHEDULE)


PAPER = {1: ("19.57 / 16.42 / 20.82", "19.14 / 12.29 / 16.47"),
         2: ("81.93 / 75.66 / 56.90", "77.22 / 64.30 / 55.40"),
         3: ("88.17 / 87.32 / 72.50", "85.00 / 79.37 / 70.90"), None: ("97.15 / 94.68 / 94.90", "96.38 / 93.41 / 93.52")}


def rows(m: int | None) -> tuple:
    tag, name = (f"m{m}", f"#M = {m}") if m else ("gau", "Gau(0.1)")
    return (Variant(f"parallel_{tag}", (*skew(m), "--adapter", "parallel"), label=f"parallel adapters, {name}",
                    paper=PAPER[m][1]),
            Variant(f"full_{tag}", (*skew(m), "--adapter", "none"), label=f"full fine-tuning, {name}",
                    paper=PAPER[m][0]),
            Variant(f"majority_{tag}", skew(m), kind="majority", label=f"label majority, {name}"))


STUDY = Study(
    name="fedadapter_skews",
    title="Parallel adapters vs full fine-tuning under #M label skew and Gau(0.1) noise (cross-silo FedAvg, Digits)",
    paper="Elvebakken, Iosifidis and Esterle, Adaptive Parameterization of Deep Learning Models for Federated "
          "Learning, Table I and section IV-B",
    description=__doc__.split("\n\n", 1)[1].replace("\n", " ").format(rounds=ROUNDS, milestone=MILESTONE),
    seeds=(0, 1, 2),
    common=("--method", "fedavg", "--dataset", "digits", "--num_clients", "10", "--max_per_domain", "400",
            "--image_size", "28", "--model", "hfpfl/tiny-resnet-ood", "--num_rounds", str(ROUNDS),
            "--client_fraction", "1.0", "--local_epochs", "1", "--batch_size", "32", "--optimizer", "sgd",
            "--momentum", "0.9", "--weight_decay", "0.0005", "--eval_every", str(ROUNDS)),
    metrics={"global_accuracy": "global-model accuracy"},
    variants=(*rows(1), *rows(2), *rows(3), *rows(None), controls.chance()),
    matched_by="steps",
    claims=(
        within("parallel_gau", "full_gau", 0.015,
               paper=f"Gau(0.1): adapters 0.75 / 1.44 / 1.34 points below full fine-tuning ({T1})"),
        greater("full_m2", "parallel_m2",
                paper=f"#M = 2: full fine-tuning ahead on every dataset, 81.93 vs 77.22, 75.66 vs 64.30, 56.90 vs "
                      f"55.40 ({T1})"),
        greater("parallel_m2", "parallel_m1", paper=f"accuracy rises with M: #M = 1 < #M = 2 (adapters; {T1})",
                budgets_differ_because=ACROSS_M),
        greater("parallel_m3", "parallel_m2", paper=f"#M = 2 < #M = 3 (adapters; {T1})",
                budgets_differ_because=ACROSS_M),
        greater("full_m2", "full_m1", paper=f"#M = 1 < #M = 2 (full fine-tuning; {T1})",
                budgets_differ_because=ACROSS_M),
        greater("full_m3", "full_m2", paper=f"#M = 2 < #M = 3 (full fine-tuning; {T1})",
                budgets_differ_because=ACROSS_M),
        greater("parallel_gau", "majority_gau", paper="(control) above the label-majority rate under Gau(0.1)"),
        greater("parallel_m3", "chance", paper="(control) #M = 3 learns: above chance"),
    ),
    per_domain=False,   # the clients mix the four domains
    paper_ordering=("full_gau", "parallel_gau"),
)
