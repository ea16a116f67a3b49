"""Scale: peak memory when simulating many clients that each keep a personal LoRA adapter.

    python scripts/bench_scale_memory.py --clients 1000
Runs `local` (every client trains and keeps its own LoRA adapter + head; the backbone is shared and frozen) on
tiny-vit with peft LoRA. Prints the model size, the per-client private state, the client store's total, and the
process's peak RSS growth, against what 1,000 model copies would need.
"""
import argparse
import os
import resource
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--model", default="tiny-vit")
    p.add_argument("--method", default="local", help="local (personal adapters) or fedper/ditto/...")
    a = p.parse_args()
    torch.set_num_threads(1)

    from hfpfl.config import RunArguments
    from hfpfl.data import DataArguments, build_federated_dataset
    from hfpfl.federated.comm import tensor_bytes
    from hfpfl.federated.engine import Simulation

    data_args = DataArguments(dataset="digits", partition="iid", num_clients=a.clients, max_per_domain=None,
                              min_partition_size=4, test_fraction=0.25)
    fed = build_federated_dataset(data_args, seed=0)
    run = RunArguments(method=a.method, model=a.model, adapter="lora", lora_r=4, num_rounds=1, batch_size=16,
                       checkpoint_every=0, progress=True, output_dir="outputs/bench_scale", overwrite_output_dir=True)
    sim = Simulation(run, data_args, fed_data=fed)
    model_bytes = tensor_bytes(sim.model_state)
    before = rss_mb()
    t = time.perf_counter()
    state = sim.algorithm.init_server_state()
    state, _ = sim.run_round(1, state)
    dt = time.perf_counter() - t
    after = rss_mb()
    per_client = sim.store.nbytes() / max(1, len(sim.store))
    print(f"{a.clients} clients with personal LoRA adapters ({a.method}, {a.model}), one round in {dt:.1f} s")
    print(f"  model (one instance)        : {model_bytes / 2**20:8.2f} MiB")
    print(f"  private state per client    : {per_client / 2**10:8.2f} KiB")
    print(f"  client store, all clients   : {sim.store.nbytes() / 2**20:8.2f} MiB  ({len(sim.store)} clients)")
    print(f"  {a.clients} model copies would be : {a.clients * model_bytes / 2**20:8.2f} MiB")
    data_bytes = sum(t.pixel_values.numel() * 4 + t.labels.numel() * 8 for t in sim._tensors.values())
    print(f"  client data as tensors      : {data_bytes / 2**20:8.2f} MiB")
    print(f"  peak RSS before / after     : {before:8.1f} / {after:.1f} MiB (growth {after - before:.1f} MiB)")


if __name__ == "__main__":
    main()
