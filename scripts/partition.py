#!/usr/bin/env python
"""Build a federated dataset (source + partition scheme), save it to disk, print and plot its label distribution.

Examples::

    python scripts/partition.py --output_dir out/digits_fs                       # digits, feature_shift, 8 clients
    python scripts/partition.py --dataset mnist --partition dirichlet --alpha 0.1 --num_clients 20 --output_dir out/d
    python scripts/partition.py --dataset digits --degradations noise,rotation --output_dir out/dn
    python scripts/partition.py --config partition.yaml                          # any flag, from YAML/JSON
    python scripts/partition.py --vqa_split scene --image_size 32 --output_dir out/vqa_scene    # FedDAT easy-vqa

Writes to ``--output_dir``:

* ``dataset/``: one ``datasets.DatasetDict`` (``save_to_disk``) with splits ``client_{i}_train``, ``client_{i}_test``
  (``client_{i}_val``), held-out new clients continuing the ids, ``global_test`` and ``public``; all in model-input
  format (``pixel_values`` float32 [C,H,W], ``labels``, ``domain``) + ``federated.json``. Reload with
  ``hfpfl.data.FederatedData.load_from_disk(output_dir + "/dataset")``.
* ``summary.txt``: per-client sizes and label histograms (also printed).
* ``label_distribution.png``: heatmap, clients x labels (train counts).
* ``partition_args.json``: the resolved arguments.

``--push_to_hub_cache REPO_ID`` publishes ``dataset/`` to the local Hub cache as a dataset repo
(``hfpfl.hub.push_folder_to_cache``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@dataclass
class PartitionScriptArguments:
    output_dir: str = field(metadata={"help": "Where to write dataset/, summary.txt and label_distribution.png."})
    seed: int = field(default=0, metadata={"help": "Seed for splits, partitions and per-client splits."})
    push_to_hub_cache: str | None = field(
        default=None, metadata={"help": "Optional repo id: publish dataset/ to the local Hub cache (repo_type=dataset)."}
    )
    num_threads: int = field(default=1, metadata={"help": "torch threads."})
    vqa_split: str | None = field(default=None, metadata={
        "help": "Write FedDAT's easy-vqa benchmark instead: function | scene | domain (hfpfl.data.vqa; the data "
                "flags above are then unused)."})
    vqa_train_per_client: int = field(default=300, metadata={"help": "--vqa_split: training questions per client."})
    vqa_test_per_client: int = field(default=200, metadata={"help": "--vqa_split: test questions per client."})
    overwrite_output_dir: bool = field(default=False, metadata={
        "help": "Replace a federated dataset already saved in --output_dir (files this script did not write are kept)."})


SCRIPT_FILES = ("summary.txt", "label_distribution.png", "partition_args.json")


def plot_label_heatmap(fed, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hist = fed.label_histograms("train")
    ids = [f"{c.client_id}{'*' if c in fed.new_clients else ''} {c.domain or ''}".strip()
           for c in fed.clients + fed.new_clients]
    fig, ax = plt.subplots(figsize=(1.0 + 0.45 * fed.num_labels, 1.0 + 0.3 * len(ids)))
    im = ax.imshow(hist, aspect="auto", cmap="viridis")
    ax.set_xticks(range(fed.num_labels), fed.label_names, rotation=90 if fed.num_labels > 12 else 0)
    ax.set_yticks(range(len(ids)), ids)
    ax.set_xlabel("label")
    ax.set_ylabel("client (* = held-out)")
    if hist.size <= 400:
        for (r, c), v in __import__("numpy").ndenumerate(hist):
            ax.text(c, r, str(v), ha="center", va="center", fontsize=7, color="w" if v < hist.max() / 2 else "k")
    fig.colorbar(im, ax=ax, label="train samples")
    ax.set_title("label distribution per client")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse(argv: list[str]):
    """(DataArguments, PartitionScriptArguments) from flags and/or ``--config file.yaml`` (flags override it).
    Every user error is a one-line ValueError that names the option."""
    import argparse

    from hfpfl.arguments import load_config_file, make_parser
    from hfpfl.data import DataArguments

    types = (DataArguments, PartitionScriptArguments)
    parser = make_parser(types, prog="scripts/partition.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None, help="YAML/JSON file of options; command-line flags override it.")
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    if known.config:
        values = load_config_file(known.config, types)
        parser.set_defaults(**values)
        for action in parser._actions:  # a required option given in the file is no longer required on the line
            if action.dest in values:
                action.required = False
    data_args, args, _extra, remaining = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if remaining:
        import difflib
        known_flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
        close = difflib.get_close_matches(remaining[0].split("=")[0], known_flags, n=1)
        raise ValueError(f"unknown option {remaining[0]!r}.{' Did you mean ' + close[0] + '?' if close else ''} "
                         f"Run with --help to list every option.")
    return data_args, args


def check_output_dir(output_dir: str, overwrite: bool) -> None:
    """The output-folder rule of every hfpfl entry point, for a saved federated dataset."""
    from pathlib import Path

    from hfpfl.runtime import check_output_dir as check

    check(output_dir, overwrite=False, resume=True)  # a file, an uncreatable path
    ds = Path(output_dir) / "dataset"
    if ds.exists() and not overwrite:
        raise FileExistsError(f"--output_dir {output_dir!r} already holds a federated dataset (dataset/); pass "
                              f"--overwrite_output_dir to replace it, or another --output_dir")
    if ds.exists() and not (ds / "federated.json").is_file() and any(ds.iterdir()) and not \
            (ds / "dataset_dict.json").is_file():
        raise FileExistsError(f"--output_dir {output_dir!r} holds a dataset/ folder this script did not write; pass "
                              f"another --output_dir")


def main(argv: list[str] | None = None) -> int:
    import datasets

    from hfpfl.cli import USER_ERRORS, fail

    datasets.disable_progress_bars()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        data_args, args = parse(argv)
        check_output_dir(args.output_dir, args.overwrite_output_dir)
        return run(data_args, args)
    except USER_ERRORS as e:
        fail(e)


def run(data_args, args) -> int:
    import shutil

    import torch

    from hfpfl.data import build_federated_dataset

    torch.set_num_threads(args.num_threads)
    t0 = time.time()
    if args.vqa_split:
        from hfpfl.data.vqa import SPLITS, vqa_benchmark
        from hfpfl.models.vqa import vqa_tokenizer

        if args.vqa_split not in SPLITS:
            raise ValueError(f"--vqa_split must be one of {', '.join(SPLITS)}, got {args.vqa_split!r}")
        fed = vqa_benchmark(args.vqa_split, tokenizer=vqa_tokenizer(), seed=args.seed, train_per_client=args.vqa_train_per_client,
                            test_per_client=args.vqa_test_per_client, image_size=data_args.image_size)
    else:
        fed = build_federated_dataset(data_args, seed=args.seed)  # before anything is written: bad input writes nothing
    build_s = time.time() - t0
    summary = fed.summary()
    print(summary)
    print(f"built in {build_s:.1f}s")
    try:
        os.makedirs(args.output_dir, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--output_dir {args.output_dir!r} cannot be created: {e.strerror or e}") from None
    dataset_dir = os.path.join(args.output_dir, "dataset")
    resolved = {"data": dataclasses.asdict(data_args), **dataclasses.asdict(args)}
    tmp_dir = os.path.join(args.output_dir, ".dataset.tmp")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    fed.save_to_disk(tmp_dir, metadata=resolved)  # written aside, moved into place when complete
    if os.path.exists(dataset_dir):
        shutil.rmtree(dataset_dir)
    os.replace(tmp_dir, dataset_dir)
    with open(os.path.join(args.output_dir, "summary.txt"), "w") as f:
        f.write(summary + "\n")
    with open(os.path.join(args.output_dir, "partition_args.json"), "w") as f:
        json.dump(resolved, f, indent=2)
    png = os.path.join(args.output_dir, "label_distribution.png")
    plot_label_heatmap(fed, png)
    print(f"saved {dataset_dir} and {png}")
    if args.push_to_hub_cache:
        from hfpfl.hub import push_folder_to_cache

        snap = push_folder_to_cache(dataset_dir, args.push_to_hub_cache, revision="main", repo_type="dataset")
        print(f"pushed to local Hub cache: {args.push_to_hub_cache} (dataset) -> {snap}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
