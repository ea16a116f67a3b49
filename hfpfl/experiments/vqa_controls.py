"""The VQA controls of a FedDAT table (``recipes/feddat.py`` data), as registered control kinds.

* ``vqa_chance``: a uniform guess over each client's own answers (the answers of its training split: the pool its
  head scores, ``--answer_pool client``), scored as the expected accuracy 1 / |answers| per client;
* ``vqa_majority``: each client's most frequent training answer, scored on its test questions
  (:func:`hfpfl.experiments.controls.majority_scores`);
* ``vqa_untrained``: the variant's model before any round (the stand-in, fresh adapters, the client head as the
  variant initialises it), scored by the engine (the variant's flags and seed: the same data and initial weights as
  the trained rows);
* ``question_only``: the variant trained and tested with every image blanked (``--image_ablation blank``);
* ``shuffled_image``: the variant trained and tested with images permuted across each client split's questions
  (``--image_ablation shuffle``).

The last two train exactly as the variant they ablate (same method, rounds and budget); they are controls because
they measure the benchmark, not a method. Importing this module registers the kinds."""
from __future__ import annotations

import dataclasses

import numpy as np

from . import controls
from .spec import Variant

RECIPE = "recipes/feddat.py"
#: control kind -> the --image_ablation it trains with
ABLATION_KINDS = {"question_only": "blank", "shuffled_image": "shuffle"}


def _recipe():
    from .runner import _load_recipe
    return _load_recipe(RECIPE)


def _parse(study, variant, seed):
    from ..arguments import parse_run_args
    rec = _recipe()
    run, data, cfg, opts = parse_run_args(study.argv(variant, seed), defaults=rec.DEFAULTS,
                                          recipe_options=rec.VQABenchmark)
    return rec, run, data, cfg, opts


def _fed(study, variant, seed):
    rec, run, data, _, opts = _parse(study, variant, seed)
    return rec.benchmark_data(run, data, opts)


def _domains(fed) -> list:
    return [c.domain for c in fed.clients]


def _row(per_client: list[float], fed) -> dict:
    return {"metrics": {"personal_accuracy": float(np.mean(per_client))},
            "per_domain": controls._by_domain(per_client, _domains(fed)),
            "per_client": {str(i): a for i, a in enumerate(per_client)}, "budget": dict(controls._NO_TRAINING)}


def chance_scores(train_hist: np.ndarray) -> list[float]:
    """Per client (rows: answer counts of its training split): 1 / the number of answers it trains on."""
    return [1.0 / int(np.count_nonzero(h)) for h in train_hist]


@controls.register("vqa_chance")
def run_vqa_chance(study, variant, seed, out_dir) -> dict:
    fed = _fed(study, variant, seed)
    return _row(chance_scores(fed.label_histograms("train", include_new=False)), fed)


@controls.register("vqa_majority")
def run_vqa_majority(study, variant, seed, out_dir) -> dict:
    fed = _fed(study, variant, seed)
    per_client, _ = controls.majority_scores(fed.label_histograms("train", include_new=False),
                                             fed.label_histograms("test", include_new=False))
    return _row(per_client, fed)


@controls.register("vqa_untrained")
def run_vqa_untrained(study, variant, seed, out_dir) -> dict:
    """The engine's own final evaluation of the recipe's simulation with no round run (setup, then finish)."""
    from ..federated.engine import Simulation
    rec, run, data, cfg, opts = _parse(study, variant, seed)
    run = dataclasses.replace(run, output_dir=str(out_dir), overwrite_output_dir=True, progress=False,
                              checkpoint_every=0, num_processes="1")
    sim = Simulation(run, data, cfg, fed_data=rec.benchmark_data(run, data, opts),
                     recipe_settings=dataclasses.asdict(opts))
    sim.setup()
    return controls.row_from_results(sim.finish())


def _run_ablated(study, variant, seed, out_dir) -> dict:
    from .runner import run_engine
    want = ABLATION_KINDS[variant.kind]
    argv = study.argv(variant, seed)
    have = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--image_ablation"]
    if not have or have[-1] != want:
        raise ValueError(f"study {study.name!r}: control {variant.name!r} of kind {variant.kind!r} must train with "
                         f"--image_ablation {want}; build it with hfpfl.experiments.vqa_controls.{variant.kind}()")
    return run_engine(study, variant, seed, out_dir)


for _kind in ABLATION_KINDS:
    controls.register(_kind, _run_ablated)


def chance(of: Variant, name: str = "chance", label: str = "chance (uniform over the client's answers)") -> Variant:
    return Variant(name, argv=of.argv, kind="vqa_chance", label=label)


def majority(of: Variant, name: str = "majority", label: str = "label majority (client's train answers)") -> Variant:
    return Variant(name, argv=of.argv, kind="vqa_majority", label=label)


def untrained(of: Variant, name: str = "untrained", label: str = "stand-in before federated training") -> Variant:
    return Variant(name, argv=of.argv, kind="vqa_untrained", label=label)


def question_only(of: Variant, name: str = "question_only",
                  label: str | None = None) -> Variant:
    """``of`` trained and tested with blank images (no image information)."""
    return Variant(name, argv=(*of.argv, "--image_ablation", "blank"), kind="question_only", recipe=RECIPE,
                   label=label or f"question-only ({of.title()}, images blanked)")


def shuffled_image(of: Variant, name: str = "shuffled_image", label: str | None = None) -> Variant:
    """``of`` trained and tested with images permuted across each client split's questions."""
    return Variant(name, argv=(*of.argv, "--image_ablation", "shuffle"), kind="shuffled_image", recipe=RECIPE,
                   label=label or f"shuffled images ({of.title()})")
