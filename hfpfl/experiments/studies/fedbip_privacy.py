"""FedBiP's membership-inference analysis (Table 4) at laptop scale: FedBiP-L vs FedAvg, with Central.

FedBiP (dissertation ch. 5, Sec. 5.5, Table 4), following Yeom et al. 2018 and Salem et al. 2018: the difference
between the final model's average loss (and average prediction entropy) on members (the clients' training images) and
on non-members; smaller is better, and FedBiP's is smaller than FedAvg's on DomainNet, DermaMNIST and PACS (loss gap
0.1611 vs 0.5976, 0.4127 vs 0.5860, 0.1244 vs 0.4459). Here both gaps are computed by hfpfl.fedbip.privacy
(membership_inference_gap: |mean over the clients' train images - mean over their test images|, sample-pooled, each
client scored with the model its method gives it), on the setting of fedbip_digits (three clients, one Digits domain
each: USPS, MNIST-M, SYN; {shots} train images per class per client drawn by the run seed; the split fixed at data
seed 0, whose public part the frozen tiny LDM was pretrained on). The paper reports gaps, not an attack's accuracy, so
the gaps are what is compared. FedBiP's classifier never sees a member image (it trains on images synthesised from
the uploaded noised latents), FedAvg's and Central's train on them. Every classifier is the same
random-init tiny ResNet trained exactly {steps} steps (FedAvg: {rounds} rounds of {local} local steps per
client). Control for the metric: the same classifier before training (it never saw a member, so its gap is the
floor the test-split size sets). Rows whose command line is a fedbip_digits row's, flag for flag (the same row
key: FedBiP-L, chance, majority), are that study's stored rows (their own commit and date shown). Cut to fit (a box shared by several studies): one dataset (the paper: three), FedBiP-L only (the paper's
"FedBiP"), no Local-only row."""
import dataclasses

from hfpfl.experiments.studies.fedbip_digits import COMMON, FEDBIP, LOCAL, ROUNDS, SHOTS, STEPS
from hfpfl.experiments import Study, Variant, controls, greater

T4 = "FedBiP (dissertation ch. 5), Table 4"
HOOK = "hfpfl.experiments.studies.fedbip_privacy:mia_metrics"


def mia_metrics(sim, results: dict) -> None:
    """The membership-inference gaps of the trained run (FedBiP reports them itself; the real-data methods get them
    from the same function)."""
    if "mia_loss_gap" not in results["final"]:
        from hfpfl.fedbip.privacy import membership_inference_gap
        results["final"].update(membership_inference_gap(sim.algorithm, sim.server_state, sim.args.num_rounds))


@controls.register("untrained_mia")
def untrained_mia(study, variant, seed, out_dir) -> dict:
    """The classifier before any round (as controls.untrained), with its membership-inference gaps."""
    from hfpfl.arguments import parse_run_args
    from hfpfl.federated.engine import Simulation
    from hfpfl.fedbip.privacy import membership_inference_gap

    run, data, cfg = parse_run_args(study.argv(variant, seed))
    run = dataclasses.replace(run, output_dir=str(out_dir), overwrite_output_dir=True, progress=False,
                              checkpoint_every=0)
    sim = Simulation(run, data, cfg)
    sim.setup()
    res = sim.finish()
    res["final"].update(membership_inference_gap(sim.algorithm, sim.server_state, 0))
    return controls.row_from_results(res)


# FedBiP reports its gaps itself: its row is fedbip_digits' FedBiP-L row, flag for flag (the same row key)
FEDBIP_L = Variant("fedbip_l", (*FEDBIP, "--multiplier", "10", "--personalization", "full"), label="FedBiP-L (10x)",
                   paper="loss 0.1611 / 0.4127 / 0.1244; entropy 0.0186 / 0.0551 / 0.0338",
                   metrics_hook="hfpfl.fedbip.quality:synthetic_quality")
FEDAVG = Variant("fedavg", ("--method", "fedavg", "--num_rounds", str(ROUNDS), "--local_steps", str(LOCAL)),
                 label="FedAvg (multi-round, real data)",
                 paper="loss 0.5976 / 0.5860 / 0.4459; entropy 0.1311 / 0.0897 / 0.1635", metrics_hook=HOOK)
CENTRAL = Variant("central", ("--method", "central", "--steps", str(STEPS), "--num_rounds", "1"),
                  label="Central (pooled real data; oracle)", metrics_hook=HOOK)
UNTRAINED = Variant("untrained", FEDAVG.argv, kind="untrained_mia", label="the classifier before training")

STUDY = Study(
    name="fedbip_privacy",
    title="FedBiP: membership-inference gaps (Table 4), FedBiP-L vs FedAvg, Digits feature shift",
    paper="FedBiP (dissertation ch. 5), Table 4 (DomainNet / DermaMNIST / PACS)",
    description=__doc__.split("\n\n", 1)[1].replace("\n", " ").format(
        shots=SHOTS, steps=STEPS, rounds=ROUNDS, local=LOCAL),
    seeds=(0, 1, 2),
    common=COMMON,
    metrics={"mia_loss_gap": "MIA loss gap |member - non-member| (lower: more private)",
             "mia_entropy_gap": "MIA entropy gap (lower: more private)",
             "member_loss": "mean loss on members (train images)",
             "nonmember_loss": "mean loss on non-members (test images)",
             "personal_accuracy": "mean per-client accuracy"},
    variants=(FEDBIP_L, FEDAVG, CENTRAL, UNTRAINED, controls.chance(), controls.majority()),
    matched_by="steps",
    claims=(
        greater("fedavg", "fedbip_l", metric="mia_loss_gap",
                paper=f"FedBiP's loss gap below FedAvg's: 0.1611 vs 0.5976, 0.4127 vs 0.5860, 0.1244 vs 0.4459 ({T4})"),
        greater("fedavg", "fedbip_l", metric="mia_entropy_gap",
                paper=f"FedBiP's entropy gap below FedAvg's: 0.0186 vs 0.1311, 0.0551 vs 0.0897, 0.0338 vs 0.1635 "
                      f"({T4})"),
        greater("fedavg", "untrained", metric="mia_loss_gap",
                paper="(control) FedAvg's loss gap above the untrained classifier's: the gap can see membership here"),
        greater("fedbip_l", "untrained", metric="personal_accuracy",
                paper="(control) FedBiP-L's classifier learned something (its small gap is not an untrained model's)"),
    ),
    paper_ordering=("fedavg", "fedbip_l"),
)
