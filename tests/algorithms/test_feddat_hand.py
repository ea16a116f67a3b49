"""FedDAT pinned with numbers written out by hand (FedDAT paper = dissertation ch. 3: Eq. 4 the dual-adapter teacher,
Eq. 5-7 mutual KD, Algorithm 1, "Implementation Details"; App. B.2): the two client losses on a two-feature model
with known adapters and head, for FedDAT and each Table 4 ablation; the head's one step per batch; each client's
answer pool; the shared adapter changing ViLT's and BLIP's predictions; BLIP's image path."""
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn
import test_feddat
from test_feddat import _client_losses, batch_of

from hfpfl.algorithms.feddat import VQAPeft
from hfpfl.models.vqa import build_vqa_peft_model
from hfpfl.models.vqa_model import OUT_OF_POOL, DualAdapter

sim_for, vqa_fed = test_feddat.sim_for, test_feddat.vqa_fed   # the FedDAT tests' fixtures


# ------------------------------------------------------------------------------------------------ the hand model
class HandModel(nn.Module):
    """logits = W (h + delta_mode(h)) on a batch column ``h`` of two features, one :class:`DualAdapter` (d = 2,
    r = 1) and a 3-answer head W = [[1, 0], [0, 1], [0, 0]], all weights set by hand:

    * A_s:  down [1, 0], up [1, 0]^T   -> A_s(h) = (relu(h1), 0)
    * Â_s:  down [1, 0], up [0, 1]^T   -> Â_s(h) = (0, relu(h1))   (the frozen copy differs from A_s, as after a step)
    * A_c:  down [0, 1], up [1, 0]^T   -> A_c(h) = (relu(h2), 0)

    At h = (1, 2): z_s = (2, 2, 0); z_DAT = h + 1/2 Â_s + 1/2 A_c = (2, 2.5, 0); z_{A_c} = (3, 2, 0);
    z_{Â_s} = (1, 3, 0)."""

    def __init__(self):
        super().__init__()
        self.slot = DualAdapter(2, 1)
        self.head = nn.Linear(2, 3, bias=False)
        self.mode = "shared"
        with torch.no_grad():
            for p in self.parameters():
                p.zero_()
            self.slot.shared.down.weight.copy_(torch.tensor([[1.0, 0.0]]))
            self.slot.shared.up.weight.copy_(torch.tensor([[1.0], [0.0]]))
            self.slot.local.down.weight.copy_(torch.tensor([[0.0, 1.0]]))
            self.slot.local.up.weight.copy_(torch.tensor([[1.0], [0.0]]))
            self.slot.frozen_down_weight.copy_(torch.tensor([[1.0, 0.0]]))
            self.slot.frozen_down_bias.zero_()
            self.slot.frozen_up_weight.copy_(torch.tensor([[0.0], [1.0]]))
            self.slot.frozen_up_bias.zero_()
            self.head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))

    def forward(self, h, **_):
        return SimpleNamespace(logits=self.head(h + self.slot.delta(h, self.mode)))


HAND_LOGITS = {"shared": (2.0, 2.0, 0.0), "dat": (2.0, 2.5, 0.0), "local": (3.0, 2.0, 0.0), "frozen": (1.0, 3.0, 0.0)}
HAND_BATCH = {"h": torch.tensor([[1.0, 2.0]]), "answer": torch.tensor([0])}


def _softmax(z, T=1.0):
    e = [math.exp(v / T) for v in z]
    return [v / sum(e) for v in e]


def _ce(z, y):
    return -math.log(_softmax(z)[y])


def _kd(student, teacher, T=3.0):
    """T^2 KL(softmax(teacher / T) || softmax(student / T)) of one example, written out."""
    p, q = _softmax(teacher, T), _softmax(student, T)
    return T * T * sum(a * math.log(a / b) for a, b in zip(p, q))


def test_hand_model_paths_are_the_written_out_logits():
    """The hand model's four adapter paths give the logits its docstring works out (Eq. 4 for DAT)."""
    m = HandModel()
    for mode, z in HAND_LOGITS.items():
        m.mode = mode
        assert m(**HAND_BATCH).logits.tolist() == [list(z)], mode


@pytest.mark.parametrize("mutual, teacher, T", [(True, "dat", 3.0), (False, "dat", 3.0), (True, "local", 3.0),
                                                (True, "frozen", 3.0), (True, "dat", 2.0)])
def test_client_losses_on_known_adapters_are_the_papers_equations(sim_for, mutual, teacher, T):
    """FedDAT's two client losses (the closures its client update hands to the training loop) on the hand model,
    ``--kd_schedule constant`` (alpha = beta = 1 with the authors' code's 1/2), T = 3 (the default) or 2, answer 0:

    * L^s   = 1/2 (CE(z_s, y) + T^2 KL(p_teacher || p_s))           (Eq. 6-7, DAT -> A_s)
    * L^DAT = 1/2 (CE(z_teacher, y) + T^2 KL(p_s || p_teacher))     (Eq. 6-7, A_s -> DAT; 0 for "w/o MKD")

    with teacher = DAT (FedDAT), A_c ("w/o Â_s") or Â_s ("w/o A_c": frozen, so there is no L^DAT stage), every
    number from the written-out logits. Dropping either KD direction, or scoring the student as its own teacher,
    moves a loss by >= 0.01."""
    sim = sim_for("feddat", kd_schedule="constant", mutual=mutual, teacher=teacher, temperature=T)
    _, seen = _client_losses(sim)
    assert len(seen["fns"]) == (1 if teacher == "frozen" else 2)
    loss_s, loss_dat = (seen["fns"] + [None])[:2]
    m = HandModel()
    z_s, z_t = HAND_LOGITS["shared"], HAND_LOGITS[teacher]
    want_s = 0.5 * (_ce(z_s, 0) + _kd(z_s, z_t, T))
    want_dat = 0.5 * (_ce(z_t, 0) + (_kd(z_t, z_s, T) if mutual else 0.0))
    assert float(loss_s(m, HAND_BATCH)) == pytest.approx(want_s, rel=1e-5)
    if loss_dat is not None:
        assert float(loss_dat(m, HAND_BATCH)) == pytest.approx(want_dat, rel=1e-5)
    assert m.mode == "shared"                                           # left on the inference path
    assert 0.5 * _kd(z_s, z_t, T) > 0.01 and 0.5 * _kd(z_t, z_s, T) > 0.01   # each KD term is visible


def test_client_losses_on_known_adapters_with_the_ramp(sim_for):
    """``--kd_schedule ramp`` (App. B.2): no 1/2, alpha = beta = exp(-5 (1 - t / T0)); client 1: 2 steps per round,
    R = 2, round 2, first step: t = 2, T0 = 4, alpha = exp(-2.5); the second loss of the step uses the same beta."""
    sim = sim_for("feddat", rounds=2)
    _, seen = _client_losses(sim, round_idx=2)
    loss_s, loss_dat = seen["fns"]
    m, a = HandModel(), math.exp(-2.5)
    z_s, z_dat = HAND_LOGITS["shared"], HAND_LOGITS["dat"]
    assert float(loss_s(m, HAND_BATCH)) == pytest.approx(_ce(z_s, 0) + a * _kd(z_s, z_dat), rel=1e-5)
    assert float(loss_dat(m, HAND_BATCH)) == pytest.approx(_ce(z_dat, 0) + a * _kd(z_dat, z_s), rel=1e-5)


# ------------------------------------------------------------------------------------------------ the head
def _head_steps_per_batch(sim, monkeypatch):
    """Run the simulation's one round with every optimizer spied on: (optimizer steps that move the client head,
    batches) summed over the clients."""
    built = []
    base = VQAPeft.optimizer

    def spy(params, hp):
        params = list(params)
        opt, steps = base(params, hp), []
        built.append((params, steps))
        opt.register_step_pre_hook(lambda o, args, kwargs: steps.append(1))
        return opt

    monkeypatch.setattr(VQAPeft, "optimizer", staticmethod(spy))
    sim.run()
    head = {id(p) for k, p in sim.model.named_parameters() if k.startswith("backbone.classifier.")}
    head_steps = sum(len(steps) for params, steps in built if head & {id(p) for p in params})
    return head_steps, sum(u.metrics["steps"] for u in sim.last_updates)


@pytest.mark.parametrize("method, cfg, per_batch", [("vqa_adapter", {}, 1), ("feddat", {"eval_variants": False}, 1),
                                                    ("feddat", {"eval_variants": False, "head_loss": "both"}, 2),
                                                    ("feddat", {"eval_variants": False, "teacher": "frozen"}, 1)])
def test_the_head_steps_once_per_batch_as_in_adapter(sim_for, monkeypatch, method, cfg, per_batch):
    """One round, 5 clients (9 or 16 questions at batch 8: 1 or 2 batches each, 9 in all): the optimizer steps
    that move the client head number one per batch in Adapter and in FedDAT (Alg. 1 trains the head with A_s only),
    two with ``--head_loss both`` (the authors' code); the "w/o A_c" ablation (teacher Â_s, frozen) trains A_s and the
    head alone, one stage per batch."""
    sim = sim_for(method, rounds=1, **cfg)
    head_steps, batches = _head_steps_per_batch(sim, monkeypatch)
    assert batches == 9
    assert head_steps == per_batch * batches


# ------------------------------------------------------------------------------------------------ answer pools
def test_answer_pool_masks_logits_and_the_loss_is_the_pools_cross_entropy(vqa_fed):
    """``set_answer_pool``: the pool's logits are unchanged, every other answer's is OUT_OF_POOL (probability 0),
    and the model's loss is the cross-entropy over the pool's answers only, log-sum-exp written out."""
    torch.manual_seed(0)
    m = build_vqa_peft_model("tiny-vilt", list(vqa_fed.label_names))
    b = batch_of(vqa_fed, 0, n=4)
    pool = torch.zeros(13, dtype=torch.bool)
    pool[[int(a) for a in b["answer"]] + [12]] = True

    def run(p):
        m.set_answer_pool(p)
        torch.manual_seed(3)                                   # ViLT's random patch order
        with torch.no_grad():
            return m(**b)
    free, masked = run(None), run(pool)
    assert torch.equal(masked.logits[:, pool], free.logits[:, pool])
    assert (masked.logits[:, ~pool] == OUT_OF_POOL).all() and OUT_OF_POOL == -1e4
    z, ids = free.logits.tolist(), pool.nonzero().flatten().tolist()
    want = sum(math.log(sum(math.exp(row[j]) for j in ids)) - row[int(y)] for row, y in zip(z, b["answer"])) / 4
    assert float(masked.loss) == pytest.approx(want, rel=1e-5)
    assert float(free.loss) != pytest.approx(want, rel=1e-3)   # the pool changes the loss


@pytest.mark.parametrize("pools", ["client", "all"])
def test_each_client_scores_its_own_answer_pool(sim_for, vqa_fed, pools):
    """``--answer_pool client`` (the paper's client-specific heads over A^k): during its update and at evaluation a
    client's model scores exactly the answers of its training split (counted here from the data), so every
    prediction is one of them; ``all``: every answer."""
    sim = sim_for("feddat", rounds=1, answer_pool=pools)
    sim.setup()
    algo = sim.algorithm
    names = vqa_fed.label_names
    for cid in range(5):
        mine = {int(a) for a in vqa_fed.clients[cid].train.with_format(None)["answer"]}
        want = None if pools == "all" else [i in mine for i in range(len(names))]
        seen = {}
        algo.run_local = lambda client_id, r, ps, fns: seen.update(pool=sim.model.answer_pool) or {"steps": 1,
                                                                                                    "train_loss": 0.0}
        down = {"model": {k: sim.server_state["model"][k] for k in algo.global_keys}}
        algo.client_update(cid, down, algo.init_private_state(cid), 1)
        got = seen["pool"]
        assert (got if got is None else got.tolist()) == want, cid
        model = algo.load_personal(cid, sim.server_state, algo.init_private_state(cid), 1)
        got = model.answer_pool
        assert (got if got is None else got.tolist()) == want, cid
        if pools == "client":
            b = {k: v.to(sim.device) for k, v in batch_of(vqa_fed, cid, n=9).items()}
            with torch.no_grad():
                pred = model(**{k: v for k, v in b.items() if k != "answer"}).logits.argmax(-1)
            assert set(pred.tolist()) <= mine
    assert {names[i] for i in {int(a) for a in vqa_fed.clients[2].train.with_format(None)["answer"]}} <= {"yes", "no"}


# ------------------------------------------------------------------------------------------------ A_s acts
def _set_shared(m, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for slot in m.adapters:
            for lin in (slot.shared.down, slot.shared.up):
                lin.weight.copy_(scale * torch.randn(lin.weight.shape, generator=g))
                lin.bias.copy_(scale * torch.randn(lin.bias.shape, generator=g))


@pytest.mark.parametrize("model", ["tiny-vilt", "tiny-blip"])
def test_the_shared_adapter_changes_predictions(vqa_fed, model):
    """A_s of known (seeded) weights changes the predicted answer of questions against the same model without
    adapters, on ViLT and on BLIP (whose answers come from the decoder's first step through every adapter)."""
    torch.manual_seed(0)
    m = build_vqa_peft_model(model, list(vqa_fed.label_names))
    b = batch_of(vqa_fed, 1, n=16)
    x = {k: v for k, v in b.items() if k != "answer"}

    def pred(mode):
        m.mode = mode
        torch.manual_seed(1)
        with torch.no_grad():
            return m(**x).logits.argmax(-1)
    before = pred("none")
    _set_shared(m)
    assert int((pred("shared") != before).sum()) >= 4


def test_blip_image_embeddings_depend_on_the_image():
    """A tiny BLIP built from a config: the vision tower's output differs between images (BlipVisionConfig's own
    initializer_range, 1e-10, gave ~0 weights and one constant output, std 2e-7 across images, so a random-init
    BLIP, or one at the start of its pretraining, could not tell images apart)."""
    from hfpfl.models.builders import build_vqa_model

    torch.manual_seed(0)
    bb = build_vqa_model("tiny-blip", 13, image_size=32, vocab_size=100)
    assert bb.config.vision_config.initializer_range == 0.02
    pixels = torch.rand(6, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        out = bb.vision_model(pixel_values=pixels).last_hidden_state
    assert float(out.std(0).mean()) > 0.1                       # across the 6 images, per token and feature


# ------------------------------------------------------------------------------------------------ prompt baseline
@pytest.mark.parametrize("model", ["tiny-vilt", "tiny-blip"])
def test_text_prompt_is_five_known_tokens_after_cls_in_the_question_encoder(vqa_fed, model):
    """--peft prompt: the logits are the backbone's on the question's word embeddings with the prompt's 5 tokens
    inserted after [CLS] and the mask extended over them; written out with the transformers modules here (the prompt
    made a known vector b by a zero last weight); on BLIP the decoder reads the prompted encoder output, prompt
    positions included. The prompt changes the logits."""
    torch.manual_seed(0)
    m = build_vqa_peft_model(model, list(vqa_fed.label_names), peft="prompt").eval()
    b = batch_of(vqa_fed, 1, n=16)
    ids, mask = b["input_ids"], b["attention_mask"]
    pixel_values = b["pixels"].float() / 127.5 - 1.0
    d = m.prompt.embedding.weight.shape[1]
    vec = torch.linspace(-2.0, 2.0, d)
    with torch.no_grad():
        nn.init.zeros_(m.prompt.mlp[2].weight)
        m.prompt.mlp[2].bias.copy_(vec)
        got = m(**{k: v for k, v in b.items() if k != "answer"}).logits
        n = len(ids)
        bb = m.backbone
        if model == "tiny-vilt":
            emb = bb.vilt.embeddings.text_embeddings.word_embeddings(ids)
        else:
            emb = bb.text_encoder.embeddings.word_embeddings(ids)
        embeds = torch.cat([emb[:, :1], vec.expand(n, 5, d), emb[:, 1:]], 1)
        mask5 = torch.cat([mask[:, :1], torch.ones(n, 5, dtype=mask.dtype), mask[:, 1:]], 1)
        if model == "tiny-vilt":
            pooled = bb.vilt(pixel_values=pixel_values, inputs_embeds=embeds, attention_mask=mask5).pooler_output
            want = bb.classifier(pooled)
            plain = bb.classifier(bb.vilt(pixel_values=pixel_values, input_ids=ids, attention_mask=mask).pooler_output)
        else:
            img = bb.vision_model(pixel_values=pixel_values).last_hidden_state
            img_att = torch.ones(img.shape[:-1], dtype=torch.long)
            bos = torch.full((n, 1), bb.config.text_config.bos_token_id, dtype=torch.long)

            def answer_logits(q, qmask):
                out = bb.text_decoder(input_ids=bos, encoder_hidden_states=q, encoder_attention_mask=qmask)
                return out.logits[:, 0, m.answer_ids]
            q = bb.text_encoder(inputs_embeds=embeds, attention_mask=mask5, encoder_hidden_states=img,
                                encoder_attention_mask=img_att).last_hidden_state
            want = answer_logits(q, mask5)
            q0 = bb.text_encoder(input_ids=ids, attention_mask=mask, encoder_hidden_states=img,
                                 encoder_attention_mask=img_att).last_hidden_state
            plain = answer_logits(q0, mask)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert float((got - plain).abs().max()) > 1e-4    # the random tiny backbone barely reads its text
