"""FedDAT (federated dual-adapter teacher, AAAI 2024) and its PEFT baselines on the offline easy-vqa benchmark,
with a frozen tiny ViLT or BLIP foundation model pretrained on a disjoint pool (published to the local Hub cache on
first use, ~1-3 min on one CPU core).

    accelerate launch recipes/feddat.py --output_dir outputs/feddat                       # FedDAT, ViLT, scene split
    python recipes/feddat.py --backbone blip --vqa_split domain
    python recipes/feddat.py --method vqa_adapter                     # Adapter (FedAvg of one shared adapter)
    python recipes/feddat.py --method vqa_adapter_local               # Adapter-L (local only)
    python recipes/feddat.py --method feddat --mutual false           # ablation: w/o mutual KD
    python recipes/feddat.py --method vqa_peft --peft lora            # or prompt | bias | full | head (clf-L)
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 recipes/feddat.py ...
    python recipes/feddat.py --help

Benchmark options (besides the run/method flags listed by --help):
  --backbone vilt|blip       the stand-in foundation model (default vilt); --model overrides it with a Hub id
                             (dandelin/vilt-b32-mlm, Salesforce/blip-vqa-base: cached, or fail fast offline)
  --vqa_split function|scene|domain   function: one question family per client (textual shift); scene: one
                             visual style per client (visual shift); domain: both (default scene)
  --train_per_client N / --test_per_client N   questions per client (default 300 / 200)
Defaults (a few minutes on 2 cores): 8 rounds, 1 local epoch, batch 32, AdamW lr 1e-3, weight decay 0.01, warm-up
10% + linear decay per round. Results contract: config.yaml, results.json (per-client accuracy, bytes per part,
inference_shared/dat/local for FedDAT), metrics.jsonl, curves.png and the per-client accuracy bars.
"""
import argparse
import sys

from hfpfl.cli import run_recipe

DEFAULTS = dict(dataset="easy-vqa", num_rounds=8, local_epochs=1, batch_size=32, optimizer="adamw", lr=1e-3,
                weight_decay=0.01, image_size=32, eval_batch_size=200)


def build_data(run, data, split, train_n, test_n):
    from hfpfl.data.vqa import vqa_benchmark, vqa_tokenizer
    from hfpfl.models.builders import TINY_VQA_MODELS, build_vqa_tokenizer
    from hfpfl.models.vqa import BACKBONES

    local = run.model in BACKBONES or run.model in BACKBONES.values() or run.model in TINY_VQA_MODELS
    tok = vqa_tokenizer() if local else build_vqa_tokenizer(run.model)
    tok = getattr(tok, "tokenizer", tok)
    return vqa_benchmark(split, tokenizer=tok, seed=run.seed, train_per_client=train_n, test_per_client=test_n,
                         image_size=data.image_size)


def main(argv=None):
    top_level = argv is None  # the script's entry point: --num_processes may start more processes
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--backbone", default="vilt")
    pre.add_argument("--vqa_split", default="scene")
    pre.add_argument("--train_per_client", default="300")
    pre.add_argument("--test_per_client", default="200")
    known, rest = pre.parse_known_args(argv)

    def bad(name, allowed):
        print(f"recipes/feddat.py: error: --{name} must be {allowed}, got {getattr(known, name)!r}", file=sys.stderr)
        raise SystemExit(2)
    if known.backbone not in ("vilt", "blip"):
        bad("backbone", "vilt or blip (or pass --model <Hub id>)")
    if known.vqa_split not in ("function", "scene", "domain"):
        bad("vqa_split", "function, scene or domain")
    for name in ("train_per_client", "test_per_client"):
        try:
            setattr(known, name, int(getattr(known, name)))
        except ValueError:
            bad(name, "an integer >= 20")
        if getattr(known, name) < 20:
            bad(name, "an integer >= 20")
    from hfpfl.models.vqa import BACKBONES

    defaults = {**DEFAULTS, "model": BACKBONES[known.backbone]}
    return run_recipe(method="feddat", argv=rest, defaults=defaults, script="recipes/feddat.py", name=f"feddat-{known.vqa_split}",
                      description=__doc__, top_level=top_level,
                      data_fn=lambda run, data: build_data(run, data, known.vqa_split, known.train_per_client,
                                                           known.test_per_client),
                      recipe_settings=vars(known))


if __name__ == "__main__":
    main()
