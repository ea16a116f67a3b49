"""What hfpfl publishes loads with the HF libraries' own one-call loaders in a process that never imports hfpfl:
a LoRA adapter with peft's ``AutoPeftModel``, and the FedBiP pipeline with diffusers' ``custom_pipeline=``.
Each loader runs in a subprocess whose Hub cache is a temporary folder this test populated, and its outputs are
compared with hfpfl's own model's on a fixed input."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

# the guard every loader below ends with: the process never imported hfpfl
NO_HFPFL = 'assert not [m for m in sys.modules if m == "hfpfl" or m.startswith("hfpfl.")], "hfpfl was imported"\n'


def run_without_hfpfl(script: str, args: list[str], cache: Path, cwd: Path) -> subprocess.CompletedProcess:
    """``python -c script args`` offline on the Hub cache ``cache``, outside the repository (no PYTHONPATH), so
    nothing but the installed libraries (and what the script names) is importable by accident."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HF_HUB_CACHE", "HF_HOME")}
    env.update(HF_HUB_CACHE=str(cache), HF_HOME=str(cwd / "hf-home"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env,
                         cwd=str(cwd), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def fixed_images(n: int = 3, size: int = 28) -> torch.Tensor:
    """A fixed input: a ramp in [-1, 1] (no random draw)."""
    return torch.linspace(-1, 1, n * 3 * size * size).reshape(n, 3, size, size)


# ------------------------------------------------------------------------------------------ LoRA: AutoPeftModel
AUTO_PEFT_LOADER = textwrap.dedent("""
    import sys
    import torch
    from peft import AutoPeftModel
    from safetensors.torch import load_file, save_file

    repo, revision, folder, data_file, out_file = sys.argv[1:6]
    x = load_file(data_file)["x"]
    logits = {}
    for name, source, kw in (("repo", repo, {"revision": revision}), ("folder", folder, {})):
        model = AutoPeftModel.from_pretrained(source, **kw).eval()   # the README's one call
        with torch.no_grad():
            logits[name] = model(pixel_values=x).logits.contiguous()
    save_file(logits, out_file)
""") + NO_HFPFL


@pytest.mark.slow  # a subprocess that imports torch, transformers and peft/diffusers
def test_published_lora_adapter_loads_with_auto_peft_model_in_one_call(pretrained_backbone, tmp_path):
    """The README's plain-peft line for a LoRA adapter on ``hfpfl/tiny-resnet-ood`` (a 93-class pretraining head;
    the adapter's head has 10): ``AutoPeftModel.from_pretrained(repo_id, revision=...)`` -- by repo id and by the
    snapshot folder -- gives hfpfl's own model's logits on a fixed input. Pins: the adapter config names a base with
    the adapter's head shape (without it peft fails with a size mismatch), that base is the frozen backbone *as
    hfpfl's model holds it* (a BatchNorm statistic set here, as a frozen backbone's drift would, reaches the
    loaded model), and the trained head and LoRA weights are the adapter's."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from hfpfl import hub
    from hfpfl.models import build_run_model
    from hfpfl.models.adapters.io import BASE_REVISION, publish_adapter

    assert AutoConfig.from_pretrained(pretrained_backbone).num_labels == 93  # the premise: the checkpoint's head
    model = build_run_model(pretrained_backbone, "lora", num_labels=10, lora_r=2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.constant_(p, 0.02)                    # LoRA B starts at 0: make the adapter count
            elif "modules_to_save" in name:
                p.copy_(torch.linspace(-0.5, 0.5, p.numel()).reshape(p.shape))  # the trained head, known values
        bn = next(m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
        bn.running_var.mul_(4.0)                                 # frozen-backbone drift, kept by the base
    model.eval()
    x = fixed_images()
    with torch.no_grad():
        ref = model(pixel_values=x).logits
    repo = "me/lora-on-tiny-resnet-ood"
    snapshot = publish_adapter(model, repo, ["round-3", "main"])

    save_file({"x": x}, str(tmp_path / "x.safetensors"))
    run_without_hfpfl(AUTO_PEFT_LOADER, [repo, "round-3", snapshot, str(tmp_path / "x.safetensors"),
                                         str(tmp_path / "out.safetensors")], Path(hub.hub_cache_dir()), tmp_path)
    got = load_file(str(tmp_path / "out.safetensors"))
    for source in ("repo", "folder"):
        assert got[source].shape == (3, 10)
        torch.testing.assert_close(got[source], ref, rtol=0, atol=1e-6)
        assert torch.equal(got[source].argmax(-1), ref.argmax(-1))
    config = json.loads((Path(snapshot) / "adapter_config.json").read_text())
    base_snapshot = hub.require_cached(repo, revision=BASE_REVISION)
    assert config["base_model_name_or_path"] == repo and config["revision"] == Path(base_snapshot).name
    assert config["auto_mapping"]["base_model_class"] == "ResNetForImageClassification"
    assert json.loads((Path(base_snapshot) / "config.json").read_text())["id2label"].keys() == {str(i) for i in
                                                                                                 range(10)}
    assert "AutoPeftModel.from_pretrained(repo_id, revision=\"round-3\")" in " ".join(README.read_text().split())


def test_plain_base_model_draws_no_random_numbers_and_refuses_a_model_it_cannot_unwrap():
    """Publishing mid-run builds the plain base without touching the random streams (the run's next draws are the
    ones it would have made), and its strict load refuses keys it does not know how to map back."""
    from hfpfl.models import build_classifier
    from hfpfl.models.adapters.io import plain_base_model
    from hfpfl.models.lora import add_lora

    model = add_lora(build_classifier("tiny-resnet", 4), r=2)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    base = plain_base_model(model)
    assert torch.equal(torch.rand(3), expected)
    assert not any("lora" in k or "base_layer" in k or "original_module" in k for k in base.state_dict())
    assert base.classifier[1].weight.shape == (4, base.config.hidden_sizes[-1])
    model.get_base_model().register_buffer("stray", torch.zeros(1))  # a key no base model has
    with pytest.raises(RuntimeError, match="stray"):
        plain_base_model(model)


# ------------------------------------------------------------------------------------------ FedBiP: custom_pipeline
CUSTOM_PIPELINE_LOADER = textwrap.dedent("""
    import sys
    import torch
    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file, save_file

    repo, pipeline_file, upload_file, out_file = sys.argv[1:5]
    pipe = DiffusionPipeline.from_pretrained(repo, custom_pipeline=pipeline_file,  # the README's call
                                             trust_remote_code=True)
    pipe.set_progress_bar_config(disable=True)
    up = load_file(upload_file)
    out = pipe(latents=up["latents"], labels=up["labels"], domain_concept=up["domain_concept"],
               class_concepts=up["class_concepts"], num_inference_steps=3, output_type="pt",
               generator=torch.Generator().manual_seed(7))
    save_file({"images": out.images.contiguous(), "labels": out.labels.contiguous()}, out_file)
    print(type(pipe).__name__)
""") + NO_HFPFL


@pytest.mark.slow  # a subprocess that imports torch, transformers and peft/diffusers
def test_fedbip_pipeline_loads_through_diffusers_custom_pipeline_without_hfpfl(tmp_path):
    """The README's FedBiP snippet: ``DiffusionPipeline.from_pretrained("hfpfl/tiny-ldm-digits-broad",
    custom_pipeline="pipelines/pipeline_fedbip.py", trust_remote_code=True)`` on the shipped LDM, published into a temporary Hub cache,
    gives a ``FedBiPPipeline`` whose images for a fixed upload (latents, labels, concepts: fixed ramps) and seed are
    hfpfl's own pipeline's, bit for bit."""
    from safetensors.torch import load_file, save_file

    from hfpfl import hub
    from hfpfl.fedbip.publish import DEFAULT_LDM_REPO, publish_shipped_ldm
    from hfpfl.pipelines import FedBiPPipeline

    cache = tmp_path / "hub"
    snapshot = publish_shipped_ldm(DEFAULT_LDM_REPO, cache_dir=cache, log=lambda *a: None)
    with hub.use_hub_cache(cache):
        pipe = FedBiPPipeline.from_pretrained(DEFAULT_LDM_REPO)
    assert Path(snapshot).name == Path(hub.require_cached(DEFAULT_LDM_REPO, cache_dir=cache)).name
    pipe.set_progress_bar_config(disable=True)
    c, s = pipe.unet.config.in_channels, pipe.unet.config.sample_size
    d = pipe.text_encoder.get_input_embeddings().weight.shape[1]

    def ramp(*shape, scale=1.0):
        n = 1
        for k in shape:
            n *= k
        return scale * torch.linspace(-1, 1, n).reshape(shape)

    upload = {"latents": ramp(4, c, s, s), "labels": torch.tensor([0, 3, 3, 9]),
              "domain_concept": ramp(2, d, scale=0.05), "class_concepts": ramp(10, 1, d, scale=0.05)}
    ref = pipe(**upload, num_inference_steps=3, output_type="pt", generator=torch.Generator().manual_seed(7))
    save_file(upload, str(tmp_path / "upload.safetensors"))
    out = run_without_hfpfl(CUSTOM_PIPELINE_LOADER, [DEFAULT_LDM_REPO, str(ROOT / "pipelines" / "pipeline_fedbip.py"),
                                                     str(tmp_path / "upload.safetensors"),
                                                     str(tmp_path / "out.safetensors")], cache, tmp_path)
    assert out.stdout.strip().splitlines()[-1] == "FedBiPPipeline"
    got = load_file(str(tmp_path / "out.safetensors"))
    assert torch.equal(got["labels"], upload["labels"])
    assert got["images"].shape == ref.images.shape and torch.equal(got["images"], ref.images)
    readme = " ".join(README.read_text().split())
    assert ('DiffusionPipeline.from_pretrained("hfpfl/tiny-ldm-digits-broad", '
            'custom_pipeline="pipelines/pipeline_fedbip.py", trust_remote_code=True)') in readme


# ------------------------------------------------------------------------------------------ FedDAT's shared adapter
SHARED_ADAPTER_LOADER = textwrap.dedent("""
    import sys
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForVisualQuestionAnswering

    folder, repo, revision, data_file, out_file = sys.argv[1:6]
    batch = load_file(data_file)
    logits = {}
    for name, source, kw in (("folder", folder, {}), ("repo", repo, {"revision": revision})):
        model = AutoModelForVisualQuestionAnswering.from_pretrained(source, trust_remote_code=True, **kw)  # README
        assert type(model).__name__ == "ViltWithSharedAdapter" and not model.training
        with torch.no_grad():
            logits[name] = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                 pixel_values=batch["pixel_values"]).logits.contiguous()
    save_file(logits, out_file)
""") + NO_HFPFL


def _ramp_(tensor: torch.Tensor, scale: float) -> None:
    with torch.no_grad():
        tensor.copy_(scale * torch.linspace(-1, 1, tensor.numel()).reshape(tensor.shape))


@pytest.mark.slow  # a subprocess that imports torch, transformers and peft/diffusers
def test_feddat_shared_adapter_loads_with_one_transformers_call_without_hfpfl(tmp_path):
    """FedDAT's shared adapter A_s, saved by ``save_shared_adapter`` (folder) and published (repo id + revision),
    loads with ``AutoModelForVisualQuestionAnswering.from_pretrained(..., trust_remote_code=True)`` in a process
    that never imports hfpfl, and gives hfpfl's VQAModel's logits on the inference path (mode "shared") for a fixed
    batch. The adapters hold known, distinct values: A_s (what travels) must be what loads -- not A_c, the private
    adapter, and not nothing (the backbone alone gives other logits)."""
    from safetensors.torch import load_file, save_file
    from transformers import ViltForQuestionAnswering

    from hfpfl import hub
    from hfpfl.models.builders import build_vqa_model, tiny_vqa_vocab
    from hfpfl.models.vqa_model import VQAModel
    from hfpfl.models.vqa_hub import save_shared_adapter

    cache, vocab = tmp_path / "hub", len(tiny_vqa_vocab())
    torch.manual_seed(0)
    build_vqa_model("tiny-vilt", 7, image_size=32, vocab_size=vocab).save_pretrained(tmp_path / "backbone")
    hub.push_folder_to_cache(tmp_path / "backbone", "org/tiny-vilt-vqa", cache_dir=cache)
    with hub.use_hub_cache(cache):
        model = VQAModel(ViltForQuestionAnswering.from_pretrained("org/tiny-vilt-vqa"), peft="adapter",
                         head_init="pretrained").eval()
        for i, slot in enumerate(model.adapters):
            for j, p in enumerate(slot.shared.parameters()):
                _ramp_(p, 0.3 + 0.1 * i + 0.05 * j)
            for p in slot.local.parameters():
                _ramp_(p, -0.7)
        folder = save_shared_adapter(model, tmp_path / "shared_adapter")
        hub.push_folder_to_cache(folder, "me/feddat-shared", revision="round-2")
    config = json.loads((Path(folder) / "config.json").read_text())["shared_adapter"]
    assert config["base_model_name_or_path"] == "org/tiny-vilt-vqa"
    assert config["base_revision"] == Path(hub.require_cached("org/tiny-vilt-vqa", cache_dir=cache)).name
    assert config["sites"] == [f"vilt.encoder.layer.{i}.output" for i in range(len(model.adapters))]

    n, length = 3, 6
    input_ids = (torch.arange(n * length).reshape(n, length) * 7) % vocab
    pixels = (torch.arange(n * 3 * 32 * 32).reshape(n, 3, 32, 32) * 5 % 256).to(torch.uint8)
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "pixels": pixels}
    with torch.no_grad():
        model.mode = "shared"
        ref = model(**batch).logits
        model.mode = "none"
        without = model(**batch).logits
    save_file({"input_ids": input_ids, "attention_mask": batch["attention_mask"],
               "pixel_values": pixels.float() / 127.5 - 1.0}, str(tmp_path / "batch.safetensors"))
    run_without_hfpfl(SHARED_ADAPTER_LOADER, [folder, "me/feddat-shared", "round-2", str(tmp_path / "batch.safetensors"),
                                              str(tmp_path / "out.safetensors")], cache, tmp_path)
    got = load_file(str(tmp_path / "out.safetensors"))
    assert not torch.allclose(ref, without, atol=1e-3)  # the adapter changes the answer scores
    for source in ("folder", "repo"):
        torch.testing.assert_close(got[source], ref, rtol=0, atol=1e-6)
    readme = " ".join(README.read_text().split())
    assert "AutoModelForVisualQuestionAnswering.from_pretrained(folder_or_repo_id, trust_remote_code=True)" in readme


@pytest.mark.slow  # two short FedDAT runs
def test_feddat_run_saves_the_final_global_shared_adapter(tmp_path):
    """A FedDAT run on a backbone checkpoint leaves ``shared_adapter/`` in its output folder holding the server's
    final global A_s (what travels; saved from the server state, not from whatever the model holds), named by the
    checkpoint's commit; a run on a backbone built from a config
    (nothing to name) saves none and still finishes."""
    from safetensors.torch import load_file

    from hfpfl import hub
    from hfpfl.algorithms import get_algorithm
    from hfpfl.config import RunArguments
    from hfpfl.data.vqa import vqa_benchmark, vqa_words
    from hfpfl.federated.engine import Simulation
    from hfpfl.models.builders import build_vqa_model, tiny_vqa_vocab
    from hfpfl.models.vqa import vqa_tokenizer

    fed = vqa_benchmark("domain", tokenizer=vqa_tokenizer(), seed=0, train_per_client=8, test_per_client=8)
    cache = tmp_path / "hub"
    vocab = len(tiny_vqa_vocab(vqa_words()))  # the data's tokenizer (as the engine's tiny-vilt has it)
    build_vqa_model("tiny-vilt", len(fed.label_names), vocab_size=vocab).save_pretrained(tmp_path / "backbone")
    hub.push_folder_to_cache(tmp_path / "backbone", "org/tiny-vilt-vqa", cache_dir=cache)
    for model in ("org/tiny-vilt-vqa", "tiny-vilt"):
        out = tmp_path / model.replace("/", "-")
        run = RunArguments(method="feddat", model=model, random_backbone_ok=True, num_rounds=1, batch_size=8,
                           lr=1e-2, optimizer="adamw", output_dir=str(out), progress=False, checkpoint_every=0,
                           eval_batch_size=64)
        with hub.use_hub_cache(cache):
            sim = Simulation(run, None, get_algorithm("feddat").Config(eval_variants=False), fed_data=fed)
            sim.run()
        if model == "tiny-vilt":
            assert not (out / "shared_adapter").exists() and (out / "results.json").exists()
            continue
        saved = load_file(str(out / "shared_adapter" / "shared_adapter.safetensors"))
        server = sim.server_state["model"]
        shared = {k: v for k, v in server.items() if k.startswith("adapters.") and ".shared." in k}
        assert len(saved) == len(shared) > 0
        for key, value in shared.items():
            i, rest = key[len("adapters."):].split(".shared.")
            assert torch.equal(saved[f"{i}.{rest}"], value), key
        with torch.no_grad():  # what the model holds does not matter: the server's global part is what is saved
            for slot in sim.algorithm.model.adapters:
                for p in slot.shared.parameters():
                    p.zero_()
        with hub.use_hub_cache(cache):
            sim.algorithm.save_shared_adapter(sim.server_state)
        saved = load_file(str(out / "shared_adapter" / "shared_adapter.safetensors"))
        assert all(torch.equal(saved[f"{k[len('adapters.'):].replace('.shared.', '.')}"], v) for k, v in shared.items())
        spec = json.loads((out / "shared_adapter" / "config.json").read_text())["shared_adapter"]
        assert spec["base_revision"] == Path(hub.require_cached("org/tiny-vilt-vqa", cache_dir=cache)).name
