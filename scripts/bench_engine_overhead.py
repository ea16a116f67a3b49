"""Engine overhead: a FedAvg run through hfpfl vs a bare PyTorch loop doing the same local steps on the same
data and model (load global weights, fresh SGD, E local epochs, sample-weighted average).

    python scripts/bench_engine_overhead.py --rounds 5 --clients 8
Prints both times and the ratio (goal <= 1.10). Evaluation and checkpointing are excluded from both.
"""
import argparse
import copy
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402


def bare_fedavg(model, clients, rounds, epochs, bs, lr, momentum, seed):
    global_state = copy.deepcopy(model.state_dict())
    for r in range(1, rounds + 1):
        states, weights = [], []
        for cid, data in enumerate(clients):
            model.load_state_dict(global_state)
            opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
            g = torch.Generator().manual_seed(seed * 1000 + r * 100 + cid)
            model.train()
            x_all, y_all = data
            for _ in range(epochs):
                order = torch.randperm(len(y_all), generator=g)
                for s in range(0, len(y_all), bs):
                    idx = order[s:s + bs]
                    if len(idx) < 2:
                        continue
                    opt.zero_grad()
                    model(pixel_values=x_all[idx], labels=y_all[idx]).loss.backward()
                    opt.step()
            states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
            weights.append(len(y_all))
        total = sum(weights)
        global_state = {k: (sum(s[k].double() * w for s, w in zip(states, weights)) / total).to(states[0][k].dtype)
                        if torch.is_floating_point(states[0][k]) else states[0][k] for k in states[0]}
    return global_state


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--model", default="tiny-resnet")
    p.add_argument("--repeats", type=int, default=2, help="take the best of N timings of each")
    a = p.parse_args()
    torch.set_num_threads(1)

    from hfpfl.config import RunArguments
    from hfpfl.data import DataArguments, build_federated_dataset
    from hfpfl.federated.engine import Simulation
    from hfpfl.training import TensorData
    from hfpfl.models import build_classifier

    data_args = DataArguments(num_clients=a.clients)
    fed = build_federated_dataset(data_args, seed=0)
    clients = [(t.pixel_values, t.labels) for t in (TensorData.from_dataset(c.train) for c in fed.clients)]
    run = RunArguments(method="fedavg", model=a.model, num_rounds=a.rounds, local_epochs=a.epochs, batch_size=32,
                       lr=0.05, momentum=0.9, checkpoint_every=0, progress=False,
                       output_dir="outputs/bench_overhead", overwrite_output_dir=True)

    engine_times, bare_times = [], []
    for _ in range(a.repeats):
        sim = Simulation(run, data_args, fed_data=fed)
        for c in range(sim.num_clients):
            sim.train_data(c)  # tensors cached, as the bare loop's are
        state = sim.algorithm.init_server_state()
        t = time.perf_counter()
        for r in range(1, a.rounds + 1):
            state, _ = sim.run_round(r, state)
        engine_times.append(time.perf_counter() - t)

        torch.manual_seed(0)
        model = build_classifier(a.model, fed.num_labels, fed.image_size, fed.num_channels)
        t = time.perf_counter()
        bare_fedavg(model, clients, a.rounds, a.epochs, 32, 0.05, 0.9, 0)
        bare_times.append(time.perf_counter() - t)

    e, b = min(engine_times), min(bare_times)
    steps = sum((len(y) + 31) // 32 for _, y in clients) * a.rounds * a.epochs
    print(f"FedAvg {a.rounds} rounds x {a.clients} clients x {a.epochs} epoch(s), {a.model}, ~{steps} local steps")
    print(f"  hfpfl engine : {e:7.2f} s   (all timings: {', '.join(f'{x:.2f}' for x in engine_times)})")
    print(f"  bare PyTorch : {b:7.2f} s   (all timings: {', '.join(f'{x:.2f}' for x in bare_times)})")
    print(f"  ratio        : {e / b:7.3f}   (goal <= 1.10)")


if __name__ == "__main__":
    main()
