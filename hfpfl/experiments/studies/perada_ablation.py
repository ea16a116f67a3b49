"""PerAda's ablations: the proximal strength lambda (Fig. 7) and the server distillation steps R, data fraction and
data source (Fig. 4).

PerAda (Xie et al., CVPR 2024), Sec. 7.1 "Effects of KD" and Appendix B "Effect of lambda", both on CIFAR-10: Figure 4
("Distillation steps: we fix the distillation data fraction as 1 and increase steps"): "more distillation steps and
distillation data samples are better for pFL generalization" and "KD does not have such a negative impact on
personalized performance"; Figure 7: "moderately increasing regularization strength" lambda improves generalization,
but "an overly large lambda degrades the personalized performance". The figures' values (the swept R and lambda, the
accuracies) are not in the paper's text, only these trends; the sweeps here are the spec's: R in {{0, 10, 30, 50, 100}}
(R = 0 is PerAda w/o KD; 30 is perada_digits' R) and lambda in {{0.1, 1, 10}} (the paper's grid is {{0.1, 1}}, so 10 stands for "overly
large"; with lr 0.05 a lambda much above 10 makes the proximal step itself unstable). Generalization is the paper's
C10-G metric: the personal models on the union of all clients' test sets. Setting: the study perada_digits', imported
(Digits Dir(0.1), 10 clients, 4 per round, {rounds} rounds of one local epoch, SGD lr 0.05, the out-of-domain tiny
ResNet stand-in, residual adapters, KD on the unlabelled out-of-domain pool at full fraction, the student's BatchNorm
statistics untouched by KD); every row but the swept value is perada_digits' PerAda row (lambda 1, R = {kd}), so that
row, PerAda w/o KD and the controls are borrowed from perada_digits' stored rows (`python -m hfpfl.experiments borrow
perada_ablation --from perada_digits`), and the KD verdict after the BN fix (KD vs no KD, seeds 0-2) is perada_digits' claims
"perada > perada_nokd", restated here. Fig. 4's other two panels (Appendix: "we fix the distillation steps as 100 and
increase the data fraction"; "100 steps, fraction 1 ... different distillation datasets"): the data fraction of the
out-of-domain pool (2,000 images) at {{0.09, 0.3, 1}} (--kd_public_fraction; 0.09 keeps 180 images, the size of the
in-domain pool) and the source: out-of-domain pool vs in-domain held-out data vs none. The in-domain pool is the
Digits public split (--kd_pool public: 15% of each domain's images, 180 here, held by no client and disjoint from
every client's train and test data and from the global test split; the paper's 5k CIFAR-10 validation images against
50k CIFAR-100, a tenth of the out-of-domain pool as here). Both panels run at R = {kd} (the other rows' R), not the
paper's 100, so that their fraction-1 / out-of-domain row is the shared PerAda row; R = 100 is a step of the R sweep.
"More data is better" is a rise per step on the C10-G metric; "by a margin" above no KD is our 1 point; "comparable"
to in-domain is two-sided within 1 point (the figure's values are not in the text). Cut to fit the time: STL-10's
second out-of-domain pool (one out-of-domain pool ships), the panels at R = 100, lambda = 0.01. Rows are matched
by epochs: KD steps are server steps and lambda and the KD pool change no client step count."""
from hfpfl.experiments import Study, Variant, greater, margin, within
from hfpfl.experiments.claims import rises
from hfpfl.experiments.studies import perada_digits as base

F4 = "PerAda Fig. 4 (CIFAR-10): more distillation steps are better for pFL generalization"
F4D = "PerAda Fig. 4 (CIFAR-10): more distillation data samples are better for pFL generalization"
F4S = "PerAda Fig. 4 (CIFAR-10), distillation datasets"
F7 = "PerAda Fig. 7 (Appendix B, CIFAR-10)"
UNION = "personal_accuracy_union"


def perada(name: str, label: str, *, lam: float = 1.0, kd_steps: int = base.KD_STEPS, extra: tuple = ()) -> Variant:
    """PerAda at perada_digits' settings with lambda and R as given (lambda 1 is the default, so it is not passed and
    the lambda = 1 rows keep perada_digits' row keys); ``extra``: the KD pool's flags (fraction, source)."""
    argv = ("--method", "perada", "--adapter", "residual", "--kd_steps", str(kd_steps), *extra)
    if lam != 1.0:
        argv += ("--lam", f"{lam:g}")
    return Variant(name, argv, label=label, metrics_hook=base.HOOK)


LAM_01 = perada("lam_0.1", "PerAda, lambda 0.1", lam=0.1)
LAM_10 = perada("lam_10", "PerAda, lambda 10", lam=10.0)
KD_10 = perada("kd_10", "PerAda, R = 10", kd_steps=10)
KD_50 = perada("kd_50", "PerAda, R = 50", kd_steps=50)
KD_100 = perada("kd_100", "PerAda, R = 100", kd_steps=100)
FRAC_009 = perada("frac_0.09", f"PerAda, KD data fraction 0.09 (180 images), R = {base.KD_STEPS}",
                  extra=("--kd_public_fraction", "0.09"))
FRAC_03 = perada("frac_0.3", f"PerAda, KD data fraction 0.3 (600 images), R = {base.KD_STEPS}",
                 extra=("--kd_public_fraction", "0.3"))
IN_DOMAIN = perada("kd_in_domain", f"PerAda, KD on in-domain held-out data (public split, 180 images), "
                                   f"R = {base.KD_STEPS}", extra=("--kd_pool", "public"))
PERADA = Variant(base.PERADA.name, base.PERADA.argv, label=f"PerAda (lambda 1, R = {base.KD_STEPS})",
                 paper=base.PERADA.paper, metrics_hook=base.HOOK)
NOKD = Variant(base.NOKD.name, base.NOKD.argv, label="PerAda w/o KD (R = 0)", paper=base.NOKD.paper,
               metrics_hook=base.HOOK)
CONTROLS = tuple(v for v in base.STUDY.variants if v.kind != "run")

STUDY = Study(
    name="perada_ablation",
    title="PerAda's ablations: lambda (Fig. 7); distillation steps, data fraction and data source (Fig. 4) (Digits, "
          "Dir(0.1))",
    paper="PerAda (Xie et al., CVPR 2024), Figures 4 and 7",
    description=__doc__.split("\n\n", 1)[1].replace("\n", " ").format(rounds=base.ROUNDS, kd=base.KD_STEPS),
    seeds=(0, 1, 2),
    common=base.STUDY.common,
    metrics=base.STUDY.metrics,
    variants=(NOKD, KD_10, PERADA, KD_50, KD_100, FRAC_009, FRAC_03, IN_DOMAIN, LAM_01, LAM_10, *CONTROLS),
    matched_by="epochs",
    claims=(
        *rises(("perada_nokd", "kd_10", "perada", "kd_50", "kd_100"), metric=UNION,
               paper=f"{F4} (C10-G: personal models on the union test set)"),
        *rises(("frac_0.09", "frac_0.3", "perada"), metric=UNION,
               paper=f"{F4D} (C10-G; fraction 0.09 -> 0.3 -> 1 of the out-of-domain pool)"),
        margin("perada", "perada_nokd", 0.01, metric=UNION,
               paper=f"{F4S}: out-of-domain KD data improves generalization over no KD \"by a margin\" (C10-G; "
                     "a margin: 1 point, ours)"),
        within("perada", "kd_in_domain", 0.01, metric=UNION,
               paper=f"{F4S}: out-of-domain KD \"comparable\" to in-domain held-out data (C10-G; within 1 point, "
                     "ours)"),
        margin("kd_in_domain", "perada_nokd", 0.01, metric=UNION,
               paper=f"{F4S}: in-domain KD data above no KD (C10-G; 1 point, ours)"),
        margin("kd_50", "perada_nokd", -0.01,
               paper=f"{F4}; KD does not hurt personalized accuracy (own test sets; 'not hurt': at most 1 point "
                     "below w/o KD, our tolerance)"),
        greater("perada", "perada_nokd",
                paper="KD vs no KD after the BN fix, as perada_digits: PerAda 91.82 > w/o KD 91.27 (Table 1)"),
        greater("perada", "perada_nokd", metric="global_accuracy",
                paper="KD vs no KD, global adapter, as perada_digits: 76.77 > 74.22 (Table 2)"),
        *rises(("lam_0.1", "perada", "lam_10"), metric=UNION,
               paper=f"{F7}: moderately increasing lambda improves generalization (C10-G)"),
        greater("perada", "lam_10", paper=f"{F7}: an overly large lambda degrades personalized accuracy"),
        greater("lam_10", "majority", paper="(control) above each client's majority label"),
        greater("kd_10", "untrained", paper="(control) federated training beats the initial model"),
    ),
    per_domain=False,   # Dirichlet clients mix the four domains
)
