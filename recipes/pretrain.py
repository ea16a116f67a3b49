#!/usr/bin/env python
"""Pretrain a tiny backbone offline and publish it to the local Hub cache.

    python recipes/pretrain.py                              # tiny-resnet on the out-of-domain pool -> hfpfl/tiny-resnet-ood
    python recipes/pretrain.py --model tiny-vit --lr 2e-3   # -> hfpfl/tiny-vit-ood
    python recipes/pretrain.py --dataset digits             # in-domain ablation -> hfpfl/tiny-resnet-digits-indomain
    python recipes/pretrain.py --output_dir runs/pretrain --force
    python recipes/pretrain.py config.yaml                  # flags from a YAML/JSON file (HfArgumentParser)

Then, anywhere (also under HF_HUB_OFFLINE=1): ``build_classifier("hfpfl/tiny-resnet-ood", num_labels=10)``.
Idempotent: a repo already cached with the same training config is not retrained (use --force).
"""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hfpfl.cli import fail  # noqa: E402
from hfpfl.arguments import make_parser  # noqa: E402
from hfpfl.models.pretrained import PretrainArguments, ensure_pretrained, load_pretrain_info  # noqa: E402

RECIPE_OPTIONS = PretrainArguments  # this recipe's options (docs/reference/options.md lists them)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    # hfpfl's parser: a bad value (the declared checks of PretrainArguments) is one line, exit code 2, nothing written
    parser = make_parser([PretrainArguments], prog="recipes/pretrain.py", description=__doc__.split("\n")[1])
    try:
        if len(argv) == 1 and argv[0].endswith((".yaml", ".yml")):
            (args,) = parser.parse_yaml_file(argv[0])
        elif len(argv) == 1 and argv[0].endswith(".json"):
            (args,) = parser.parse_json_file(argv[0])
        else:
            (args,) = parser.parse_args_into_dataclasses(args=argv)
    except (ValueError, OSError) as e:
        fail(e)
    kwargs = {k: v for k, v in vars(args).items() if k != "repo_id"}
    repo_id = ensure_pretrained(args.repo_id, **kwargs)
    info = load_pretrain_info(repo_id, args.revision, args.cache_dir) or {}
    m = info.get("metrics", {})
    print(
        f"{repo_id}@{args.revision}: pool held-out accuracy {m.get('val_accuracy', float('nan')):.4f} "
        f"(train {m.get('train_accuracy', float('nan')):.4f}), {m.get('steps')} steps, "
        f"{m.get('ms_per_step')} ms/step, {m.get('total_seconds')} s"
    )
    return info


if __name__ == "__main__":
    main()
