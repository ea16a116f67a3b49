"""Parallel adapters vs full fine-tuning, cross-device (100 clients, 20% per round, E = 5), beside the same
skews cross-silo.

The adapters paper (Elvebakken, Iosifidis and Esterle, "Adaptive Parameterization of Deep Learning Models for
Federated Learning") Table II, cross-device (100 clients, f = 0.2 per round, E = 5, the rest as Table I: ResNet26,
50 rounds, 5 seeds; each client holds about a tenth of a cross-silo client's data): "the same tendencies" as
cross-silo, adapters "almost on par" (FedAvg's Dir(0.5) and Gau(0.1) gaps 1.21 to 3.95 points; the three algorithms'
average gaps 1.24 to 4.00, without SVHN's FedNova outlier); full fine-tuning ahead under quantity skew "across the
board"; noise skew has a larger gap cross-device than cross-silo; quantity skew gives better accuracy cross-device than
cross-silo (section IV-B). Here, the study fedadapter_skews' setting (its flags are this study's common flags: the
Digits pool at most 400 images per domain, 28 px, {rounds} rounds, batch 32, hfpfl/tiny-resnet-ood, SGD momentum 0.9,
weight decay 5e-4, lr x 0.1 from round {milestone}) with the paper's cross-device flags on every cross-device row
(--num_clients 100 --client_fraction 0.2 --local_epochs 5; clients drawn without replacement within a round and
afresh every round). The pool is kept at 400 images per domain, the cross-silo one, so that a cross-device client holds
a tenth of a cross-silo client's data as in the paper (about 9 training images; one step of batch 32 per epoch) and the
two settings see the same images. Dir(0.5) (initial lr 0.1, the paper's) runs with --min_partition_size 3 here (10, the
NIID-Bench minimum, is not reachable with about 11 images per client; 3 leaves every client at least 2 training images
after its test split, and BatchNorm cannot train on one). Partitions:
Dir(0.5), Gau(0.1) (client i of 100 with noise of variance 0.1 i / 100) and #M = 1, 2, 3 (initial lr 0.01), each with
its label-majority control. "Within" is two-sided: FedAvg's largest cross-device Dir/Gau gap, 3.95, rounded up to 4
points. The cross-silo rows are fedadapter_skews' FedAvg rows (the same flags, so the same row keys: borrowed with
`python -m hfpfl.experiments borrow fedadapter_device --from fedadapter_skews`). FedProx (mu 0.01) and FedNova run
cross-device under Dir(0.5) and Gau(0.1), the partitions of the "almost on par" claim; their "within" is each
algorithm's largest Table II Dir/Gau gap without SVHN's FedNova outlier, rounded up to half a point (FedProx 4.01
and FedNova 4.07: 4.5 points). Seeds: {seeds_text}. Cut to fit the time: FedProx and FedNova under #M cross-device;
the 50 rounds; the noise-gap comparison (the gap cross-device larger than
cross-silo) is a difference of two differences, which the claims cannot state: read it off the table. Every
cross-device row trains the same optimizer steps within its partition; cross-device and cross-silo rows differ by
the paper's two settings."""
from hfpfl.experiments import Study, Variant, controls, greater, within
from hfpfl.experiments.claims import rises
from hfpfl.experiments.studies import fedadapter_skews as silo

SEEDS = (0, 1, 2, 3, 4)
DEVICE = ("--num_clients", "100", "--client_fraction", "0.2", "--local_epochs", "5")
T2 = "adapters paper, Table II (cross-device FedAvg; SVHN / CIFAR-10 / FashionMNIST)"
#: FedAvg, Table II (w/o adapter, w/ adapter), SVHN / CIFAR-10 / FashionMNIST
PAPER = {"dir": ("95.64 / 94.78 / 93.40", "93.48 / 92.86 / 92.19"),
         "m1": ("14.70 / 12.75 / 16.93", "14.57 / 10.41 / 11.32"),
         "m2": ("89.59 / 89.64 / 79.09", "84.97 / 71.14 / 72.85"),
         "m3": ("94.16 / 93.63 / 85.39", "89.56 / 80.92 / 85.42"),
         "gau": ("96.78 / 94.45 / 94.29", "95.48 / 90.50 / 92.77")}
#: FedProx / FedNova, Table II (w/o adapter, w/ adapter), SVHN / CIFAR-10 / FashionMNIST
ALGO_PAPER = {("prox", "dir"): ("95.62 / 95.38 / 93.43", "93.88 / 92.91 / 92.22"),
              ("prox", "gau"): ("95.58 / 94.42 / 94.20", "95.38 / 90.41 / 92.48"),
              ("nova", "dir"): ("77.86 / 95.00 / 93.44", "94.10 / 92.63 / 92.13"),
              ("nova", "gau"): ("96.81 / 94.32 / 94.29", "95.45 / 90.25 / 92.55")}
ALGO_WITHIN = 0.045
NAMES = {"dir": "Dir(0.5)", "m1": "#M = 1", "m2": "#M = 2", "m3": "#M = 3", "gau": "Gau(0.1)"}
SETTINGS = ("the paper's two settings: cross-device E = 5 on 20 of 100 clients per round (each client a tenth of the "
            "data) vs cross-silo E = 1 on all 10 clients, on the same images; their steps per model differ")
ACROSS_M = ("the partitions differ: #M splits each label's images among the clients that hold it, so the clients' "
            "sizes, and their steps, differ by partition")


def skew(tag: str) -> tuple:
    """A partition's flags and the paper's initial lr for it (section IV-A), on top of fedadapter_skews' flags."""
    if tag == "dir":
        return ("--partition", "dirichlet", "--alpha", "0.5", "--min_partition_size", "3", "--lr", "0.1",
                *silo.SCHEDULE)
    return silo.skew(None if tag == "gau" else int(tag[1:]))


def rows(tag: str) -> tuple:
    name = NAMES[tag]
    return (Variant(f"parallel_{tag}", (*skew(tag), *DEVICE, "--adapter", "parallel"),
                    label=f"cross-device, parallel adapters, {name}", paper=PAPER[tag][1]),
            Variant(f"full_{tag}", (*skew(tag), *DEVICE, "--adapter", "none"),
                    label=f"cross-device, full fine-tuning, {name}", paper=PAPER[tag][0]),
            Variant(f"majority_{tag}", (*skew(tag), *DEVICE), kind="majority",
                    label=f"label majority, cross-device {name}"))


def algo_rows(algo: str, tag: str) -> tuple:
    """FedProx or FedNova cross-device: the FedAvg rows' flags with fedadapter_skews' method flags added."""
    title, flags = silo.ALGO[algo]
    name = NAMES[tag]
    return (Variant(f"{algo}_parallel_{tag}", (*skew(tag), *DEVICE, *flags, "--adapter", "parallel"),
                    label=f"cross-device {title}, parallel adapters, {name}", paper=ALGO_PAPER[algo, tag][1]),
            Variant(f"{algo}_full_{tag}", (*skew(tag), *DEVICE, *flags, "--adapter", "none"),
                    label=f"cross-device {title}, full fine-tuning, {name}", paper=ALGO_PAPER[algo, tag][0]))


def silo_rows(tag: str) -> tuple:
    """fedadapter_skews' FedAvg rows of a partition, under their own flags (borrowed, not re-run)."""
    parallel, full, _ = silo.rows(None if tag == "gau" else int(tag[1:]))
    m = None if tag == "gau" else int(tag[1:])
    return (Variant(f"silo_parallel_{tag}", parallel.argv, label=f"cross-silo, parallel adapters, {NAMES[tag]}",
                    paper=silo.PAPER[m][1]),
            Variant(f"silo_full_{tag}", full.argv, label=f"cross-silo, full fine-tuning, {NAMES[tag]}",
                    paper=silo.PAPER[m][0]))


def claims() -> tuple:
    out = [within("parallel_dir", "full_dir", 0.04,
                  paper=f"Dir(0.5): adapters \"almost on par\", 2.16 / 1.92 / 1.21 points below full fine-tuning ({T2})"),
           within("parallel_gau", "full_gau", 0.04,
                  paper=f"Gau(0.1): adapters \"almost on par\", 1.30 / 3.95 / 1.52 points below full fine-tuning "
                        f"({T2})")]
    for m in (1, 2, 3):
        out.append(greater(f"full_m{m}", f"parallel_m{m}",
                           paper=f"#M = {m}: full fine-tuning ahead \"across the board for quantity-based label "
                                 f"imbalance\" (section IV-B); {PAPER[f'm{m}'][0]} vs {PAPER[f'm{m}'][1]} ({T2})"))
    for approach, what in (("parallel", "adapters"), ("full", "full fine-tuning")):
        out.append(within(f"{approach}_m1", "chance", silo.NEAR_CHANCE,
                          paper=f"#M = 1, {what}: \"almost no progress\", {PAPER['m1'][approach == 'parallel']} "
                                f"({T2}; near chance: within 11 points, as fedadapter_skews)"))
        out += rises((f"{approach}_m1", f"{approach}_m2", f"{approach}_m3"),
                     paper=f"{what}: accuracy rises with M, \"the same tendencies\" as cross-silo ({T2})",
                     budgets_differ_because=ACROSS_M)
        for m in (2, 3):
            out.append(greater(f"{approach}_m{m}", f"silo_{approach}_m{m}",
                               paper=f"#M = {m}, {what}: quantity skew gives better accuracy cross-device than "
                                     f"cross-silo (section IV-B; Table II {PAPER[f'm{m}'][approach == 'parallel']} "
                                     f"vs Table I {silo.PAPER[m][approach == 'parallel']})",
                               budgets_differ_because=SETTINGS))
    for algo, title in (("prox", "FedProx"), ("nova", "FedNova")):
        for tag in ("dir", "gau"):
            full, adapters = ALGO_PAPER[algo, tag]
            out.append(within(f"{algo}_parallel_{tag}", f"{algo}_full_{tag}", ALGO_WITHIN,
                              paper=f"{title}, {NAMES[tag]}: adapters \"almost on par\", {adapters} vs full "
                                    f"fine-tuning {full} ({T2.replace('FedAvg', title)})"))
    for approach, what in (("parallel", "adapters"), ("full", "full fine-tuning")):
        for tag in ("dir", "gau"):
            out.append(greater(f"prox_{approach}_{tag}", f"{approach}_{tag}",
                               paper=f"{NAMES[tag]}, {what}: \"FedProx works better in most cases\" cross-device "
                                     f"(section IV-B): {ALGO_PAPER['prox', tag][approach == 'parallel']} vs FedAvg "
                                     f"{PAPER[tag][approach == 'parallel']} ({T2.replace('FedAvg', 'FedProx / FedAvg')})"))
    out += [greater("parallel_dir", "majority_dir", paper="(control) above the label-majority rate under Dir(0.5)"),
            greater("parallel_gau", "majority_gau", paper="(control) above the label-majority rate under Gau(0.1)"),
            greater("parallel_m3", "majority_m3", paper="(control) #M = 3 learns: above the label-majority rate")]
    return tuple(out)


STUDY = Study(
    name="fedadapter_device",
    title="Parallel adapters vs full fine-tuning, cross-device (100 clients, 20% per round, E = 5; Digits)",
    paper="Elvebakken, Iosifidis and Esterle, Adaptive Parameterization of Deep Learning Models for Federated "
          "Learning, Table II and section IV-B",
    description=__doc__.split("\n\n", 1)[1].replace("\n", " ").format(
        rounds=silo.ROUNDS, milestone=silo.MILESTONE, seeds_text="the paper's 5 (0-4), mean and sample std over all "
                                                                 "five"),
    seeds=SEEDS,
    common=silo.STUDY.common,
    metrics={"global_accuracy": "global-model accuracy"},
    variants=(*rows("dir"), *rows("gau"), *rows("m1"), *rows("m2"), *rows("m3"), controls.chance(),
              *algo_rows("prox", "dir"), *algo_rows("prox", "gau"), *algo_rows("nova", "dir"), *algo_rows("nova", "gau"),
              *silo_rows("gau"), *silo_rows("m2"), *silo_rows("m3")),
    matched_by="steps",
    claims=claims(),
    per_domain=False,   # the clients mix the four domains
    paper_ordering=("full_gau", "parallel_gau"),
)
