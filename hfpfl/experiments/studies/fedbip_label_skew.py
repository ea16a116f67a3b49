"""FedBiP under label skew (Table 2) at laptop scale: IID, Dir 0.5 and Dir 0.01 over five clients of one domain.

FedBiP (dissertation ch. 5, Sec. 5.2, Table 2): five clients of one dataset (UCM, DermaMNIST), labels split by
Dir(beta), beta in IID / 0.5 / 0.01; FedBiP-L beats every baseline in every split (by up to 4.16 points over FedAvg,
DermaMNIST Dir 0.01), Central (the oracle) stays above it, and every method loses accuracy as the skew grows (IID >
Dir 0.5 > Dir 0.01 for FedBiP-L and FedAvg on both datasets). Here: five clients of one Digits domain (MNIST-M, the
textured style), the domain's train pool (700 images at --max_per_domain {cap}) split among them IID or by the
existing Dirichlet partition (--partition dirichlet --alpha 0.5 / 0.01), each client keeping {train_pct} percent of
its share for training ({train_total} images over the five clients) and the rest as its test split; the split
(partition, train/test) fixed at data seed 0 for every seed (the frozen tiny LDM was pretrained on that split's
public images), so the seeds vary the training, not the Dirichlet draw. The metric is the global test set's accuracy
(150 images of the domain's test split, the same for every split), as the paper tests on the official test split;
per-client accuracy on each client's own (skewed) test split is shown beside. A class with one train image on a
client has no same-class partner for Eq. 3: FedBiP falls back to i' = i there (--singleton_classes self), in every
split. FedBiP-L: concepts {concept_epochs} epochs, 20 PNDM steps at guidance 3, 10x the clients' images. Every
classifier is the same random-init tiny ResNet trained exactly {steps} steps (FedAvg: {rounds} rounds of {local}
local steps per client; Central: on the pooled real train images of the split's clients). Controls: chance, the
label majority of each split, the classifier before training. Cut to fit: one domain (the paper: two datasets),
FedBiP-L only (the paper: S / M / L), no one-shot baselines."""
from hfpfl.experiments import Study, Variant, controls, greater
from hfpfl.experiments.claims import rises

CONCEPT_EPOCHS, STEPS, ROUNDS = 20, 500, 20
LOCAL = STEPS // ROUNDS
CAP, TEST_FRACTION = 1000, 0.8
T2 = "FedBiP (dissertation ch. 5), Table 2"
FEDBIP = ("--method", "fedbip", "--concept_epochs", str(CONCEPT_EPOCHS), "--num_inference_steps", "20",
          "--guidance_scale", "3.0", "--prompt_template", "a [S] photo of the digit [V]",
          "--classifier_steps", str(STEPS), "--num_rounds", "1", "--multiplier", "10",
          "--singleton_classes", "self")
SPLITS = {"iid": (("--partition", "iid"), "IID"),
          "dir05": (("--partition", "dirichlet", "--alpha", "0.5"), "Dir 0.5"),
          "dir001": (("--partition", "dirichlet", "--alpha", "0.01"), "Dir 0.01")}
#: Table 2, UCM / DermaMNIST, per split
PAPER = {"fedbip_l": {"iid": "65.59 / 56.10", "dir05": "64.41 / 55.03", "dir001": "59.84 / 48.15"},
         "fedavg": {"iid": "63.82 / 53.47", "dir05": "62.96 / 51.98", "dir001": "57.47 / 43.99"},
         "central": {"iid": "68.44 / 60.08", "dir05": "68.44 / 60.08", "dir001": "68.44 / 60.08"}}


def rows(split: str) -> tuple:
    flags, title = SPLITS[split]
    return (Variant(f"fedbip_l_{split}", (*flags, *FEDBIP), label=f"FedBiP-L (10x), {title}",
                    paper=PAPER["fedbip_l"][split], metrics_hook="hfpfl.fedbip.quality:synthetic_quality"),
            Variant(f"fedavg_{split}", (*flags, "--method", "fedavg", "--num_rounds", str(ROUNDS), "--local_steps",
                                        str(LOCAL)), label=f"FedAvg (multi-round), {title}",
                    paper=PAPER["fedavg"][split]),
            Variant(f"central_{split}", (*flags, "--method", "central", "--steps", str(STEPS), "--num_rounds", "1"),
                    label=f"Central (pooled real; oracle), {title}", paper=PAPER["central"][split]),
            Variant(f"majority_{split}", flags, kind="majority", label=f"label majority (train labels), {title}"))


FEDAVG_IID = rows("iid")[1]
ORDER = ("dir001", "dir05", "iid")   # the skew falls: accuracy should rise

STUDY = Study(
    name="fedbip_label_skew",
    title="FedBiP under label skew (Table 2): IID / Dir 0.5 / Dir 0.01, FedBiP-L vs FedAvg and Central, MNIST-M",
    paper="FedBiP (dissertation ch. 5), Table 2 (UCM / DermaMNIST, five clients)",
    description=__doc__.split("\n\n", 1)[1].replace("\n", " ").format(
        cap=CAP, train_pct=round(100 * (1 - TEST_FRACTION)), train_total=round(700 * (1 - TEST_FRACTION)),
        concept_epochs=CONCEPT_EPOCHS, steps=STEPS, rounds=ROUNDS, local=LOCAL),
    seeds=(0, 1, 2),
    common=("--dataset", "mnistm", "--num_clients", "5", "--max_per_domain", str(CAP), "--test_fraction",
            str(TEST_FRACTION), "--image_size", "32", "--data_seed", "0", "--model", "tiny-resnet", "--optimizer",
            "sgd", "--lr", "0.05", "--momentum", "0.9", "--batch_size", "32"),
    metrics={"global_accuracy": "accuracy on the global test set (the domain's test split)",
             "personal_accuracy": "mean per-client accuracy (each client's own test split)",
             "synthetic_fidelity_judge": "synthetic images read as their label (LDM's public judge)"},
    variants=(*(v for s in ORDER[::-1] for v in rows(s)), controls.chance(),
              controls.untrained(FEDAVG_IID, label="the classifier before training (IID)")),
    matched_by="steps",
    per_domain=False,
    claims=(
        *(greater(f"fedbip_l_{s}", f"fedavg_{s}", paper=f"FedBiP-L above FedAvg at {SPLITS[s][1]}: "
                  f"{PAPER['fedbip_l'][s]} vs {PAPER['fedavg'][s]} ({T2})") for s in ORDER[::-1]),
        *(greater(f"central_{s}", f"fedbip_l_{s}", paper=f"the oracle Central above FedBiP-L at {SPLITS[s][1]}: "
                  f"{PAPER['central'][s]} ({T2})") for s in ORDER[::-1]),
        *rises([f"fedbip_l_{s}" for s in ORDER], paper=f"FedBiP-L loses accuracy as the skew grows ({T2})"),
        *rises([f"fedavg_{s}" for s in ORDER], paper=f"FedAvg loses accuracy as the skew grows ({T2})"),
        greater("fedbip_l_dir001", "untrained", paper="(control) FedBiP-L at Dir 0.01 learned something"),
        greater("fedbip_l_dir001", "chance", paper="(control) FedBiP-L at Dir 0.01 above chance"),
    ),
    paper_ordering=("central_iid", "fedbip_l_iid", "fedbip_l_dir05", "fedavg_iid", "fedavg_dir05", "fedbip_l_dir001",
                    "fedavg_dir001"),
)
