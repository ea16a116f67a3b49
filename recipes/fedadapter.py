"""Parallel adapters for FL (Elvebakken et al.; docs/methods/fedadapter.md): a frozen pretrained ResNet with
1x1 adapters in parallel to its 3x3 convs; only adapters, their BNs and the head train and travel.
The FL algorithm is --method fedavg (default) | fedprox | fednova; --adapter none gives the full-model baseline.

    python recipes/fedadapter.py                                                  # embedded Digits, FedAvg
    python recipes/fedadapter.py --config recipes/configs/fedadapter_cross_silo.yaml --method fednova
    python recipes/fedadapter.py --config recipes/configs/fedadapter_cross_device.yaml --method fedprox --mu 0.01
"""
from hfpfl.cli import run_recipe

DEFAULTS = {"adapter": "parallel", "model": "hfpfl/tiny-resnet-ood", "num_rounds": 5}

def main(argv=None):
    return run_recipe(method="fedavg", argv=argv, defaults=DEFAULTS, name="fedadapter",  # outputs/fedadapter-<timestamp>
                      script=None if argv is None else "recipes/fedadapter.py")


if __name__ == "__main__":
    main()
