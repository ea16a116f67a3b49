#!/usr/bin/env python
"""Build a federated dataset (source + partition scheme), save it to disk, print and plot its label distribution.

Examples::

    python scripts/partition.py --output_dir out/digits_fs                       # digits, feature_shift, 8 clients
    python scripts/partition.py --dataset mnist --partition dirichlet --alpha 0.1 --num_clients 20 --output_dir out/d
    python scripts/partition.py --dataset digits --degradations noise,rotation --output_dir out/dn
    python scripts/partition.py --config partition.yaml                          # any flag, from YAML/JSON

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


def main(argv: list[str] | None = None) -> int:
    from transformers import HfArgumentParser

    import datasets

    from hfpfl.data import DataArguments, build_federated_dataset

    datasets.disable_progress_bars()

    parser = HfArgumentParser((DataArguments, PartitionScriptArguments), description=__doc__.split("\n\n")[0])
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) == 2 and argv[0] == "--config":
        path = argv[1]
        data_args, args = (parser.parse_yaml_file(path) if path.endswith((".yaml", ".yml"))
                           else parser.parse_json_file(path))
    else:
        data_args, args = parser.parse_args_into_dataclasses(args=argv)

    import torch

    torch.set_num_threads(args.num_threads)
    os.makedirs(args.output_dir, exist_ok=True)
    t0 = time.time()
    fed = build_federated_dataset(data_args, seed=args.seed)
    build_s = time.time() - t0
    summary = fed.summary()
    print(summary)
    print(f"built in {build_s:.1f}s")
    dataset_dir = os.path.join(args.output_dir, "dataset")
    resolved = {"data": dataclasses.asdict(data_args), **dataclasses.asdict(args)}
    fed.save_to_disk(dataset_dir, metadata=resolved)
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
