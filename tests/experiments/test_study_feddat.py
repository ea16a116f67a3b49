"""The FedDAT studies' specs (hfpfl/experiments/studies/feddat_*.py): every row parses on the recipe's command line
into the method and options its label names, and the controls are there. Spec checks only: no run."""
import pytest

from hfpfl.arguments import parse_run_args
from hfpfl.experiments import load_study
from hfpfl.experiments.runner import _load_recipe
from hfpfl.experiments.studies import _feddat

STUDIES = ("feddat_domain", "feddat_function")   # no scene study: the benchmark check fails there
#: row -> (method, the options that make it that row)
ROWS = {"feddat": ("feddat", {"mutual": True, "teacher": "dat"}),
        "feddat_nomkd": ("feddat", {"mutual": False, "teacher": "dat"}),
        "feddat_wo_frozen": ("feddat", {"mutual": True, "teacher": "local"}),
        "feddat_wo_local": ("feddat", {"mutual": True, "teacher": "frozen"}),
        "adapter": ("vqa_adapter", {}), "adapter_local": ("vqa_adapter_local", {}),
        "lora": ("vqa_peft", {"peft": "lora", "local_only": False}),
        "prompt": ("vqa_peft", {"peft": "prompt", "local_only": False}),
        "bias": ("vqa_peft", {"peft": "bias", "local_only": False}),
        "full": ("vqa_peft", {"peft": "full", "local_only": False}),
        "full_lr": ("vqa_peft", {"peft": "full", "local_only": False})}   # no clf-L: BLIP has no answer head
CONTROLS = {"chance": "vqa_chance", "majority": "vqa_majority", "untrained": "vqa_untrained",
            "question_only": "question_only", "shuffled_image": "shuffled_image"}


def _parse(study, variant):
    rec = _load_recipe(_feddat.RECIPE)
    run, _, cfg, opts = parse_run_args(study.argv(variant, 0), defaults=rec.DEFAULTS, recipe_options=rec.VQABenchmark)
    return run, cfg, opts


@pytest.mark.parametrize("name", STUDIES)
def test_every_row_parses_into_its_method_and_options(name):
    """Each method row and each control of the study parses with the recipe's options (the options validate), into
    the method and options the row stands for; every row uses the split's data, the BLIP stand-in, the one lr, the
    answer pool per client and the head trained once per batch (full fine-tuning also at its own lr)."""
    study = load_study(name)
    split = name.split("_")[1]
    assert {v.name for v in study.variants} == set(ROWS) | set(CONTROLS)
    for v in study.variants:
        run, cfg, opts = _parse(study, v)
        lr = _feddat.FULL_LR if v.name == "full_lr" else _feddat.LR   # full fine-tuning's own validated lr
        assert opts.vqa_split == split and opts.backbone == "blip" and run.lr == float(lr)
        assert cfg.answer_pool == "client" and cfg.peft in ("adapter", "lora", "prompt", "bias", "full", "head")
        if v.name in CONTROLS:
            assert v.kind == CONTROLS[v.name] and run.method == "vqa_adapter"
            assert opts.image_ablation == {"question_only": "blank", "shuffled_image": "shuffle"}.get(v.name, "none")
            continue
        method, want = ROWS[v.name]
        assert v.kind == "run" and run.method == method, v.name
        assert {k: getattr(cfg, k) for k in want} == want, v.name
        assert opts.image_ablation == "none"
        if method == "feddat":
            assert cfg.head_loss == "shared"


def test_the_standin_head_control_follows_the_backbone(monkeypatch):
    """With a stand-in that carries its own answer head, the study adds that head's before-training control (which
    parses with --head_init pretrained) and the claim that FedDAT beats it; without one (the default), neither."""
    assert not any(v.name == "standin_head" for v in load_study("feddat_function").variants)
    monkeypatch.setattr(_feddat, "STANDIN_ANSWER_HEAD", True)
    study = _feddat.feddat_study("function", rounds=1, train=20, test=20)
    v = study.variant("standin_head")
    assert v.kind == "vqa_untrained" and _parse(study, v)[1].head_init == "pretrained"
    assert any(c.b == "standin_head" for c in study.claims)
