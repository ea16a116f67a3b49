"""FRAug vs FedBN, FedAvg and the other baselines with noised training images (FRAug's noise robustness, CPU scale).

The paper's experiment is Table 6 of Chen's dissertation, FRAug chapter (section 4.3.4, "privatized OfficeHome"):
every client's local images get delta ~ N(0, sigma^2 I) while the classification model is optimized, sigma 0.01
(weak), 0.1 (medium) and 1.0 (strong), and each client scores on its clean test images; only FedAvg, FedBN and FRAug
are reported. OfficeHome is not available offline: the built-in Digits benchmark stands in (mnist, mnistm, syn, usps,
one domain per client, 600 images per domain at 16 px, the tiny HF ResNet) at the CPU settings of the study
fraug_digits (15 rounds of 5 local steps of batch 32, SGD lr 0.05 / momentum 0.9, generator and RTNet lr 0.025, each
client's optimizer state kept across rounds by FRAug and FedBN alike), so the clean rows of fraug_digits (FRAug,
"FedBN, kept", FedAvg) are this table's noise-free reference. The noise: --noise_skew sigma --noise_skew_rule uniform
(standard deviation sigma on every client, on the [0, 1] image scale, not clamped) --noise_skew_splits train (each
client's train and validation splits; its test split stays clean); one fixed draw per image (a privatized copy; the
chapter does not say whether it redraws). The paper's sigma presumably acts on its normalized ResNet inputs; here it
acts on [0, 1] pixels, so "strong" (1.0) buries 16 px digits far deeper than OfficeHome's 224 px photos. All seven
methods run at the medium intensity; at weak and strong only the paper's three (FRAug, FedBN, FedAvg). FedProx mu
0.01; FedProto lambda 1; FedAvg+FT and FedBABU choose each client's fine-tuning lr from {0.001, 0.01, 0.1} on its
(noised) validation split (--val_fraction 0.1) and are scored after the last round only; their fine-tuning epochs are
not in the steps column. Cut to fit (about 30 minutes at a third of a core): the four baselines beyond the paper's
three run at the medium intensity only."""
from hfpfl.experiments import Study, controls, greater

from .fraug_digits import FRAUG, VAL, common, run

T6 = "Chen 2025, FRAug chapter, Table 6 (privatized OfficeHome; Digits here)"
LEVELS = {"weak": "0.01", "medium": "0.1", "strong": "1.0"}
#: Table 6's average accuracies, (FedAvg, FedBN, FRAug) per intensity
PAPER = {"weak": ("63.02 ± 0.4", "63.97 ± 0.6", "64.72 ± 1.0"), "medium": ("60.71 ± 0.6", "60.12 ± 0.5", "61.45 ± 0.8"),
         "strong": ("31.26 ± 1.2", "30.90 ± 0.9", "31.65 ± 0.7")}


def noise(level):
    return ("--noise_skew", LEVELS[level], "--noise_skew_rule", "uniform", "--noise_skew_splits", "train")


def trio(level, fraug_flags=FRAUG):
    """Table 6's three rows at one intensity: FRAug (``fraug_flags``), FedBN (optimizer state kept) and FedAvg."""
    fedavg, fedbn, fraug = PAPER[level]
    sigma = LEVELS[level]
    return (
        run(f"fraug_{level}", (*fraug_flags, *noise(level)), f"FRAug, sigma {sigma}", fraug),
        run(f"fedbn_{level}", ("--method", "fedbn", "--keep_optimizer_state", "true", *noise(level)),
            f"FedBN (optimizer state kept), sigma {sigma}", fedbn),
        run(f"fedavg_{level}", ("--method", "fedavg", *noise(level)), f"FedAvg, sigma {sigma}", fedavg),
    )


MEDIUM = trio("medium")
OTHERS = (
    run("fedprox_medium", ("--method", "fedprox", "--mu", "0.01", *noise("medium")), "FedProx (mu 0.01), sigma 0.1",
        None),
    run("fedproto_medium", ("--method", "fedproto", *noise("medium")), "FedProto (lambda 1), sigma 0.1", None),
    run("fedbabu_medium", ("--method", "fedbabu", *VAL, *noise("medium")),
        "FedBABU (fine-tuning lr from validation), sigma 0.1", None),
    run("fedavg_ft_val_medium", ("--method", "fedavg_ft", *VAL, *noise("medium")),
        "FedAvg+FT (pFedAvg), lr from validation, sigma 0.1", None),
)


def _trio_claims(level):
    fedavg, fedbn, fraug = (p.split(" ±")[0] for p in PAPER[level])
    return (
        greater(f"fraug_{level}", f"fedbn_{level}", paper=f"{fraug} vs {fedbn} ({T6}, {level})"),
        greater(f"fraug_{level}", f"fedavg_{level}", paper=f"{fraug} vs {fedavg} ({T6}, {level})"),
    )


STUDY = Study(
    name="fraug_noise_digits",
    title="FRAug vs FedBN, FedAvg and other baselines with noised training images (Digits standing in for "
          "privatized OfficeHome, CPU scale)",
    paper="FRAug (Chen et al., ICCV 2023); Chen 2025 (dissertation), FRAug chapter, Table 6, section 4.3.4",
    description=__doc__.split("\n\n", 1)[1].replace("\n", " "),
    seeds=(0, 1, 2),
    common=common(),
    metrics={"personal_accuracy": "mean per-client accuracy (clean test images)"},
    variants=(*MEDIUM, *OTHERS, *trio("weak"), *trio("strong"), controls.chance(), controls.majority(),
              controls.untrained(MEDIUM[0])),
    matched_by="steps",
    claims=(
        *_trio_claims("weak"), *_trio_claims("medium"), *_trio_claims("strong"),
        greater("fedbn_weak", "fedavg_weak", paper=f"63.97 vs 63.02 ({T6}, weak)"),
        greater("fedavg_medium", "fedbn_medium", paper=f"60.71 vs 60.12 ({T6}, medium)"),
        greater("fedavg_strong", "fedbn_strong", paper=f"31.26 vs 30.90 ({T6}, strong)"),
        greater("fraug_weak", "fraug_medium", paper=f"64.72 vs 61.45 ({T6}): more noise, lower accuracy"),
        greater("fraug_medium", "fraug_strong", paper=f"61.45 vs 31.65 ({T6}): more noise, lower accuracy"),
        greater("fraug_medium", "fedprox_medium", paper="no noisy number in the paper; clean Digits 89.59 vs 84.96 "
                                                        "(FRAug chapter, Table 2)"),
        greater("fraug_medium", "fedproto_medium", paper="no noisy number in the paper; clean Digits 89.59 vs 87.50 "
                                                         "(FRAug chapter, Table 2)"),
        greater("fraug_medium", "fedbabu_medium", paper="no noisy number in the paper; clean Digits 89.59 vs 86.52 "
                                                        "(FRAug chapter, Table 2)"),
        greater("fraug_medium", "fedavg_ft_val_medium", paper="no noisy number in the paper; clean Digits 89.59 vs "
                                                              "87.03 (FRAug chapter, Table 2, pFedAvg)"),
        greater("fraug_medium", "untrained", paper="(control) federated training beats the initial model"),
        greater("fraug_medium", "majority", paper="(control) above the label-majority rate"),
        greater("fraug_strong", "majority", paper="(control) the strong intensity still above the label-majority "
                                                  "rate (Table 6: 31.65 on 65 classes)"),
    ),
    paper_ordering=("fraug_medium", "fedavg_medium", "fedbn_medium"),
)
