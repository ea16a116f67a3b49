"""The FedDAT study of one easy-vqa split (``feddat_<split>.py`` are its instances): FedDAT, its Table 4 ablations,
every PEFT baseline the code has, and the VQA controls."""
from hfpfl.experiments import Study, Variant, greater, margin
from hfpfl.experiments import vqa_controls as vqa

RECIPE = "recipes/feddat.py"
SOURCE = "Chen 2025 (dissertation), FedDAT chapter (Ch. 3)"
#: Whether the stand-in backbone carries a VQA answer head of its own (pretrained on answers). The stand-ins are
#: pretrained as ViLT/ALBEF are, with image-text matching and masked language modelling, so they have none and a
#: client's answer head starts random; set True for a backbone with an answer head to add the control "the stand-in
#: with its own head, before any training" (--head_init pretrained) and the claim that FedDAT beats it.
STANDIN_ANSWER_HEAD = False

#: the paper's ViLT numbers per row and split: Table 2 (Domain average), Table 3 (Function / Scene), Table 4
#: (the ablations and the inference rows); None where the paper has no ViLT number
PAPER = {
    "feddat": {"domain": "61.11 ± 2.98", "function": "54.39 ± 2.36", "scene": "39.35 ± 1.25"},
    "feddat_nomkd": {"domain": "58.41 ± 1.57", "function": "52.82 ± 2.98", "scene": "36.98 ± 1.07"},
    "feddat_wo_frozen": {"domain": "58.24 ± 0.98", "function": "50.62 ± 1.45", "scene": "33.04 ± 0.65"},
    "feddat_wo_local": {"domain": "57.87 ± 1.24", "function": "50.93 ± 0.85", "scene": "32.45 ± 0.27"},
    "adapter": {"domain": "57.13 ± 4.08", "function": "48.37 ± 1.56", "scene": "31.07 ± 1.08"},
    "adapter_local": {"domain": "54.67 ± 2.54", "function": "39.68 ± 2.19", "scene": "31.91 ± 2.05"},
    "lora": {"domain": "51.07 ± 1.41", "function": "32.04 ± 1.12", "scene": "28.47 ± 1.03"},
    "prompt": {"domain": "53.45 ± 2.04", "function": "40.53 ± 1.56", "scene": "30.53 ± 1.30"},
    "bias": {"domain": "56.28 ± 1.97", "function": "43.81 ± 1.39", "scene": "33.65 ± 1.87"},
    "full": {"domain": None, "function": "59.62 ± 2.56", "scene": "40.62 ± 3.76"},
    "clf_local": {"domain": "50.04 ± 1.81", "function": "31.58 ± 1.97", "scene": "24.52 ± 0.95"},
    "inference_dat": {"domain": "58.45", "function": "50.42", "scene": "35.61"},
    "inference_local": {"domain": "55.87", "function": "46.14", "scene": "32.84"},
}

DESCRIPTION = """FedDAT (Chen et al., AAAI 2024; Chen 2025, dissertation, Ch. 3) claims FedDAT >= Adapter >= Adapter-L (Tables 2-3),
FedDAT > w/o MKD > Adapter, FedDAT above both teacher ablations, and A_s >= DAT >= A_c at inference (Table 4), on ViLT-B
over VQA clients. Here the offline easy-vqa benchmark ('{split}': see hfpfl.data.vqa) with the tiny ViLT stand-in
(--backbone vilt; how it was pretrained: its model card and hfpfl.models.vqa), {rounds} rounds of one local epoch,
{train} training and {test} test questions per client, batch 32, AdamW lr 1e-3 and weight decay 0.01 with the
recipe's per-round warm-up and linear decay (the paper: lr 1e-4, batch 64, 20 rounds). Every method has a private
client head over the client's own answer pool (the paper's C^k-way heads) that steps once per batch (FedDAT trains it
with A_s's loss only, as Algorithm 1 reads). The rows: FedDAT; its Table 4 ablations w/o MKD (no A_s -> DAT term),
w/o Â_s (teacher A_c alone) and w/o A_c (teacher Â_s alone); the PEFT baselines with FedAvg of the PEFT module:
Adapter, LoRA (query/value), prompt (5 reparameterised text prompt tokens, the authors' code), bias, and full
fine-tuning (the paper's oracle full*); and the local-only Adapter-L and clf-L (the head alone). The local-only rows
train one local epoch per round like the others (the paper: 20 epochs). The controls: chance (uniform over the
client's own answers), each client's majority answer, the Adapter model before federated training (random client
head), and Adapter trained and tested on blank images (question-only) or on images shuffled across questions
(--image_ablation). If the question-only control matches the methods, this benchmark cannot rank them: the claims
below are evaluated all the same. Matched by epochs: the steps column counts local batches; FedDAT and its ablations
take two optimizer steps on each (A_s with the head, then A_c), the baselines one. Cut to fit the time: full-L
(local full fine-tuning) and the BLIP stand-in. STALE ROWS: the rows stored here were run at commit 712ae41, with the
earlier stand-in (pretrained on the pool's VQA answers), unbalanced splits, a 13-answer head and two head steps per
FedDAT batch; they do not reproduce with the current code and no new variant has run. They stay shown until the study
is re-run, which should use the BLIP stand-in on function and domain, where vqa_benchmark_check finds that the image
matters."""

TABLE = {"domain": "Table 2", "function": "Table 3", "scene": "Table 3"}


def feddat_study(split: str, *, rounds: int, train: int, test: int, seeds=(0, 1, 2), doc: str = "") -> Study:
    paper = {k: v[split] for k, v in PAPER.items()}
    where = f"{SOURCE}, {TABLE[split]} (ViLT, {split})"
    ablation = f"{SOURCE}, Table 4 (ViLT, {split})"

    def row(name, argv, label):
        return Variant(name, argv, label=label, paper=paper.get(name), recipe=RECIPE)

    feddat = row("feddat", ("--method", "feddat"), "FedDAT")
    adapter = row("adapter", ("--method", "vqa_adapter"), "Adapter")
    peft = ("--method", "vqa_peft", "--peft")
    methods = (
        feddat,
        row("feddat_nomkd", ("--method", "feddat", "--mutual", "false"), "FedDAT w/o MKD"),
        row("feddat_wo_frozen", ("--method", "feddat", "--teacher", "local"), "FedDAT w/o Â_s (teacher A_c)"),
        row("feddat_wo_local", ("--method", "feddat", "--teacher", "frozen"), "FedDAT w/o A_c (teacher Â_s)"),
        adapter,
        row("adapter_local", ("--method", "vqa_adapter_local"), "Adapter-L"),
        row("lora", (*peft, "lora"), "LoRA"),
        row("prompt", (*peft, "prompt"), "prompt"),
        row("bias", (*peft, "bias"), "bias"),
        row("full", (*peft, "full"), "full fine-tuning (oracle full*)"),
        row("clf_local", (*peft, "head"), "clf-L (head only, local)"),
    )
    controls = [vqa.chance(adapter), vqa.majority(adapter),
                vqa.untrained(adapter, label="Adapter before federated training (random client head)"),
                vqa.question_only(adapter), vqa.shuffled_image(adapter)]
    control_claims = [
        greater("feddat", "question_only",
                paper="(control) FedDAT uses the image: above Adapter trained and tested on blank images"),
        greater("adapter", "shuffled_image",
                paper="(control) Adapter uses the image: above Adapter on images shuffled across questions"),
        greater("feddat", "untrained", paper="(control) federated training beats the model before it"),
        greater("feddat", "majority", paper="(control) above each client's majority answer")]
    if STANDIN_ANSWER_HEAD:
        controls.append(vqa.untrained(Variant("standin", (*adapter.argv, "--head_init", "pretrained")),
                                      name="standin_head",
                                      label="stand-in with its own answer head, before training"))
        control_claims.append(greater("feddat", "standin_head",
                                      paper="(control) federated training beats the stand-in's own answer head"))
    two_steps = ("FedDAT takes two optimizer steps per batch (A_s with the head, then A_c) against the baselines' one: "
                 "the paper matches them by epochs (one local epoch)")
    return Study(
        name=f"feddat_{split}",
        title=f"FedDAT, its ablations and the PEFT baselines on easy-vqa '{split}', with VQA controls "
              "(stored rows stale: the earlier stand-in; see the page)",
        paper=f"FedDAT (Chen et al., AAAI 2024); numbers: {SOURCE}, Tables 2-4 (ViLT)",
        description=doc,
        seeds=tuple(seeds),
        common=("--backbone", "vilt", "--vqa_split", split, "--num_rounds", str(rounds),
                "--train_per_client", str(train), "--test_per_client", str(test)),
        metrics={"personal_accuracy": "mean per-client accuracy",
                 "inference_shared": "FedDAT inference with A_s (the default)",
                 "inference_dat": "FedDAT inference with DAT (A_c + frozen A_s)",
                 "inference_local": "FedDAT inference with A_c alone"},
        variants=(*methods, *controls),
        matched_by="epochs",
        claims=(
            margin("feddat", "adapter", 0.0, paper=f"FedDAT {paper['feddat']} >= Adapter {paper['adapter']} ({where})",
                   budgets_differ_because=two_steps),
            margin("adapter", "adapter_local", 0.0,
                   paper=f"Adapter {paper['adapter']} >= Adapter-L {paper['adapter_local']} ({where})",
                   budgets_differ_because="Adapter-L trains locally the same epochs per round as Adapter"),
            greater("feddat", "feddat_nomkd",
                    paper=f"FedDAT {paper['feddat']} > w/o MKD {paper['feddat_nomkd']} ({ablation})"),
            greater("feddat_nomkd", "adapter",
                    paper=f"w/o MKD {paper['feddat_nomkd']} > Adapter {paper['adapter']} ({ablation})",
                    budgets_differ_because=two_steps),
            greater("feddat", "feddat_wo_frozen",
                    paper=f"FedDAT {paper['feddat']} > w/o Â_s {paper['feddat_wo_frozen']} ({ablation})"),
            greater("feddat", "feddat_wo_local",
                    paper=f"FedDAT {paper['feddat']} > w/o A_c {paper['feddat_wo_local']} ({ablation})"),
            margin("feddat", "feddat", 0.0, metric="inference_shared", metric_b="inference_dat",
                   paper=f"A_s {paper['feddat']} >= DAT {paper['inference_dat']} at inference ({ablation})"),
            margin("feddat", "feddat", 0.0, metric="inference_dat", metric_b="inference_local",
                   paper=f"DAT {paper['inference_dat']} >= A_c {paper['inference_local']} at inference ({ablation})"),
            *control_claims,
        ),
        paper_ordering=tuple(sorted((v.name for v in methods if paper.get(v.name)),
                                    key=lambda n: -float(paper[n].split()[0]))),
    )
