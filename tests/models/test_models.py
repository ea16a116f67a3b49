import os

import pytest
import torch

torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from huggingface_hub import constants  # noqa: E402
from transformers import ResNetForImageClassification, ViTForImageClassification  # noqa: E402

from hfpfl.hub import OfflineModelError  # noqa: E402
from hfpfl.models import (  # noqa: E402
    build_classifier,
    build_vqa_model,
    build_vqa_tokenizer,
    count_parameters,
    norm_layer_names,
    resnet18_config,
)


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path


@pytest.mark.parametrize("name,cls", [("tiny-resnet", ResNetForImageClassification),
                                      ("tiny-vit", ViTForImageClassification)])
@pytest.mark.parametrize("channels", [1, 3])
def test_tiny_classifiers_train_step(name, cls, channels):
    torch.manual_seed(0)
    m = build_classifier(name, num_labels=7, image_size=28, num_channels=channels)
    assert isinstance(m, cls) and m.config.num_labels == 7
    x, y = torch.randn(8, channels, 28, 28), torch.randint(0, 7, (8,))
    out = m(pixel_values=x, labels=y)
    assert out.logits.shape == (8, 7)
    out.loss.backward()
    assert all(p.grad is not None for p in m.parameters() if p.requires_grad)


def test_sizes_and_overrides():
    assert 250_000 < count_parameters(build_classifier("tiny-resnet", 10)) < 400_000
    assert count_parameters(build_classifier("tiny-vit", 10)) < 100_000
    # real ResNet-18 shape: 11.69M with the 1000-class head
    assert abs(count_parameters(ResNetForImageClassification(resnet18_config(1000))) - 11_689_512) < 1000
    m = build_classifier("resnet-26", 10)
    assert m.config.depths == [4, 4, 4]
    m = build_classifier("tiny-resnet", 3, hidden_sizes=[8, 16, 32, 64], embedding_size=8)
    assert m.config.hidden_sizes == [8, 16, 32, 64]
    m = build_classifier("tiny-vit", 3, image_size=32)
    assert m.config.patch_size == 4 and m(pixel_values=torch.randn(2, 3, 32, 32)).logits.shape == (2, 3)


def test_norm_layer_names():
    r = build_classifier("tiny-resnet", 10)
    names = norm_layer_names(r)
    assert names and all(isinstance(r.get_submodule(n), torch.nn.BatchNorm2d) for n in names)
    assert "resnet.embedder.embedder.normalization" in names
    v = build_classifier("tiny-vit", 10)
    vn = norm_layer_names(v)
    assert "vit.layernorm" in vn and all(isinstance(v.get_submodule(n), torch.nn.LayerNorm) for n in vn)
    assert len(vn) == 2 * 2 + 1


def test_uncached_hub_id_fails_fast(offline_cache, network_calls):
    for name in ("microsoft/resnet-18", "google/vit-base-patch16-224-in21k"):
        with pytest.raises(OfflineModelError, match=name) as e:
            build_classifier(name, 10)
        assert isinstance(e.value, OSError) and "hf download" in str(e.value)
    with pytest.raises(OfflineModelError, match="recipes/pretrain.py"):
        build_classifier("hfpfl/tiny-resnet-digits", 10)
    with pytest.raises(OfflineModelError, match="dandelin/vilt-b32-mlm"):
        build_vqa_model("dandelin/vilt-b32-mlm", 10)
    with pytest.raises(OfflineModelError, match="Salesforce/blip-vqa-base"):
        build_vqa_tokenizer("Salesforce/blip-vqa-base")
    assert network_calls == []  # fails at once: no retry, no request
    with pytest.raises(FileNotFoundError):
        build_classifier("./no/such/dir", 10)


def test_local_dir_same_path_as_hub(tmp_path):
    torch.manual_seed(0)
    m = build_classifier("tiny-vit", 10)
    m.save_pretrained(tmp_path / "ckpt")
    m2 = build_classifier(str(tmp_path / "ckpt"), num_labels=4)  # new head, backbone kept
    assert m2.config.num_labels == 4 and m2.classifier.out_features == 4
    sd, sd2 = m.state_dict(), m2.state_dict()
    assert all(torch.equal(sd[k], sd2[k]) for k in sd if not k.startswith("classifier"))


def test_vqa_tokenizer_offline(tmp_path):
    tok = build_vqa_tokenizer("tiny-vilt", extra_words=["Zebra"], save_dir=tmp_path)
    assert len(tok) > 100 and (tmp_path / "vocab.txt").is_file()
    ids = tok("What is the color of the zebra?")["input_ids"]
    assert tok.unk_token_id not in ids and ids[0] == tok.cls_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "what is the color of the zebra?"


def test_tiny_vilt_forward_backward():
    tok = build_vqa_tokenizer("tiny-vilt")
    m = build_vqa_model("tiny-vilt", num_answers=5, vocab_size=len(tok))
    enc = tok(["what is the color?", "how many circles are there"], padding="max_length", max_length=12,
              return_tensors="pt")
    labels = torch.nn.functional.one_hot(torch.tensor([1, 3]), 5).float()
    out = m(**enc, pixel_values=torch.randn(2, 3, 32, 32), labels=labels)
    assert out.logits.shape == (2, 5)
    out.loss.backward()
    assert norm_layer_names(m)


def test_tiny_blip_forward_and_generate():
    tok = build_vqa_tokenizer("tiny-blip")
    m = build_vqa_model("tiny-blip", num_answers=5, vocab_size=len(tok))
    enc = tok(["what is the color?", "how many?"], padding="max_length", max_length=10, return_tensors="pt")
    ans = tok(["red", "two"], padding="max_length", max_length=5, return_tensors="pt").input_ids
    px = torch.randn(2, 3, 32, 32)
    out = m(input_ids=enc.input_ids, attention_mask=enc.attention_mask, pixel_values=px, labels=ans)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    gen = m.generate(input_ids=enc.input_ids, attention_mask=enc.attention_mask, pixel_values=px, max_new_tokens=3)
    assert gen.shape[0] == 2 and (gen[:, 0] == tok.bos_token_id).all()


def test_label_names_kept_when_head_matches(tmp_path):
    m = build_classifier("tiny-resnet", 3, id2label={0: "cat", 1: "dog", 2: "fox"}, label2id={"cat": 0, "dog": 1, "fox": 2})
    m.save_pretrained(tmp_path)
    same = build_classifier(str(tmp_path), 3)
    assert same.config.id2label == {0: "cat", 1: "dog", 2: "fox"}
    assert torch.equal(same.classifier[-1].weight, m.classifier[-1].weight)
    other = build_classifier(str(tmp_path), 4)
    assert other.config.num_labels == 4 and other.config.id2label[3] == "3"


def test_a_new_head_is_one_log_line_not_a_load_report(tmp_path):
    """Loading a checkpoint with another number of labels re-initialises its head, as asked: transformers' LOAD
    REPORT table (MISMATCH rows) stays out of the log and hfpfl says it in one line; a report with a missing or
    unexpected weight is not dropped."""
    import logging

    from hfpfl.models.builders import _NewHeadReport

    build_classifier("tiny-resnet", 5).save_pretrained(tmp_path)
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append((record.name, record.getMessage()))

    handler = Keep(level=logging.INFO)
    loggers = [logging.getLogger("transformers.modeling_utils"), logging.getLogger("hfpfl")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    try:
        build_classifier(str(tmp_path), 3)
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(level)
    assert not any("LOAD REPORT" in m for _, m in seen)
    assert ("hfpfl", f"{tmp_path}: a new 3-label head replaces the checkpoint's 5-label head (randomly initialised; "
                     "the rest of the checkpoint is loaded)") in seen
    keep = _NewHeadReport().filter
    record = lambda msg: logging.LogRecord("t", logging.WARNING, "", 0, msg, None, None)  # noqa: E731
    assert not keep(record("ResNet LOAD REPORT from: x\nclassifier.1.weight | MISMATCH | Reinit"))
    assert keep(record("ResNet LOAD REPORT from: x\nclassifier.1.weight | MISMATCH\nembedder.w | MISSING"))
    assert keep(record("ResNet LOAD REPORT from: x\nextra.w | UNEXPECTED"))
