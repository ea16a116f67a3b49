"""The VQA model: a frozen VQA foundation model with bottleneck adapters (FedDAT, spec section 2) or a PEFT
baseline, plus its answer metric and distillation loss.

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
``query``/``value``), ``prompt`` (5 text prompt tokens after [CLS] through an MLP reparameterisation, the authors' code; text side
only: ViLT's text embeddings, BLIP's question encoder), ``bias`` (every backbone bias), ``full`` (every backbone weight), ``head`` (the head only).

The foundation backbones themselves (the tiny stand-ins, their pretraining, building a model by name) live in
:mod:`hfpfl.models.vqa`.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from transformers.modeling_outputs import SequenceClassifierOutput

from ..training import Metric

PEFT_KINDS = ("adapter", "lora", "prompt", "bias", "full", "head")
MODES = ("shared", "dat", "local", "frozen", "none")
REDUCTION = 16
#: the logit of an answer outside the client's pool: softmax gives it exactly 0 in float32 (also after KD's 1/T),
#: finite so that KL and CE stay finite, and within float16/bfloat16 range
OUT_OF_POOL = -1e4


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
        self.answer_pool = None                   # bool over the answers: a client's own pool (set_answer_pool)
        if peft == "adapter":
            for site, d in _adapter_sites(backbone):
                slot = DualAdapter(d, max(1, d // reduction), adapter_init)
                self.adapters.append(slot)
                site.register_forward_hook(self._hook(slot))
        elif peft == "lora":
            from peft import LoraConfig, inject_adapter_in_model  # why: peft on first use (tests/cli/test_footprint.py)

            inject_adapter_in_model(LoraConfig(r=lora_r, lora_alpha=lora_r, target_modules=["query", "value"],
                                               lora_dropout=0.0), backbone)
        elif peft == "prompt":
            text = backbone.config if self.kind == "vilt" else backbone.config.text_config
            self.prompt = TextPrompt(text.hidden_size)
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

    def set_answer_pool(self, pool) -> None:
        """Score only the answers where ``pool`` (bool, one per answer) is true, or every answer (``None``): a
        client's C^k-way classification over its own answer pool A^k (FedDAT, "Problem Statement"; the paper's
        client-specific heads / answer lists, "Implementation Details"). The logits of the other answers are
        ``OUT_OF_POOL``: their probability is 0 in the CE, the KD and the argmax, and the head rows of those answers
        get no gradient, so the head acts as a C^k-way head."""
        self.answer_pool = None if pool is None else torch.as_tensor(pool, dtype=torch.bool)

    def shared_keys(self) -> list[str]:
        return [k for k in self.state_dict() if k.startswith("adapters.") and ".shared." in k]

    def local_keys(self) -> list[str]:
        return [k for k in self.state_dict() if k.startswith("adapters.") and ".local." in k]

    def head_keys(self) -> list[str]:
        return [k for k in self.state_dict() if k.startswith("backbone.classifier.")]

    def _text_inputs(self, word_embeddings, input_ids, attention_mask) -> dict:
        """The text encoder's inputs: the question's ids, or with ``--peft prompt`` its word embeddings with the
        prompt's tokens after the first ([CLS]) and the mask extended over them (the authors' code, ViLT; the same
        text-side prompt for BLIP's question encoder)."""
        if self.prompt is None:
            return dict(input_ids=input_ids, attention_mask=attention_mask)
        emb = word_embeddings(input_ids)
        p = self.prompt(len(input_ids)).to(emb.dtype)
        return dict(inputs_embeds=torch.cat([emb[:, :1], p, emb[:, 1:]], 1),
                    attention_mask=torch.cat([attention_mask[:, :1], attention_mask.new_ones(p.shape[:2]),
                                              attention_mask[:, 1:]], 1))

    def forward(self, input_ids, attention_mask, pixels, answer=None, **_):
        pixel_values = pixels.float() / 127.5 - 1.0          # ViLT/BLIP tiny: [-1, 1] like their processors' 0.5/0.5
        if self.kind == "vilt":
            vilt = self.backbone.vilt
            kw = self._text_inputs(vilt.embeddings.text_embeddings.word_embeddings, input_ids, attention_mask)
            pooled = vilt(pixel_values=pixel_values, **kw).pooler_output
            logits = self.backbone.classifier(pooled)
        else:
            bb = self.backbone
            image_embeds = bb.vision_model(pixel_values=pixel_values).last_hidden_state
            image_att = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=image_embeds.device)
            kw = self._text_inputs(bb.text_encoder.embeddings.word_embeddings, input_ids, attention_mask)
            q = bb.text_encoder(**kw, encoder_hidden_states=image_embeds, encoder_attention_mask=image_att)
            bos = torch.full((len(input_ids), 1), self.bos_id, dtype=torch.long, device=input_ids.device)
            # the decoder reads every question position the encoder produced, the prompt's included
            out = bb.text_decoder(input_ids=bos, encoder_hidden_states=q.last_hidden_state,
                                  encoder_attention_mask=kw["attention_mask"])
            logits = out.logits[:, 0, self.answer_ids]
        if self.answer_pool is not None:
            logits = logits.masked_fill(~self.answer_pool.to(logits.device), OUT_OF_POOL)
        loss = nn.functional.cross_entropy(logits, answer) if answer is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits)



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
