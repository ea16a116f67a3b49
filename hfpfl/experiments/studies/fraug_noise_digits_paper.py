"""FRAug vs FedBN and FedAvg with noised training images at the paper's optimizer settings (FRAug's Table 6).

The experiment of the study fraug_noise_digits (Chen's dissertation, FRAug chapter, Table 6, section 4.3.4: every
client's training images get delta ~ N(0, sigma^2 I), each client scores on its clean test images; Digits standing
in for privatized OfficeHome; --noise_skew sigma --noise_skew_rule uniform --noise_skew_splits train) at the
settings of the study fraug_digits_paper instead of the CPU ones: SGD lr 0.01 / momentum 0.5, generator and RTNet lr
0.005, the 200-round schedules, the authors' weighted classifier loss, each client's optimizer state kept (FRAug and
FedBN), 100 rounds of 5 local steps. Beside the paper's three rows, FRAug with the dissertation's Eq. 1 (the plain
sum L_real + L_syn), the variant that is above FedBN on clean Digits at these settings. Cut to fit (the last hour of
a shared 2-core box): the medium intensity (sigma 0.1) only."""
from hfpfl.experiments import Study, controls, greater

from .fraug_digits import run
from .fraug_digits_paper import FRAUG, STUDY as CLEAN
from .fraug_noise_digits import PAPER, T6, noise, trio

FRAUG_PAPER = PAPER["medium"][2]
SUM = tuple(a for a in FRAUG if a not in ("--cls_loss", "weighted", "--cls_ratio_gamma", "0.002"))
ROW, FEDBN_ROW, FEDAVG_ROW = trio("medium", FRAUG)

STUDY = Study(
    name="fraug_noise_digits_paper",
    title="FRAug vs FedBN and FedAvg with noised training images (sigma 0.1) at the paper's settings (Digits "
          "standing in for privatized OfficeHome)",
    paper="FRAug (Chen et al., ICCV 2023); Chen 2025 (dissertation), FRAug chapter, Table 6, section 4.3.4",
    description=__doc__.split("\n\n", 1)[1].replace("\n", " "),
    seeds=(0, 1, 2),
    common=CLEAN.common,
    metrics={"personal_accuracy": "mean per-client accuracy (clean test images)"},
    variants=(
        ROW,
        run("fraug_sum_medium", (*SUM, *noise("medium")), "FRAug with Eq. 1's plain sum, sigma 0.1", FRAUG_PAPER),
        FEDBN_ROW,
        FEDAVG_ROW,
        controls.chance(), controls.majority(), controls.untrained(ROW)),
    matched_by="steps",
    claims=(
        greater("fraug_medium", "fedbn_medium", paper=f"61.45 vs 60.12 ({T6}, medium)"),
        greater("fraug_medium", "fedavg_medium", paper=f"61.45 vs 60.71 ({T6}, medium)"),
        greater("fedavg_medium", "fedbn_medium", paper=f"60.71 vs 60.12 ({T6}, medium)"),
        greater("fraug_sum_medium", "fedbn_medium",
                paper=f"61.45 vs 60.12 ({T6}, medium); FRAug with Eq. 1's plain sum"),
        greater("fraug_sum_medium", "fedavg_medium",
                paper=f"61.45 vs 60.71 ({T6}, medium); FRAug with Eq. 1's plain sum"),
        greater("fraug_medium", "untrained", paper="(control) federated training beats the initial model"),
        greater("fraug_medium", "majority", paper="(control) above the label-majority rate"),
    ),
    paper_ordering=("fraug_medium", "fedavg_medium", "fedbn_medium"),
)
