"""Scale: peak memory of one round in which every client trains and keeps a personal LoRA adapter.

    python scripts/bench_scale_memory.py --clients 1000 10000
Runs ``local`` (every client trains and keeps its own LoRA adapter, BatchNorms and head; the backbone is shared and
frozen) on the tiny ResNet with peft LoRA, one training round over every client, each configuration in its own
process. Prints s/round, the per-client private state, the client store's total (in memory + spilled to disk), and
the process's peak RSS (imports included). Client states beyond ``--max_state_mb`` spill to
``<output_dir>/client_states/*.safetensors``: peak RSS should stay flat in the number of clients.

The offline digits pool is too small for 10,000 distinct clients: the federation is built once with ``--distinct``
clients (1,000 by default) and client ``i`` trains on split ``i % distinct`` (its own model state, seeds, optimizer).
"""
import argparse
import dataclasses
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def worker(a) -> dict:
    import torch
    torch.set_num_threads(1)
    from hfpfl.config import RunArguments
    from hfpfl.data import DataArguments, build_federated_dataset
    from hfpfl.federated.comm import tensor_bytes
    from hfpfl.federated.engine import Simulation

    n, distinct = a.clients[0], min(a.clients[0], a.distinct)
    data_args = DataArguments(dataset="digits", partition="iid", num_clients=distinct, max_per_domain=None,
                              image_size=16, min_partition_size=4, test_fraction=0.25)
    fed = build_federated_dataset(data_args, seed=0)
    clients = [dataclasses.replace(fed.clients[i % distinct], client_id=i) for i in range(n)]
    fed = dataclasses.replace(fed, clients=clients, new_clients=[])
    data_args = dataclasses.replace(data_args, num_clients=n)
    # the run's folder (10,000 clients spill ~800 MB of client states there) is removed when the worker ends
    out = tempfile.mkdtemp(prefix=f"hfpfl_scale_{n}_")
    try:
        run = RunArguments(method=a.method, model="tiny-resnet", adapter="lora", lora_r=4, num_rounds=2,
                           batch_size=16, checkpoint_every=0, progress=False, output_dir=out, overwrite_output_dir=True,
                           random_backbone_ok=True, eval_every=10**6, max_state_mb=a.max_state_mb,
                           vectorize=a.vectorize, vector_chunk_mb=a.vector_chunk_mb, local_steps=1,
                           data_cache_mb=a.data_cache_mb)
        sim = Simulation(run, data_args, fed_data=fed)
        model_bytes = tensor_bytes(sim.model_state)
        t = time.perf_counter()
        sim.step()  # one training round over every client (no evaluation: eval_every is past the run)
        dt = time.perf_counter() - t
        store = sim.store
        spilled = len(store._spilled)
        total = store.nbytes()
        return {"clients": n, "s_per_round": dt, "peak_rss_gb": rss_gb(), "model_mb": model_bytes / 2**20,
                "private_kb_per_client": total / max(1, len(store)) / 1024, "store_total_mb": total / 2**20,
                "store_in_memory_mb": store.in_memory_bytes / 2**20, "clients_spilled": spilled,
                "train_loss": sim.history[-1].get("train_loss")}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, nargs="+", default=[1000, 10000])
    p.add_argument("--distinct", type=int, default=1000, help="distinct client data splits (see above)")
    p.add_argument("--method", default="local", help="a personal method: local (default), fedper, ditto, ...")
    p.add_argument("--max_state_mb", type=float, default=64.0, help="client state kept in memory (the rest spills)")
    p.add_argument("--vectorize", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--vector_chunk_mb", type=float, default=64.0, help="stacked client state per vectorized chunk "
                   "(64 = hfpfl's default on the CPU)")
    p.add_argument("--data_cache_mb", type=float, default=1024.0, help="client splits cached as tensors (LRU cap; "
                   "the engine's default 1024)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        print(json.dumps(worker(a)))
        return
    print(f"{a.method} on tiny-resnet + LoRA r=4, 1 round (1 local step per client), --max_state_mb {a.max_state_mb}, "
          f"--vector_chunk_mb {a.vector_chunk_mb}, --data_cache_mb {a.data_cache_mb}, load average {os.getloadavg()[0]:.2f}")
    print(f"{'clients':>8} {'s/round':>8} {'peak RSS GB':>11} {'KB/client':>9} {'store MB':>9} {'in memory MB':>12} "
          f"{'spilled':>8}")
    for n in a.clients:
        cmd = [sys.executable, __file__, "--worker", "--clients", str(n), "--distinct", str(a.distinct),
               "--method", a.method, "--max_state_mb", str(a.max_state_mb), "--vectorize", a.vectorize,
               "--vector_chunk_mb", str(a.vector_chunk_mb), "--data_cache_mb", str(a.data_cache_mb)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"{n} clients failed:\n{r.stderr[-3000:]}")
        x = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"{n:>8} {x['s_per_round']:>8.1f} {x['peak_rss_gb']:>11.2f} {x['private_kb_per_client']:>9.1f} "
              f"{x['store_total_mb']:>9.1f} {x['store_in_memory_mb']:>12.1f} {x['clients_spilled']:>8}", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
