"""FedDAT (federated dual-adapter teacher, AAAI 2024) and its PEFT baselines on the offline easy-vqa benchmark,
with a frozen tiny ViLT or BLIP foundation model pretrained on a disjoint pool (published to the local Hub cache on
first use, ~1-3 min on one CPU core).

    accelerate launch recipes/feddat.py --output_dir outputs/feddat                       # FedDAT, ViLT, scene split
    python recipes/feddat.py --backbone blip --vqa_split domain
    python recipes/feddat.py --method vqa_adapter                     # Adapter (FedAvg of one shared adapter)
    python recipes/feddat.py --method vqa_adapter_local               # Adapter-L (local only)
    python recipes/feddat.py --method feddat --mutual false           # ablation: w/o mutual KD
    python recipes/feddat.py --method vqa_peft --peft lora            # or prompt | bias | full | head (clf-L)
    python recipes/feddat.py --method vqa_central --num_rounds 1      # benchmark check: central fine-tuning
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 recipes/feddat.py ...
    python recipes/feddat.py --help

The benchmark's own options (--backbone vilt|blip: the stand-in whose tiny checkpoint is the default --model;
--vqa_split function|scene|domain; --train_per_client / --test_per_client; --answer_balance question|none: each
question string's answers uniform, the default, so that answers need the image; --image_ablation none|blank|shuffle:
the question-only and shuffled-image controls) are listed by --help with the run and
method options; they go in a --config file and config.yaml like any other.
Defaults (a few minutes on 2 cores): 8 rounds, 1 local epoch, batch 32, AdamW lr 1e-3, weight decay 0.01, warm-up
10% + linear decay per round. Results contract: config.yaml, results.json (per-client accuracy, bytes per part,
inference_shared/dat/local for FedDAT), metrics.jsonl, curves.png and the per-client accuracy bars.
"""
from dataclasses import dataclass

from hfpfl.cli import run_recipe
from hfpfl.options import at_least, option

DEFAULTS = dict(dataset="easy-vqa", num_rounds=8, local_epochs=1, batch_size=32, optimizer="adamw", lr=1e-3,
                weight_decay=0.01, image_size=32, eval_batch_size=200)


@dataclass
class VQABenchmark:
    backbone: str = option("vilt", "The stand-in foundation model (its tiny pretrained checkpoint is the default "
                           "--model); --model overrides it with a Hub id.", choices=["vilt", "blip"])
    vqa_split: str = option("scene", "function: one question family per client (textual shift) | scene: one visual "
                            "style per client (visual shift) | domain: both.", choices=["function", "scene", "domain"])
    train_per_client: int = option(300, "Training questions per client.", check=at_least(20))
    test_per_client: int = option(200, "Test questions per client.", check=at_least(20))
    image_ablation: str = option("none", "A control, not a method: blank (every client image one constant grey "
                                 "image, train and test: a question-only model) | shuffle (images permuted across "
                                 "the questions of each client split) | none.", choices=["none", "blank", "shuffle"])
    answer_balance: str = option("question", "question: every question string's answers uniform in each client "
                                 "split (yes/no 50/50), so the answers need the image | none: easy-vqa's raw answer "
                                 "mix (a question-only model scores far above chance).", choices=["question", "none"])
    validation_per_client: int = option(0, "0: report the test split | N: hold N of each client's training questions "
                                        "out and report accuracy on them in place of the test split (to choose "
                                        "settings without looking at the test split).", check=at_least(0))

    def run_defaults(self) -> dict:
        """The run defaults these options choose: --backbone's stand-in is the default --model."""
        from hfpfl.models.vqa import BACKBONES
        return {"model": BACKBONES[self.backbone]}


RECIPE_OPTIONS = VQABenchmark  # this recipe's own options (docs/reference/options.md lists them)


def benchmark_data(run, data, opts: VQABenchmark):
    fed = build_data(run, data, opts.vqa_split, opts.train_per_client, opts.test_per_client, opts.image_ablation,
                     answer_balance=opts.answer_balance)
    return held_out_validation(fed, opts.validation_per_client, run.seed) if opts.validation_per_client else fed


def held_out_validation(fed, n: int, seed: int):
    """Each client's test split replaced by ``n`` questions drawn (seeded) from its training split, which loses
    them: the validation split that --validation_per_client reports."""
    import datasets

    for c in fed.clients:
        if n > len(c.train) - 20:
            raise ValueError(f"--validation_per_client {n} leaves client {c.client_id} fewer than 20 of its "
                             f"{len(c.train)} training questions; lower it or raise --train_per_client")
        parts = c.train.train_test_split(test_size=n, seed=seed, shuffle=True)
        c.train, c.test = parts["train"].with_format("torch"), parts["test"].with_format("torch")
    fed.global_test = datasets.concatenate_datasets([c.test for c in fed.clients]).with_format("torch")
    return fed


def build_data(run, data, split, train_n, test_n, image_ablation="none", answer_balance="question"):
    from hfpfl.data.vqa import vqa_benchmark
    from hfpfl.models.vqa import vqa_tokenizer
    from hfpfl.models.builders import TINY_VQA_MODELS, build_vqa_tokenizer
    from hfpfl.models.vqa import BACKBONES

    local = run.model in BACKBONES or run.model in BACKBONES.values() or run.model in TINY_VQA_MODELS
    tok = vqa_tokenizer() if local else build_vqa_tokenizer(run.model)
    tok = getattr(tok, "tokenizer", tok)
    return vqa_benchmark(split, tokenizer=tok, seed=run.seed, train_per_client=train_n, test_per_client=test_n,
                         image_size=data.image_size, image_ablation=image_ablation, answer_balance=answer_balance)


def main(argv=None):
    return run_recipe(method="feddat", argv=argv, defaults=DEFAULTS, script="recipes/feddat.py",
                      name=lambda opts: f"feddat-{opts.vqa_split}", description=__doc__,
                      recipe_options=VQABenchmark, data_fn=benchmark_data)


if __name__ == "__main__":
    main()
