"""FedAvg on the embedded Digits benchmark (or any dataset / model via flags).

    accelerate launch recipes/fedavg.py --num_rounds 10 --output_dir outputs/fedavg
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 recipes/fedavg.py ...
    python recipes/fedavg.py --help
"""
from hfpfl.cli import run_recipe

def main(argv=None):
    return run_recipe(method="fedavg", argv=argv, script=None if argv is None else "recipes/fedavg.py")


if __name__ == "__main__":
    main()
