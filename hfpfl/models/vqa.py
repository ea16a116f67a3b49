"""The VQA foundation backbones: the tiny ViLT / BLIP stand-ins (pretrained centrally with their papers' objectives on
captioned images of the disjoint easy-vqa pool -- never on VQA answers -- and published to the local Hub cache on
first use), building the :class:`~hfpfl.models.vqa_model.VQAModel` of a
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
from ..training import TensorData, train_local
from .vqa_model import VQAModel

logger = logging.getLogger(__name__)


BACKBONES = {"vilt": "hfpfl/tiny-vilt-easyvqa-pool", "blip": "hfpfl/tiny-blip-easyvqa-pool"}
REAL_BACKBONES = {"vilt": "dandelin/vilt-b32-mlm", "blip": "Salesforce/blip-vqa-base"}
INFO_FILE = "hfpfl_pretrain.json"
#: recipe 3: pretrained on captions with the papers' objectives (ViLT ITM + MLM, BLIP ITC + ITM + LM), not on VQA;
#: recipe 4: tiny BLIP's vision tower initialised at std 0.02 (a config-built tower was constant over images)
PRETRAIN_CONFIG = {"recipe_version": 4, "hidden": 64, "layers": 3, "heads": 4, "image_size": 32, "epochs": 8,
                   "batch_size": 32, "lr": 3e-3, "weight_decay": 0.01, "seed": 0, "captions_per_image": 2,
                   "max_caption_tokens": 16, "mlm_prob": 0.15, "negative_prob": 0.5, "itc_temperature": 0.07,
                   "projection_dim": 32}


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
    """The local Hub repo of the tiny ViLT/BLIP foundation model, pretrained centrally on captioned images of the
    disjoint easy-vqa pool (pool images, pool styles, no client data, no VQA answer) and published with ``save_pretrained`` + a model card on first use.
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
    """Pretrain the whole tiny backbone on the caption pool (:func:`hfpfl.data.vqa.caption_pool`: pool images, pool
    styles, captions naming shape and colour; no VQA question or answer) with its paper's objectives
    (:mod:`hfpfl.models.vqa_pretrain`: ViLT ITM + MLM, BLIP ITC + ITM + LM) through the engine's one loop, and
    save what a client loads: ``ViltForMaskedLM`` (as ``dandelin/vilt-b32-mlm``; the VQA head is new at every client)
    or ``BlipForQuestionAnswering`` (vision encoder, text encoder, decoder; the pretraining heads are dropped)."""
    from transformers import ViltForMaskedLM  # why: transformers' model code on first use (as above)

    from ..data.vqa import caption_pool, easy_vqa_answers  # why: datasets on first use (as above)
    from .builders import build_vqa_model  # why: as above
    from .vqa_pretrain import BlipPretrainer, ViltPretrainer

    torch.manual_seed(cfg["seed"])
    t0 = time.perf_counter()
    tok = vqa_tokenizer(f"tiny-{kind}", save_dir=out_dir)
    answers = easy_vqa_answers()
    images, captions, attrs = caption_pool(cfg["image_size"], seed=cfg["seed"],
                                           captions_per_image=cfg["captions_per_image"])
    codes = {a: i for i, a in enumerate(sorted(set(attrs)))}
    enc = tok(captions, padding="max_length", truncation=True, max_length=cfg["max_caption_tokens"])
    cols = {"input_ids": torch.tensor(enc["input_ids"]), "attention_mask": torch.tensor(enc["attention_mask"]),
            "pixels": torch.from_numpy(images.transpose(0, 3, 1, 2).copy()),
            "attr": torch.tensor([codes[a] for a in attrs])}
    order = torch.randperm(len(captions), generator=torch.Generator().manual_seed(cfg["seed"]))
    n_val = len(order) // 10
    val, train = (TensorData.of(**{k: v[idx] for k, v in cols.items()}) for idx in (order[:n_val], order[n_val:]))
    gen = torch.Generator().manual_seed(cfg["seed"] + 1)
    backbone = build_vqa_model(f"tiny-{kind}", len(answers), image_size=cfg["image_size"], vocab_size=len(tok),
                               **_tiny_config(f"tiny-{kind}", cfg))
    if kind == "vilt":
        published = ViltForMaskedLM(backbone.config)
        model = ViltPretrainer(published, tok.all_special_ids, tok.mask_token_id, cfg["mlm_prob"],
                               cfg["negative_prob"], gen)
    else:
        published = backbone
        model = BlipPretrainer(published, backbone.config.text_config.bos_token_id, cfg["projection_dim"],
                               cfg["itc_temperature"], cfg["negative_prob"], gen)
    steps = cfg["epochs"] * math.ceil(len(train) / cfg["batch_size"])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup_linear(steps))
    res = train_local(model, train, opt, batch_size=cfg["batch_size"], epochs=cfg["epochs"],
                      generator=torch.Generator().manual_seed(cfg["seed"]), scheduler=sched,
                      loss_fn=lambda m, b: m(**b))
    model.eval()
    with torch.no_grad():
        held = {k: round(float(v), 4) for k, v in model.losses(**val.columns).items()}
    published.save_pretrained(out_dir)
    objectives = "ITM + MLM" if kind == "vilt" else "ITC + ITM + LM"
    metrics = {"objectives": objectives, "held_out": held, "train_loss": res["train_loss"], "steps": res["steps"],
               "num_pairs": len(train), "seconds": round(time.perf_counter() - t0, 1)}
    Path(out_dir, INFO_FILE).write_text(json.dumps({"config": cfg, "metrics": metrics}, indent=2))
    Path(out_dir, "README.md").write_text(model_card(kind, type(published).__name__, metrics))
    return metrics


def model_card(kind: str, cls_name: str, metrics: dict) -> str:
    """The stand-in's model card: what it is a stand-in for, its data and its objectives."""
    held = ", ".join(f"{k} {v}" for k, v in metrics["held_out"].items())
    if kind == "vilt":
        objectives = ("ViLT's pretraining objectives (Kim et al., ICML 2021, Sec. 3.2): image-text matching (a binary "
                      "head on the pooled output; half the captions swapped for the caption of another image with a "
                      "different shape or colour) and masked language modelling on the captions (15% of caption "
                      "tokens, at least one, replaced by [MASK]); no word-patch alignment. Saved as "
                      "`ViltForMaskedLM`, like `dandelin/vilt-b32-mlm`: there is no VQA head, a client's answer head "
                      "is new (random).")
    else:
        objectives = ("BLIP's pretraining objectives (Li et al., ICML 2022, Sec. 3.2): image-text contrastive loss on "
                      "the unimodal encoders' [CLS] projections (captions of the same shape and colour count as "
                      "positives, fixed temperature 0.07), image-text matching with the image-grounded text encoder "
                      "(negatives: captions of images with another shape or colour) and language modelling with the "
                      "image-grounded decoder (the caption after [DEC]). BLIP is the nearest HF architecture to "
                      "FedDAT's ALBEF (dual-stream encoders, fusion, answer decoder); ALBEF has MLM where BLIP has LM. "
                      "Saved as `BlipForQuestionAnswering` (vision encoder, text encoder, decoder); the ITC "
                      "projections and the ITM head are pretraining-only and dropped.")
    return (f"---\nlibrary_name: transformers\ntags: [hfpfl, vqa, stand-in]\n---\n# {BACKBONES[kind]}\n\n"
            f"A stand-in for `{REAL_BACKBONES[kind]}` where the Hub is out of reach: a tiny `{cls_name}` pretrained by "
            f"`hfpfl.models.vqa.pretrain_vqa_backbone` on image-caption pairs of the easy-vqa pretraining pool "
            f"({metrics['num_pairs']} pairs: pool images only, held by no client, in the pool styles plain and "
            f"jitter; each caption names the image's shape and colour as easy-vqa records them, e.g. 'there is a red "
            f"circle in the image'). No VQA question and no VQA answer was used: it relates to the clients' VQA task "
            f"as a vision-language pretraining relates to VQA fine-tuning. No client image and no client style "
            f"(textures, photos, palette, blur, noise) was seen.\n\n{objectives}\n\n"
            f"{metrics['steps']} AdamW steps, {metrics['seconds']} s on CPU; held-out pairs: {held}.\n")


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
