"""The VQA foundation backbones: the tiny ViLT / BLIP stand-ins (pretrained centrally on the disjoint easy-vqa
pool and published to the local Hub cache on first use), building the :class:`~hfpfl.models.vqa_model.VQAModel` of a
backbone by name (:func:`build_vqa_peft_model`) and the tiny models' tokenizer. The model itself (adapters, modes,
PEFT baselines) is :mod:`hfpfl.models.vqa_model`."""
from __future__ import annotations

import json
import logging
import math
import tempfile
import time
from pathlib import Path

import torch

from .. import hub
from ..training import TensorData, evaluate, train_local
from .vqa_model import AnswerAccuracy, VQAModel

logger = logging.getLogger(__name__)


BACKBONES = {"vilt": "hfpfl/tiny-vilt-easyvqa-pool", "blip": "hfpfl/tiny-blip-easyvqa-pool"}
REAL_BACKBONES = {"vilt": "dandelin/vilt-b32-mlm", "blip": "Salesforce/blip-vqa-base"}
INFO_FILE = "hfpfl_pretrain.json"
PRETRAIN_CONFIG = {"recipe_version": 2, "hidden": 64, "layers": 3, "heads": 4, "image_size": 32, "epochs": 4,
                   "batch_size": 64, "lr": 3e-3, "weight_decay": 0.01, "seed": 0, "max_questions": 9000}


def _tiny_config(name: str, cfg: dict) -> dict:
    h, n, heads = cfg["hidden"], cfg["layers"], cfg["heads"]
    if name == "tiny-vilt":
        return dict(hidden_size=h, num_hidden_layers=n, num_attention_heads=heads, intermediate_size=4 * h)
    common = dict(hidden_size=h, num_hidden_layers=n, num_attention_heads=heads, intermediate_size=4 * h)
    return dict(text_config={**common, "encoder_hidden_size": h}, vision_config=common)


def answer_token_ids(tokenizer, answers: list[str]) -> list[int]:
    ids = [tokenizer.convert_tokens_to_ids(a) for a in answers]
    if tokenizer.unk_token_id in ids:
        raise ValueError(f"every answer must be one token of the vocabulary; missing: "
                         f"{[a for a, i in zip(answers, ids) if i == tokenizer.unk_token_id]}")
    return ids


_IDENTITY = ("recipe_version", "model", "hidden", "layers", "heads", "image_size")


def ensure_vqa_backbone(kind: str, cache_dir: str | None = None, force: bool = False, reuse_other_budget: bool = False,
                        **overrides) -> str:
    """The local Hub repo of the tiny ViLT/BLIP foundation model, pretrained centrally on the disjoint easy-vqa pool
    (pool images, pool styles, no client data) and published with ``save_pretrained`` + a model card on first use.
    ``reuse_other_budget``: a cached repo of the same architecture and pool trained with another budget (epochs,
    steps: e.g. a quick one in a test cache) is reused as is."""
    from accelerate import PartialState  # why: recipes read BACKBONES while parsing options; loads on first use

    repo = BACKBONES[kind]
    cfg = {**PRETRAIN_CONFIG, **overrides, "model": f"tiny-{kind}"}
    with PartialState().main_process_first():
        try:
            snap = hub.require_cached(repo, "model", "main", cache_dir)
            info = json.loads((Path(snap) / INFO_FILE).read_text())
            same_identity = all(info["config"].get(k) == cfg.get(k) for k in _IDENTITY)
            if not force and (info["config"] == cfg or (reuse_other_budget and same_identity)):
                return repo
        except (OSError, KeyError, ValueError):
            pass
        if not PartialState().is_main_process:
            return repo
        with tempfile.TemporaryDirectory() as tmp:
            metrics = pretrain_vqa_backbone(kind, cfg, tmp)
            hub.push_folder_to_cache(tmp, repo, "main", cache_dir=cache_dir)
        logger.info("published %s: %s", repo, metrics)
    return repo


def pretrain_vqa_backbone(kind: str, cfg: dict, out_dir: str) -> dict:
    """Train the whole tiny backbone (and its answer head/decoder) on the pool with the engine's one loop."""
    from ..data.vqa import easy_vqa_answers, pretraining_pool  # why: datasets on first use (as above)
    from .builders import build_vqa_model  # why: transformers' model code, on first use (as above)

    torch.manual_seed(cfg["seed"])
    t0 = time.perf_counter()
    tok = vqa_tokenizer(f"tiny-{kind}", save_dir=out_dir)
    answers = easy_vqa_answers()
    pool = pretraining_pool(tok, cfg["image_size"], cfg["max_questions"], seed=cfg["seed"])
    split = pool.train_test_split(test_size=0.1, seed=cfg["seed"])
    backbone = build_vqa_model(f"tiny-{kind}", len(answers), image_size=cfg["image_size"], vocab_size=len(tok),
                               **_tiny_config(f"tiny-{kind}", cfg))
    ids = answer_token_ids(tok, answers) if kind == "blip" else None
    model = VQAModel(backbone, ids, peft="full", head_init="pretrained")
    data = TensorData.from_dataset(split["train"])
    steps = cfg["epochs"] * math.ceil(len(data) / cfg["batch_size"])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg["lr"],
                            weight_decay=cfg["weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup_linear(steps))
    res = train_local(model, data, opt, batch_size=cfg["batch_size"], epochs=cfg["epochs"],
                      generator=torch.Generator().manual_seed(cfg["seed"]), scheduler=sched,
                      loss_fn=lambda m, b: m(**b).loss)
    val = evaluate(model, TensorData.from_dataset(split["test"]), metric=AnswerAccuracy())
    backbone.config.id2label = dict(enumerate(answers))
    backbone.config.label2id = {a: i for i, a in enumerate(answers)}
    backbone.save_pretrained(out_dir)
    metrics = {"val_accuracy": val["accuracy"], "train_loss": res["train_loss"], "steps": res["steps"],
               "num_train": len(data), "seconds": round(time.perf_counter() - t0, 1)}
    Path(out_dir, INFO_FILE).write_text(json.dumps({"config": cfg, "metrics": metrics}, indent=2))
    Path(out_dir, "README.md").write_text(
        f"---\nlibrary_name: transformers\ntags: [hfpfl, vqa, stand-in]\n---\n# {BACKBONES[kind]}\n\n"
        f"A stand-in for `{REAL_BACKBONES[kind]}` where the Hub is out of reach: a tiny "
        f"`{type(backbone).__name__}` pretrained by `hfpfl.models.vqa.pretrain_vqa_backbone` on the disjoint "
        f"easy-vqa pretraining pool ({len(data)} questions on pool images only, pool styles plain/jitter; no client "
        f"image and no client style: textures, photos, palette, blur and noise are unseen). "
        f"{'BLIP is the nearest HF architecture to ALBEF (dual-stream encoder + answer decoder). ' if kind == 'blip' else ''}"
        f"Held-out pool accuracy {val['accuracy']:.3f}; {res['steps']} AdamW steps, {metrics['seconds']} s.\n")
    return metrics


def _warmup_linear(total: int, warmup: float = 0.1):
    """LR factor: linear warm-up over the first 10% of ``total`` steps, then linear decay to 0 (the paper's schedule, dissertation ch. 3 appendix)."""
    w = max(1, int(round(warmup * total)))

    def f(step):
        if step < w:
            return (step + 1) / w
        return max(0.0, (total - step) / max(1, total - w))
    return f


def build_vqa_peft_model(model_name: str, answers: list[str], peft: str = "adapter", image_size: int = 32, **kw):
    """The VQAModel on ``model_name``: ``vilt``/``blip`` (the local stand-ins, pretrained on first use), a local Hub
    repo id, or a real checkpoint id (``dandelin/vilt-b32-mlm``, ``Salesforce/blip-vqa-base``; offline and
    uncached: :class:`hfpfl.hub.OfflineModelError` at once, with the fix)."""
    # why: transformers' model code on first use (recipes read BACKBONES while parsing options)
    from .builders import TINY_VQA_MODELS, build_vqa_model, build_vqa_tokenizer, tiny_vqa_vocab

    name = BACKBONES.get(model_name, model_name)
    if name in TINY_VQA_MODELS:  # random init (tests, or --random_backbone_ok): the data's tiny vocabulary
        from ..data.vqa import vqa_words  # why: as above

        vocab = tiny_vqa_vocab(vqa_words())
        backbone = build_vqa_model(name, len(answers), image_size=image_size, vocab_size=len(vocab))
        ids = [vocab.index(a) for a in answers] if name == "tiny-blip" else None
        return VQAModel(backbone, ids, peft=peft, **kw)
    if "/" not in name and not Path(name).exists():
        raise ValueError(f"--model {model_name!r}: a VQA backbone is vilt | blip (local stand-ins), tiny-vilt | "
                         f"tiny-blip (random init), a Hub id ({', '.join(REAL_BACKBONES.values())}) or a local folder")
    if name in BACKBONES.values():
        ensure_vqa_backbone(next(k for k, v in BACKBONES.items() if v == name), reuse_other_budget=True)
    backbone = build_vqa_model(name, len(answers))
    ids = None
    if backbone.config.model_type == "blip":
        if name in BACKBONES.values():
            from transformers import BertTokenizer  # why: as above
            tok = BertTokenizer.from_pretrained(hub.require_cached(name, "model", "main"))
        else:
            tok = build_vqa_tokenizer(name)
            tok = getattr(tok, "tokenizer", tok)
        ids = answer_token_ids(tok, answers)
    return VQAModel(backbone, ids, peft=peft, **kw)


def vqa_tokenizer(model_name: str = "tiny-vilt", save_dir=None):
    """The tiny VQA models' tokenizer over easy-vqa's words (questions and answers): what the benchmark's questions
    are tokenized with (``vqa_benchmark(tokenizer=...)``)."""
    from ..data.vqa import vqa_words  # why: as in build_vqa_peft_model
    from .builders import build_vqa_tokenizer

    return build_vqa_tokenizer(model_name if model_name in ("tiny-vilt", "tiny-blip") else "tiny-vilt",
                               extra_words=vqa_words(), save_dir=save_dir)
