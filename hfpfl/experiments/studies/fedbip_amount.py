"""FedBiP's synthetic-amount sweep (Fig. 5) at laptop scale: 1x to 20x the clients' images, vs FedAvg and Central.

FedBiP (dissertation ch. 5, Sec. 5.4, Fig. 5) synthesises 1x to 20x the clients' local dataset size on DomainNet and
OfficeHome: accuracy rises with the amount, up to 6.47 points above FedAvg, and 10x is "the most effective"
trade-off between generation time and accuracy (FedBiP-L). The figure has no printed numbers; the paper's anchors are
Table 1's FedBiP-S / -M / -L (2x / 5x / 10x) averages. Here, on the setting of fedbip_digits (three clients, one
Digits domain each: USPS, MNIST-M, SYN; {shots} train images per class per client drawn by the run seed; the split
fixed at data seed 0, whose public part the frozen tiny LDM was pretrained on; FedBiP's concepts trained
{concept_epochs} epochs, 20 PNDM steps at guidance 3), FedBiP (full) at 1x, 2x, 5x, 10x and 20x. Every classifier is
the same random-init tiny ResNet trained exactly {steps} steps whatever the amount (FedAvg: {rounds} rounds of {local}
local steps per client; Central: on the pooled real train images, the one-shot control), so a larger amount gives
the classifier more distinct images, not more steps. Controls: chance, each client's majority label, the classifier
before training. Rows whose command line is a fedbip_digits row's, flag for flag (the same row key: 2x, 5x and 10x are its
FedBiP-S, -M and -L, and FedAvg, Central and the controls), are that study's stored rows (their own commit and date
shown); 1x and 20x ran here."""
from hfpfl.experiments.studies.fedbip_digits import (CENTRAL, COMMON, CONCEPT_EPOCHS, FEDAVG, FEDBIP, LOCAL,
                                                     METRICS, ROUNDS, SHOTS, STEPS)
from hfpfl.experiments import Study, Variant, controls, greater
from hfpfl.experiments.claims import rises

F5 = "FedBiP (dissertation ch. 5), Fig. 5"
AMOUNTS = (1, 2, 5, 10, 20)
#: Table 1's averages (DomainNet / PACS / OfficeHome) at the amounts it reports
PAPER = {2: "FedBiP-S 61.51 / 56.62 / 50.59", 5: "FedBiP-M 64.86 / 60.30 / 55.27",
         10: "FedBiP-L 67.82 / 62.67 / 61.52"}


def amount(m: int) -> Variant:
    return Variant(f"fedbip_{m}x", (*FEDBIP, "--multiplier", str(m), "--personalization", "full"),
                   label=f"FedBiP, {m}x synthetic",
                   paper=PAPER.get(m), metrics_hook="hfpfl.fedbip.quality:synthetic_quality")


NAMES = [f"fedbip_{m}x" for m in AMOUNTS]

STUDY = Study(
    name="fedbip_amount",
    title="FedBiP: synthetic amount 1x-20x (Fig. 5) vs FedAvg and Central, Digits feature shift",
    paper="FedBiP (dissertation ch. 5), Fig. 5 (DomainNet, OfficeHome) and Table 1's S / M / L averages",
    description=__doc__.split("\n\n", 1)[1].replace("\n", " ").format(
        shots=SHOTS, concept_epochs=CONCEPT_EPOCHS, steps=STEPS, rounds=ROUNDS, local=LOCAL),
    seeds=(0, 1, 2),
    common=COMMON,
    metrics=METRICS,
    variants=(*(amount(m) for m in AMOUNTS), FEDAVG, CENTRAL, controls.chance(), controls.majority(),
              controls.untrained(FEDAVG, label="the classifier before training")),
    matched_by="steps",
    claims=(
        *rises(NAMES, paper=f"accuracy rises with the synthetic amount, 1x to 20x ({F5})"),
        greater("fedbip_20x", "fedavg", paper=f"FedBiP above FedAvg, by up to 6.47 points ({F5})"),
        greater("fedbip_10x", "fedavg", paper="FedBiP-L 67.82 / 62.67 / 61.52 above FedAvg 61.49 / 59.63 / 60.00 "
                                              "(Table 1)"),
        greater("central", "fedbip_20x", paper="the oracle Central above FedBiP (Table 1: 73.42 / 67.32 / 64.38)"),
        greater("fedbip_1x", "untrained", paper="(control) the smallest synthetic set teaches the classifier something"),
        greater("fedbip_1x", "majority", paper="(control) above each client's majority label"),
    ),
    # by the mean of Table 1's three averages (FedAvg 60.37 between -L 64.00 and -M 60.14); 20x and 1x placed by Fig. 5
    paper_ordering=("central", "fedbip_20x", "fedbip_10x", "fedavg", "fedbip_5x", "fedbip_2x", "fedbip_1x"),
)
