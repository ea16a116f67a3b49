"""The easy-vqa benchmark check, before any FedDAT run: do the answers need the image?

FedDAT's tables can only rank methods on a benchmark whose answers need the image. Here each foundation stand-in
(hfpfl/tiny-vilt-easyvqa-pool: ViLT-style, pretrained with image-text matching + masked language modelling;
hfpfl/tiny-blip-easyvqa-pool: BLIP, for ALBEF, pretrained with image-text contrastive + matching + captioning; both
on captioned pool images, never on VQA answers, and with a fresh answer head) is fine-tuned centrally on the union of
the clients' training splits (--method vqa_central: one round, every client sends its split once; {peft_text}, AdamW
lr {lr}, {epochs} epochs, batch 32, warm-up 10% + linear decay), then scored on every client's test split, on the
three splits (function, scene, domain; {train} training and {test} test questions per client, every question
string's answers uniform: --answer_balance question, the default). The same training on images shuffled across the
questions of each split (shuffled) and on blank images (question-only) says how much of the score the image
explains; chance (uniform over each client's own answers) and each client's majority answer are the floors. The
claims: real >= shuffled + 0.15 and real > question-only, per backbone and split. Cut to fit the time: {cut}"""
from hfpfl.experiments import Study, Variant, greater, margin
from hfpfl.experiments import vqa_controls as vqa

RECIPE = "recipes/feddat.py"
SPLITS = ("function", "scene", "domain")
BACKBONES = ("vilt", "blip")
TRAIN, TEST, EPOCHS, LR, PEFT = 200, 100, 16, "2e-3", "full"
PEFT_TEXT = {"adapter": "the adapters (r = d/16, one per block) and one answer head trained, the backbone frozen: "
                        "what the federated PEFT methods train",
             "full": "every weight trained"}[PEFT]
CUT = (f"{TRAIN} / {TEST} questions per client, {EPOCHS} epochs, 32 px images and a 64-wide, 3-layer stand-in (the "
       f"paper: ViLT-B at 384 px); the FedDAT paper's lr is 1e-4 for 20 rounds, here {LR} for the few central epochs; seeds run seed-major, so the table may hold fewer seeds for the last rows (see the rows' seeds).")


def _variants():
    out, claims = [], []
    for split in SPLITS:
        for bb in BACKBONES:
            real = Variant(f"{bb}_{split}", ("--backbone", bb, "--vqa_split", split), recipe=RECIPE,
                           label=f"{bb.upper()} {split}: central fine-tuning, real images")
            shuffled = vqa.shuffled_image(real, name=f"{bb}_{split}_shuffled",
                                          label=f"{bb.upper()} {split}: images shuffled across questions")
            blank = vqa.question_only(real, name=f"{bb}_{split}_blank",
                                      label=f"{bb.upper()} {split}: question-only (blank images)")
            out += [real, shuffled, blank]
            claims += [
                margin(real.name, shuffled.name, 0.15,
                       paper=f"(benchmark) {bb} {split}: the image explains >= 0.15 of the centrally fine-tuned score"),
                greater(real.name, blank.name,
                        paper=f"(benchmark) {bb} {split}: above the question-only model (the question prior)"),
            ]
        base = Variant(f"vilt_{split}_data", ("--backbone", "vilt", "--vqa_split", split), recipe=RECIPE)
        out += [vqa.chance(base, name=f"{split}_chance", label=f"{split}: chance (uniform over the client's answers)"),
                vqa.majority(base, name=f"{split}_majority", label=f"{split}: each client's majority answer")]
        claims += [greater(f"{bb}_{split}", f"{split}_majority",
                           paper=f"(control) {bb} {split}: above each client's majority answer") for bb in BACKBONES]
    return tuple(out), tuple(claims)


VARIANTS, CLAIMS = _variants()

STUDY = Study(
    name="vqa_benchmark_check",
    title="easy-vqa benchmark check: central fine-tuning with real, shuffled and blank images",
    paper="FedDAT (Chen et al., AAAI 2024; Chen 2025, dissertation, Ch. 3): the benchmark its tables need",
    description=__doc__.split("\n\n", 1)[1].replace("\n", " ").format(
        peft_text=PEFT_TEXT, lr=LR, epochs=EPOCHS, train=TRAIN, test=TEST, cut=CUT),
    seeds=(0, 1, 2),
    common=("--method", "vqa_central", "--num_rounds", "1", "--peft", PEFT, "--epochs", str(EPOCHS), "--lr", LR,
            "--train_per_client", str(TRAIN), "--test_per_client", str(TEST)),
    metrics={"personal_accuracy": "mean per-client accuracy (the centrally fine-tuned model on each client's test)"},
    variants=VARIANTS,
    matched_by="steps",
    claims=CLAIMS,
    per_domain=False,
)
