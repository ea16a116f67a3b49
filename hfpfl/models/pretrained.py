"""Pretrained tiny backbones, offline ("honest stand-ins", DESIGN.md): train a tiny HF model on a pool no client
holds, ``save_pretrained`` it and publish it to the local Hub cache with a model card, so that
``build_classifier("hfpfl/tiny-resnet-ood", ...)`` loads it exactly like ``microsoft/resnet-18``.

The stand-ins (:data:`STANDINS`) are pretrained on the *out-of-domain* pool of :mod:`hfpfl.data.ood` (letters,
symbols, shapes, textures, photo crops and faces: no digit, no client photo), as ImageNet is to CIFAR. Pretraining
on a dataset's own ``public`` split (``--dataset digits``) is still possible for ablations; such a repo is named
``...-indomain`` because that backbone has already seen the clients' domains.

``recipes/pretrain.py`` is the command-line front end; the engine calls :func:`ensure_standin` on first use of a
stand-in id (idempotent: a cached repo trained with the same config is reused).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import hub
from ..options import at_least, in_range, non_negative, one_of, option, positive, validate
from ..training import TensorData, evaluate, train_local
from .builders import TINY_CLASSIFIERS, build_classifier

logger = logging.getLogger(__name__)

INFO_FILE = "hfpfl_pretrain.json"
# fields that determine the weights; a cached repo is reused only if these match
_WEIGHT_FIELDS = (
    "model", "dataset", "epochs", "lr", "weight_decay", "batch_size", "image_size", "num_channels",
    "max_per_domain", "val_fraction", "seed", "max_steps", "augment_shift",
)
# fields that say *what* a backbone is (architecture, pool, input format); the others are the training budget
_IDENTITY_FIELDS = ("recipe_version", "model", "dataset", "image_size", "num_channels", "ood_version")
OOD_DATASET = "ood"
#: per-architecture recipe version (part of a stand-in's identity): bumping one retrains only that architecture's
#: cached stand-in. tiny-vit 3: 15 epochs instead of 5 (5 epochs left it at 11% on the pool).
RECIPE_VERSIONS = {"tiny-resnet": 2, "tiny-vit": 3}


@dataclass
class PretrainArguments:
    model: str = field(
        default="tiny-resnet",
        metadata={"help": "Architecture to pretrain: a built-in config name.", "choices": ["tiny-resnet", "tiny-vit"]},
    )
    dataset: str = field(
        default=OOD_DATASET,
        metadata={"help": "Pretraining pool: 'ood' (default: hfpfl.data.ood, classes and images no client holds, "
                          "as ImageNet is to CIFAR) or an hfpfl.data source whose 'public' split is used "
                          "(in-domain: the repo is named ...-indomain)."},
    )
    pool_size: int = option(12_000, "Samples of the 'ood' pool (class-balanced).", check=at_least(1))
    epochs: int = option(5, "Passes over the pool.", check=at_least(1))
    lr: float = option(3e-3, "Peak AdamW learning rate (cosine decay, 5%% warmup).", check=positive())
    weight_decay: float = option(0.05, "AdamW weight decay.", check=non_negative())
    batch_size: int = option(32, "Training batch size (last incomplete batch dropped).", check=at_least(1))
    image_size: int = option(28, "Input resolution the backbone is trained at.", check=at_least(8))
    num_channels: int = option(3, "Input channels (1 or 3).", check=one_of(1, 3))
    max_per_domain: int | None = option(None, "Cap per domain over all splits of the source (None: all); for quick "
                                        "runs.", check=at_least(1))
    val_fraction: float = option(0.1, "Fraction of the public pool held out to report accuracy (0: report train).",
                                 check=in_range(0, 1, high_open=True))
    seed: int = option(0, "Seed for data order, init and split: same seed, same weights.",
                       check=in_range(0, 2 ** 32, high_open=True))
    repo_id: str | None = field(
        default=None,
        metadata={"help": "Local Hub repo id to publish to (default: hfpfl/<model>-ood, or "
                          "hfpfl/<model>-<dataset>-indomain for a dataset's public split)."},
    )
    revision: str = field(default="main", metadata={"help": "Revision (branch name) to publish under."})
    cache_dir: str | None = field(
        default=None, metadata={"help": "Hub cache to publish to (default: huggingface_hub's HF_HUB_CACHE)."}
    )
    output_dir: str | None = field(
        default=None, metadata={"help": "Where to write the save_pretrained folder and results.json (default: temp)."}
    )
    force: bool = field(default=False, metadata={"help": "Retrain and republish even if the repo is already cached."})
    augment_shift: int = option(2, "Random translation augmentation of up to this many pixels (0: off).",
                                check=at_least(0))
    max_steps: int | None = option(None, "Stop after this many steps (tests, smoke runs).", check=at_least(1))
    num_threads: int = option(1, "torch intra-op threads (1 is fastest on shared CPUs).", check=at_least(1))

    def __post_init__(self):
        validate(self)  # the declared checks, for arguments built in Python (ensure_pretrained) too
        if self.model not in TINY_CLASSIFIERS:
            raise ValueError(f"--model must be a built-in config ({sorted(TINY_CLASSIFIERS)}), got {self.model!r}")
        if self.repo_id is None:
            self.repo_id = default_repo_id(self.model, self.dataset)
        hub.validate_repo_id(self.repo_id)
        hub.validate_revision(self.revision)

    def weight_config(self) -> dict:
        # recipe_version: bump when the training procedure changes, so stale cached weights are retrained
        cfg = {"recipe_version": RECIPE_VERSIONS.get(self.model, 2), **{k: getattr(self, k) for k in _WEIGHT_FIELDS}}
        if self.dataset == OOD_DATASET:
            from ..data.ood import OOD_VERSION

            cfg.update(pool_size=self.pool_size, ood_version=OOD_VERSION)
        return cfg


def default_repo_id(model: str, dataset: str = OOD_DATASET) -> str:
    """``hfpfl/<model>-ood`` for the out-of-domain pool; ``hfpfl/<model>-<dataset>-indomain`` for a dataset's own
    public split (a backbone that has seen the clients' domains says so in its name)."""
    if dataset == OOD_DATASET:
        return f"hfpfl/{model}-ood"
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", dataset).strip("-.") or "data"
    return f"hfpfl/{model}-{slug}-indomain"


#: The stand-in backbones the engine pretrains and publishes on first use (repo id -> PretrainArguments fields).
#: Budget on one CPU thread: about 1.5 min for the ResNet, 5-8 min for the ViT (15 epochs; measured numbers in
#: their model cards).
STANDINS: dict[str, dict] = {
    default_repo_id("tiny-resnet"): dict(model="tiny-resnet", dataset=OOD_DATASET),
    default_repo_id("tiny-vit"): dict(model="tiny-vit", dataset=OOD_DATASET, lr=2e-3, epochs=15),
}


def ensure_standin(repo_id: str, **overrides) -> str:
    """Pretrain + publish the stand-in ``repo_id`` (a key of :data:`STANDINS`) unless the cache already holds it with
    the same identity (architecture, pool, input format, recipe version): a cached stand-in trained with another
    budget (e.g. a quick one in a test cache) is reused as is."""
    if repo_id not in STANDINS:
        raise KeyError(f"{repo_id!r} is not a stand-in backbone; known: {sorted(STANDINS)}")
    return ensure_pretrained(repo_id, reuse_other_budget=True, **{**STANDINS[repo_id], **overrides})


def load_pretrain_info(repo_id: str, revision: str = "main", cache_dir: str | None = None) -> dict | None:
    """The ``hfpfl_pretrain.json`` of a cached repo (config + metrics), or None if absent."""
    try:
        snap = hub.require_cached(repo_id, "model", revision, cache_dir)
    except OSError:
        return None
    path = Path(snap) / INFO_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _data(args: PretrainArguments):
    from hfpfl.data.sources import load_source
    from hfpfl.data.transforms import to_model_inputs

    if args.dataset == OOD_DATASET:
        from hfpfl.data.ood import load_ood

        ds = load_ood("pretrain", args.pool_size)
    else:
        ds = load_source(args.dataset, split="public", seed=args.seed, max_per_domain=args.max_per_domain)
    label_names = ds.features["label"].names if hasattr(ds.features["label"], "names") else None
    ds = to_model_inputs(ds, image_size=args.image_size, num_channels=args.num_channels)
    ds = ds.select_columns(["pixel_values", "labels"])
    if args.val_fraction and args.val_fraction > 0 and len(ds) >= 20:
        split = ds.train_test_split(test_size=args.val_fraction, seed=args.seed)
        train, val = split["train"], split["test"]
    else:
        train, val = ds, None
    return train, val, label_names


def _accuracy(model, ds, device) -> float:
    if ds is None or len(ds) == 0:
        return float("nan")
    return evaluate(model, TensorData.from_dataset(ds), device=device)["accuracy"]


def random_shift(x: torch.Tensor, max_shift: int, generator: torch.Generator) -> torch.Tensor:
    """Translate each image by up to ``max_shift`` pixels (edge padding), drawn from ``generator``."""
    if max_shift <= 0:
        return x
    n, _, h, w = x.shape
    padded = torch.nn.functional.pad(x, (max_shift,) * 4, mode="replicate")
    offs = torch.randint(0, 2 * max_shift + 1, (n, 2), generator=generator)
    return torch.stack([padded[i, :, dy : dy + h, dx : dx + w] for i, (dy, dx) in enumerate(offs.tolist())])


def train_backbone(args: PretrainArguments, output_dir: str | os.PathLike) -> dict:
    """Train ``args.model`` on the public pool and ``save_pretrained`` into ``output_dir``. Returns the metrics.

    Single-process on purpose (no DDP wrapping): the model is tiny, and under ``accelerate launch`` only the main
    process trains (see :func:`ensure_pretrained`)."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm
    from transformers import get_cosine_schedule_with_warmup

    accelerator = Accelerator()
    torch.set_num_threads(args.num_threads)  # after it: accelerate's multi-CPU state resets the pool (Simulation)
    set_seed(args.seed)
    t0 = time.perf_counter()
    train, val, label_names = _data(args)
    num_labels = len(label_names) if label_names else int(train["labels"].max()) + 1
    set_seed(args.seed)
    model = build_classifier(args.model, num_labels, image_size=args.image_size, num_channels=args.num_channels)
    if label_names:
        model.config.id2label = dict(enumerate(label_names))
        model.config.label2id = {n: i for i, n in enumerate(label_names)}
    device = accelerator.device
    model.to(device).train()
    gen = torch.Generator().manual_seed(args.seed)
    aug_gen = torch.Generator().manual_seed(args.seed + 1)
    data = TensorData.from_dataset(train)
    if len(data) < args.batch_size:
        raise ValueError(f"public pool of {args.dataset!r} has {len(data)} samples < batch_size {args.batch_size}")
    steps = args.epochs * (len(data) // args.batch_size)
    if args.max_steps is not None:
        steps = min(steps, args.max_steps)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    sched = get_cosine_schedule_with_warmup(opt, max(1, int(0.05 * steps)), steps)
    bar = tqdm(total=steps, desc=f"pretrain {args.model} on {args.dataset}",
               disable=not accelerator.is_local_main_process)
    ema = {}

    def shifted_loss(m, batch):  # random-shift augmentation, then the model's own loss
        loss = m(pixel_values=random_shift(batch["pixel_values"], args.augment_shift, aug_gen),
                 labels=batch["labels"]).loss
        ema["loss"] = loss.item() if "loss" not in ema else 0.9 * ema["loss"] + 0.1 * loss.item()
        return loss

    def progress(step):
        bar.update(1)
        bar.set_postfix(loss=f"{ema['loss']:.3f}")

    t_train = time.perf_counter()
    step = train_local(model, data, opt, batch_size=args.batch_size, max_steps=steps, generator=gen, device=device,
                       loss_fn=shifted_loss, scheduler=sched, after_step=progress)["steps"]  # the engine's one loop
    loss_ema = ema.get("loss")
    bar.close()
    train_time = time.perf_counter() - t_train
    metrics = {
        "val_accuracy": _accuracy(model, val, device),
        "train_accuracy": _accuracy(model, train, device),
        "final_loss": loss_ema,
        "steps": step,
        "num_train": len(train),
        "num_val": 0 if val is None else len(val),
        "train_seconds": round(train_time, 2),
        "ms_per_step": round(1000 * train_time / max(step, 1), 2),
        "total_seconds": round(time.perf_counter() - t0, 2),
    }
    out_dir = Path(output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.cpu().save_pretrained(out_dir)
    info = {
        "config": args.weight_config(),
        "metrics": metrics,
        "repo_id": args.repo_id,
        "input": {"pixel_values": f"float32 [{args.num_channels},{args.image_size},{args.image_size}] in [-1, 1] "
                                  "= (x/255 - 0.5) / 0.5 (hfpfl.data.transforms.to_model_inputs)"},
        "versions": _versions(),
    }
    (out_dir / INFO_FILE).write_text(json.dumps(info, indent=2))
    (out_dir / "README.md").write_text(_model_card(args, metrics))
    return metrics


def _versions() -> dict:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def _model_card(args: PretrainArguments, metrics: dict) -> str:
    if args.dataset == OOD_DATASET:
        from ..data.ood import describe

        data = (f"the out-of-domain pool of `hfpfl.data.ood` ({args.pool_size} labelled samples of split "
                f"`pretrain`): {describe()}. It shares no class and no image with any client of the built-in "
                f"sources (digits: mnist, usps, mnistm, syn) -- the relation ImageNet has to CIFAR. Tested in "
                f"`tests/models/test_standins.py`.")
        tag = "out-of-domain"
    else:
        data = (f"the `public` split of `{args.dataset}`. **In-domain**: held by no client, but drawn from the clients' "
                f"own domains, so this backbone has already seen their feature shift (use only for ablations).")
        tag = "in-domain"
    return (
        f"---\nlibrary_name: transformers\ntags: [hfpfl, image-classification, stand-in, {tag}]\n---\n"
        f"# {args.repo_id}\n\nA stand-in for an ImageNet-pretrained `{args.model}` checkpoint where the Hub is out of "
        f"reach. Pretrained by `recipes/pretrain.py` (seed {args.seed}, {metrics['steps']} AdamW steps, batch "
        f"{args.batch_size}, {args.image_size}x{args.image_size}x{args.num_channels} inputs in [-1, 1]) on "
        f"{data}\n\nHeld-out pool accuracy: {metrics['val_accuracy']:.4f} ({metrics['num_val']} samples); train "
        f"accuracy: {metrics['train_accuracy']:.4f}; {metrics['train_seconds']} s of training.\n\n"
        f"Load it like any checkpoint: `AutoModelForImageClassification.from_pretrained(\"{args.repo_id}\", "
        f"num_labels=10, ignore_mismatched_sizes=True)` (a new head for your classes).\n"
    )


def _same_identity(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in _IDENTITY_FIELDS)


def ensure_pretrained(repo_id: str | None = None, reuse_other_budget: bool = False, **kwargs) -> str:
    """Return ``repo_id`` of a tiny pretrained backbone in the local Hub cache, training and publishing it first if it
    is missing or was trained with a different config (or ``force=True``). ``kwargs`` are
    :class:`PretrainArguments` fields. Under ``accelerate launch`` the main process trains and the others wait, then
    find it cached.

    >>> model = build_classifier(ensure_pretrained("hfpfl/tiny-resnet-ood"), num_labels=10)

    ``reuse_other_budget``: also reuse a cached repo trained on the same pool/architecture with other budget fields
    (epochs, steps, lr...).
    """
    from accelerate import PartialState

    args = PretrainArguments(repo_id=repo_id, **kwargs)
    with PartialState().main_process_first():
        info = load_pretrain_info(args.repo_id, args.revision, args.cache_dir)
        if info is not None and not args.force:
            if info.get("config") == args.weight_config():
                logger.info("%s@%s already pretrained with this config; reusing", args.repo_id, args.revision)
                return args.repo_id
            if reuse_other_budget and _same_identity(info.get("config", {}), args.weight_config()):
                logger.info("%s@%s already pretrained (same pool and architecture, another budget); reusing",
                            args.repo_id, args.revision)
                return args.repo_id
            logger.warning("%s@%s was pretrained with another config %s; retraining with %s",
                           args.repo_id, args.revision, info.get("config"), args.weight_config())
        if not PartialState().is_main_process:  # main published it while we waited; a config race is not retried
            return args.repo_id
        with tempfile.TemporaryDirectory() as tmp:
            out = args.output_dir or tmp
            metrics = train_backbone(args, out)
            snap = hub.push_folder_to_cache(out, args.repo_id, args.revision, cache_dir=args.cache_dir)
            if args.output_dir:
                results = {"repo_id": args.repo_id, "revision": args.revision, "snapshot": snap,
                           "config": dataclasses.asdict(args), **metrics}
                Path(args.output_dir, "results.json").write_text(json.dumps(results, indent=2))
        logger.info("published %s@%s: %s", args.repo_id, args.revision, metrics)
    return args.repo_id
