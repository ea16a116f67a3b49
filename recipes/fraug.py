"""FRAug (federated representation augmentation, ICCV 2023) on the Digits feature-shift benchmark with degraded
domains: one domain per client (mnist, usps, mnistm, syn and their noisy copies; add +rotation and
--num_clients 12 for the rotated ones too).

    accelerate launch recipes/fraug.py --output_dir outputs/fraug
    accelerate launch recipes/fraug.py --use_rtnet false --use_ema false     # ablation: generator only
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 recipes/fraug.py ...
    python recipes/fraug.py --help

Defaults are a CPU-scale design (16 px, 200 images per domain, T = 10 local steps, B = 32, SGD lr 0.01,
momentum 0.5, d_z = 32, eta_g = eta_m = 0.005, alpha = 1, beta = 1.5): a few minutes on 2 cores (measured: 351 s wall,
297 s of simulation, with OMP_NUM_THREADS=1 on a 2-core box at load average ~8). Besides the results
contract (config.yaml, results.json, metrics.jsonl, curves), writes fraug_embeddings.png: a 2-D PCA of each client's
real embeddings next to the generated ones (v_hat, u_hat).
"""
from hfpfl.cli import run_recipe

DEFAULTS = {"dataset": "digits+noise", "num_clients": 8, "max_per_domain": 200, "image_size": 16,
            "num_rounds": 20, "local_steps": 10, "batch_size": 32, "lr": 0.01, "momentum": 0.5}
# no output_dir default: outputs/fraug-<timestamp>, the one output-folder rule (hfpfl.runtime)

def main(argv=None):
    return run_recipe(method="fraug", argv=argv, defaults=DEFAULTS, script=None if argv is None else "recipes/fraug.py")


if __name__ == "__main__":
    main()
