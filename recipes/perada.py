"""PerAda: personal residual adapters + a global adapter distilled on unlabelled out-of-domain data
(docs/methods/perada.md).

    python recipes/perada.py                                   # embedded Digits, out-of-domain tiny ResNet stand-in
    python recipes/perada.py --config recipes/configs/perada_dirichlet.yaml --use_kd false   # PerAda w/o KD
    python recipes/perada.py --eval_corrupted noise:client --push_adapters_to_hub_cache me/perada-global
    python recipes/perada.py --model hfpfl/tiny-vit-ood --adapter lora       # PerAda on the tiny ViT stand-in
    accelerate launch recipes/perada.py --help                 # every option, PerAda's own included
"""
from hfpfl.cli import run_recipe

DEFAULTS = {"adapter": "residual", "model": "hfpfl/tiny-resnet-ood", "momentum": 0.0, "num_rounds": 5}
# PerAda code: plain SGD, no momentum

def main(argv=None):
    return run_recipe(method="perada", argv=argv, defaults=DEFAULTS, name="perada",  # outputs/perada-<timestamp>
                      script=None if argv is None else "recipes/perada.py")


if __name__ == "__main__":
    main()
