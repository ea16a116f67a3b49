"""Frozen VQA foundation models with bottleneck adapters (FedDAT, spec section 2) and the PEFT baselines.

:class:`VQAModel` wraps a ``ViltForQuestionAnswering`` or a ``BlipForQuestionAnswering`` (the nearest HF
architecture to ALBEF: a dual-stream image/text encoder with an answer decoder; ALBEF itself is not in
transformers) and returns answer logits for one batch dict (``input_ids``, ``attention_mask``, ``pixels`` uint8).

* ViLT: logits = the classifier head on the pooled output (``Linear -> LayerNorm -> GELU -> Linear`` as in the authors' code);
  the head is client-specific (private) in every method.
* BLIP: logits = the answer decoder's first-step scores of the answers (each answer is one token): ALBEF's ranking
  of a client's answer list, so BLIP has no trainable head.

Adapters (Houlsby-type, FedDAT Eq. 1): ``h' = h + ReLU(h W_down) W_up``, reduction factor 16, biases, N(0, 0.02)
init as in the authors' code (:class:`BottleneckAdapter`), one per transformer block after the FFN: ViLT after ``ViltOutput``
(dense + residual, the authors' code); BLIP after each vision block (post-residual, pre-LN like ViLT) and after ``BlipTextOutput``
of every text-encoder and text-decoder layer (a choice the paper leaves open; docs/methods/feddat.md). They are attached with **public torch forward hooks**
on the backbone's modules (no patching of peft or transformers, the backbone's state-dict keys are unchanged).

Every block holds one :class:`DualAdapter`: the shared adapter ``A_s`` (``shared``), the local adapter ``A_c``
(``local``) and the frozen copy ``Â_s`` as *non-persistent buffers* (never in a state dict, never trained, re-copied
from ``A_s`` by :meth:`VQAModel.copy_shared_to_frozen`). ``VQAModel.mode`` picks the path:

=========  ==================================================  ==========================================
mode       adapter delta                                        used by
=========  ==================================================  ==========================================
shared     A_s(h)                                               student, inference, Adapter baselines
dat        1/2 Â_s(h) + 1/2 A_c(h)  (FedDAT Eq. 4)                the dual-adapter teacher
local      A_c(h)                                               Table 4 inference row "A_c"; "w/o Â_s"
frozen     Â_s(h)                                               "w/o A_c" teacher ablation
none       0                                                    LoRA / prompt / bias / full / head baselines
=========  ==================================================  ==========================================

PEFT baselines (the paper's baselines, dissertation ch. 3): ``lora`` (public ``peft.inject_adapter_in_model`` with ``LoraConfig`` on
``query``/``value``), ``prompt`` (5 text prompt tokens after [CLS] through an MLP reparameterisation, the authors' code; ViLT
only, text side only), ``bias`` (every backbone bias), ``full`` (every backbone weight), ``head`` (the head only).
"""
from __future__ import annotations

import json
import logging
import math
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from transformers.modeling_outputs import SequenceClassifierOutput

logger = logging.getLogger(__name__)

PEFT_KINDS = ("adapter", "lora", "prompt", "bias", "full", "head")
MODES = ("shared", "dat", "local", "frozen", "none")
REDUCTION = 16


def adapter_param_count(num_layers: int, d: int, r: int) -> int:
    """Spec 2.3: |A_s| = L (2 d r + d + r) (894,528 for ViLT-B: L=12, d=768, r=48)."""
    return num_layers * (2 * d * r + d + r)


class BottleneckAdapter(nn.Module):
    """``delta(h) = ReLU(h W_down + b_down) W_up + b_up`` (the residual is added by the caller)."""

    def __init__(self, d: int, r: int, init: str = "normal"):
        super().__init__()
        self.down = nn.Linear(d, r)
        self.up = nn.Linear(r, d)
        for lin in (self.down, self.up):
            nn.init.normal_(lin.weight, std=0.02)     # the authors' code: N(0, 0.02), zero biases; W_up NOT zero-initialised
            nn.init.zeros_(lin.bias)
        if init == "zero":                            # Houlsby near-identity (an option: the paper does not say)
            nn.init.zeros_(self.up.weight)

    def forward(self, h):
        return self.up(torch.relu(self.down(h)))


class DualAdapter(nn.Module):
    """A_s, A_c and the frozen copy Â_s of one block; see the module docstring."""

    def __init__(self, d: int, r: int, init: str = "normal"):
        super().__init__()
        self.shared = BottleneckAdapter(d, r, init)
        self.local = BottleneckAdapter(d, r, init)
        for n, p in self.shared.named_parameters():
            self.register_buffer("frozen_" + n.replace(".", "_"), p.detach().clone(), persistent=False)

    def copy_shared_to_frozen(self) -> None:
        with torch.no_grad():
            for n, p in self.shared.named_parameters():
                getattr(self, "frozen_" + n.replace(".", "_")).copy_(p)

    def frozen(self, h):
        h = torch.relu(nn.functional.linear(h, self.frozen_down_weight, self.frozen_down_bias))
        return nn.functional.linear(h, self.frozen_up_weight, self.frozen_up_bias)

    def delta(self, h, mode: str):
        if mode == "shared":
            return self.shared(h)
        if mode == "dat":
            return 0.5 * self.frozen(h) + 0.5 * self.local(h)
        if mode == "local":
            return self.local(h)
        if mode == "frozen":
            return self.frozen(h)
        raise ValueError(f"unknown adapter mode {mode!r}; expected one of {MODES}")


class TextPrompt(nn.Module):
    """the authors' code's reparameterised prompt: ``Embedding(n, d) -> Linear(d, d/4) -> Tanh -> Linear(d/4, d)``."""

    def __init__(self, d: int, n: int = 5):
        super().__init__()
        self.n = n
        self.embedding = nn.Embedding(n, d)
        self.mlp = nn.Sequential(nn.Linear(d, max(1, d // 4)), nn.Tanh(), nn.Linear(max(1, d // 4), d))

    def forward(self, batch_size: int):
        return self.mlp(self.embedding.weight)[None].expand(batch_size, -1, -1)


def _adapter_sites(backbone) -> list[tuple[nn.Module, int]]:
    """(module whose output gets the adapter, hidden size) for every transformer block."""
    kind = backbone.config.model_type
    if kind == "vilt":
        return [(layer.output, backbone.config.hidden_size) for layer in backbone.vilt.encoder.layer]
    if kind == "blip":
        sites = [(layer, backbone.config.vision_config.hidden_size) for layer in backbone.vision_model.encoder.layers]
        d = backbone.config.text_config.hidden_size
        sites += [(layer.output, d) for layer in backbone.text_encoder.encoder.layer]
        sites += [(layer.output, d) for layer in backbone.text_decoder.bert.encoder.layer]
        return sites
    raise ValueError(f"VQAModel supports ViLT and BLIP backbones, got model_type {kind!r}")


class VQAModel(nn.Module):
    """A frozen VQA backbone + adapters / a PEFT baseline + (ViLT) a head; ``forward(**batch).logits``."""

    def __init__(self, backbone, answer_token_ids: list[int] | None = None, peft: str = "adapter",
                 reduction: int = REDUCTION, lora_r: int = 4, adapter_init: str = "normal", head_init: str = "random"):
        super().__init__()
        if peft not in PEFT_KINDS:
            raise ValueError(f"--peft must be one of {', '.join(PEFT_KINDS)}, got {peft!r}")
        self.backbone = backbone
        self.kind = backbone.config.model_type
        self.peft = peft
        self.mode = "shared" if peft == "adapter" else "none"
        for p in backbone.parameters():
            p.requires_grad_(False)
        if self.kind == "blip":
            if not answer_token_ids:
                raise ValueError("a BLIP VQAModel needs answer_token_ids (one decoder token per answer)")
            self.register_buffer("answer_ids", torch.tensor(answer_token_ids, dtype=torch.long), persistent=False)
            self.bos_id = backbone.config.text_config.bos_token_id
        elif head_init == "random":
            gen_state = torch.random.get_rng_state()
            for m in backbone.classifier.modules():   # head[k] = init_head(|A^k|), the paper's Algorithm 1
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, std=0.02)
                    nn.init.zeros_(m.bias)
                elif isinstance(m, nn.LayerNorm):
                    m.reset_parameters()
            torch.random.set_rng_state(gen_state)
        self.adapters = nn.ModuleList()
        self.prompt = None
        if peft == "adapter":
            for site, d in _adapter_sites(backbone):
                slot = DualAdapter(d, max(1, d // reduction), adapter_init)
                self.adapters.append(slot)
                site.register_forward_hook(self._hook(slot))
        elif peft == "lora":
            from peft import LoraConfig, inject_adapter_in_model

            inject_adapter_in_model(LoraConfig(r=lora_r, lora_alpha=lora_r, target_modules=["query", "value"],
                                               lora_dropout=0.0), backbone)
        elif peft == "prompt":
            if self.kind != "vilt":
                raise ValueError("--peft prompt is implemented for ViLT only (text-side prompts)")
            self.prompt = TextPrompt(backbone.config.hidden_size)
        elif peft == "bias":
            for n, p in backbone.named_parameters():
                if n.endswith(".bias"):
                    p.requires_grad_(True)
        elif peft == "full":
            for p in backbone.parameters():
                p.requires_grad_(True)
        if self.kind == "vilt":
            for p in backbone.classifier.parameters():
                p.requires_grad_(True)
        for slot in self.adapters:              # the Adapter baseline trains A_s only; FedDAT re-enables A_c
            slot.local.requires_grad_(False)

    def _hook(self, slot: DualAdapter):
        def hook(module, args, output):
            if self.mode == "none":
                return output
            if isinstance(output, tuple):
                return (output[0] + slot.delta(output[0], self.mode),) + output[1:]
            return output + slot.delta(output, self.mode)
        return hook

    def copy_shared_to_frozen(self) -> None:
        for slot in self.adapters:
            slot.copy_shared_to_frozen()

    def shared_keys(self) -> list[str]:
        return [k for k in self.state_dict() if k.startswith("adapters.") and ".shared." in k]

    def local_keys(self) -> list[str]:
        return [k for k in self.state_dict() if k.startswith("adapters.") and ".local." in k]

    def head_keys(self) -> list[str]:
        return [k for k in self.state_dict() if k.startswith("backbone.classifier.")]

    def forward(self, input_ids, attention_mask, pixels, answer=None, **_):
        pixel_values = pixels.float() / 127.5 - 1.0          # ViLT/BLIP tiny: [-1, 1] like their processors' 0.5/0.5
        if self.kind == "vilt":
            vilt = self.backbone.vilt
            kw = dict(input_ids=input_ids, attention_mask=attention_mask)
            if self.prompt is not None:
                emb = vilt.embeddings.text_embeddings.word_embeddings(input_ids)
                p = self.prompt(len(input_ids)).to(emb.dtype)
                kw = dict(inputs_embeds=torch.cat([emb[:, :1], p, emb[:, 1:]], 1),
                          attention_mask=torch.cat([attention_mask[:, :1], attention_mask.new_ones(p.shape[:2]),
                                                    attention_mask[:, 1:]], 1))
            pooled = vilt(pixel_values=pixel_values, **kw).pooler_output
            logits = self.backbone.classifier(pooled)
        else:
            bb = self.backbone
            image_embeds = bb.vision_model(pixel_values=pixel_values).last_hidden_state
            image_att = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=image_embeds.device)
            q = bb.text_encoder(input_ids=input_ids, attention_mask=attention_mask, encoder_hidden_states=image_embeds,
                                encoder_attention_mask=image_att).last_hidden_state
            bos = torch.full((len(input_ids), 1), self.bos_id, dtype=torch.long, device=input_ids.device)
            out = bb.text_decoder(input_ids=bos, encoder_hidden_states=q, encoder_attention_mask=attention_mask)
            logits = out.logits[:, 0, self.answer_ids]
        loss = nn.functional.cross_entropy(logits, answer) if answer is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits)


# ------------------------------------------------------------------------------------------- foundation models
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
    from accelerate import PartialState

    from .. import hub

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
    from ..data.vqa import easy_vqa_answers, pretraining_pool
    from ..training import TensorData, evaluate, train_local
    from .builders import build_vqa_model

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
    from .builders import build_vqa_model, build_vqa_tokenizer

    from .builders import TINY_VQA_MODELS, tiny_vqa_vocab

    name = BACKBONES.get(model_name, model_name)
    if name in TINY_VQA_MODELS:  # random init (tests, or --random_backbone_ok): the data's tiny vocabulary
        from ..data.vqa import vqa_words

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
        from .. import hub
        if name in BACKBONES.values():
            from transformers import BertTokenizer
            tok = BertTokenizer.from_pretrained(hub.require_cached(name, "model", "main"))
        else:
            tok = build_vqa_tokenizer(name)
            tok = getattr(tok, "tokenizer", tok)
        ids = answer_token_ids(tok, answers)
    return VQAModel(backbone, ids, peft=peft, **kw)


from ..training import Metric  # noqa: E402  (below the model code: training imports nothing from here)


class AnswerAccuracy(Metric):
    """Exact-match answer accuracy and cross-entropy over the answer list; targets in ``batch["answer"]``."""

    def update(self, logits, batch):
        y = batch["answer"]
        self.loss_sum += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
        self.correct += float((logits.argmax(-1) == y).sum())
        self.n += len(y)


def kd_loss(student_logits, teacher_logits, temperature: float = 3.0):
    """the authors' code's KD: ``T^2 KL(softmax(teacher/T) || softmax(student/T))``, batchmean, teacher detached."""
    t = temperature
    return t * t * nn.functional.kl_div(nn.functional.log_softmax(student_logits / t, -1),
                                        nn.functional.softmax(teacher_logits.detach() / t, -1),
                                        reduction="batchmean")


def kd_ramp(t: int, total: int) -> float:
    """Spec App. B.2: alpha = beta = exp(-5 (1 - t / T0)), clipped at 1."""
    return math.exp(-5.0 * (1.0 - min(t, total) / max(total, 1)))


def vqa_tokenizer(model_name: str = "tiny-vilt", save_dir=None):
    """The tiny VQA models' tokenizer over easy-vqa's words (questions and answers): what the benchmark's questions
    are tokenized with (``vqa_benchmark(tokenizer=...)``)."""
    from ..data.vqa import vqa_words
    from .builders import build_vqa_tokenizer

    return build_vqa_tokenizer(model_name if model_name in ("tiny-vilt", "tiny-blip") else "tiny-vilt",
                               extra_words=vqa_words(), save_dir=save_dir)
