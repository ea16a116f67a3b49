"""``--num_processes auto|N`` (default ``auto``): a recipe started with plain ``python`` shards its clients over
several processes (the same numbers as one process: the float64 upload sums are exact in practice; README "Several
processes and machines"). Under ``accelerate launch`` (or torchrun) the launcher's own settings win and nothing is
launched again.

How the processes start: on the CPU the recipe forks itself after parsing its options (:func:`fork_workers`: the
imports, ~10-16 s of a run's start here, are not paid again; each process is one rank of a gloo process group that
accelerate's ``PartialState`` sets up from the usual ``RANK``/``WORLD_SIZE``/``MASTER_*`` variables); with CUDA GPUs
it launches itself through accelerate's launcher (:func:`relaunch`; CUDA cannot be forked), one process per GPU.

``auto`` (:func:`decide`, a pure function of what it is given) uses several processes where it pays:
* capacity: on a machine with CUDA GPUs one process per GPU; on the CPU one per core that is idle now (usable cores
  minus the cores other work keeps busy over half a second, :func:`busy_cores`, rounded), at most one per client
  trained each round;
* and the run is long enough to amortize the start-up: at least :data:`MIN_CLIENT_UPDATES` client updates
  (rounds x clients per round). Tiny runs (the README's 15-second first run, the tests) stay in one process.
Measured on a 2-core box (CHANGELOG.md): two processes beat one only when the second core is idle; with it
busy (another job), two processes were slower than one, which is why ``auto`` counts idle cores, not cores.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time


#: ``--num_processes`` when neither the command line, a ``--config`` file nor ``HFPFL_NUM_PROCESSES`` sets it
DEFAULT_NUM_PROCESSES = "auto"
#: the environment variable that overrides that default (``1``, ``2``, ``auto``); the command-line flag wins
ENV_NUM_PROCESSES = "HFPFL_NUM_PROCESSES"

#: set together by each of accelerate's launchers (simple, multi-GPU/CPU, SageMaker) for the processes it starts
#: (accelerate/utils/launch.py); a user may export any one of them (ACCELERATE_MIXED_PRECISION, say) to configure
#: ``Accelerator`` without launching anything, but not normally all of them
_ACCELERATE_LAUNCH_VARS = ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_DYNAMO_BACKEND", "ACCELERATE_DYNAMO_MODE",
                           "ACCELERATE_DYNAMO_USE_FULLGRAPH", "ACCELERATE_DYNAMO_USE_DYNAMIC")


def env_num_processes() -> dict:
    """``{"num_processes": value}`` from ``HFPFL_NUM_PROCESSES`` when it is set (else ``{}``), checked."""
    value = os.environ.get(ENV_NUM_PROCESSES, "").strip()
    if not value:
        return {}
    if not (value == "auto" or (value.isdigit() and int(value) >= 1)):
        raise ValueError(f"{ENV_NUM_PROCESSES} must be auto or a whole number >= 1, got {value!r}; unset it or set "
                         f"e.g. {ENV_NUM_PROCESSES}=2 (--num_processes on the command line wins over it)")
    return {"num_processes": value}


def check_spec(spec: str) -> None:
    if not (spec == "auto" or (str(spec).isdigit() and int(spec) >= 1)):
        raise ValueError(f"--num_processes must be auto or a whole number >= 1, got {spec!r}")


def launched() -> bool:
    """Started by a launcher already: torchrun or a multi-process ``accelerate launch`` (``LOCAL_RANK``, set by
    torch's elastic agent for each process), or accelerate's one-process launcher (the variables it sets together
    for its child). A variable a user exports alone (``ACCELERATE_MIXED_PRECISION=no``) does not count."""
    return "LOCAL_RANK" in os.environ or all(k in os.environ for k in _ACCELERATE_LAUNCH_VARS)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def resolve(spec: str, clients_per_round: int | None = None, *, cores: int | None = None,
            busy: float | None = None, gpus: int | None = None) -> int:
    """How many processes ``--num_processes spec`` means here (``cores``, ``busy``, ``gpus``: for tests)."""
    check_spec(spec)
    if spec != "auto":
        return int(spec)
    if gpus is None:
        import torch
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus:
        n = gpus
    else:
        cores = usable_cores() if cores is None else cores
        busy = busy_cores() if busy is None and cores > 1 else (busy or 0.0)
        n = int(cores - busy + 0.5)
    if clients_per_round:
        n = min(n, clients_per_round)
    return max(1, n)


#: ``auto`` uses one process for a run with fewer client updates (rounds x clients trained per round) than this:
#: forking and joining a gloo group, each process building the data again and the per-round exchange cost ~2-4 s
#: here (CHANGELOG.md), which a client update of the smallest built-in models (~0.1-0.3 s) repays after
#: about 20 updates shared between two processes
MIN_CLIENT_UPDATES = 20


def decide(spec: str, clients_per_round: int | None, num_rounds: int, *, cores: int, busy: float,
           gpus: int, update_cost: float = 1.0) -> tuple[int, str]:
    """``(processes, why)`` for ``--num_processes spec``: a pure function of its arguments (the run's clients per
    round and rounds, the usable cores, the cores other work keeps busy now, the CUDA GPUs), so that the choice can be
    logged, tested and checked. The numbers a run computes do not depend on it (the float64 sums of uploads are
    exact in practice, so their order across processes does not show: README "Several processes and machines")."""
    check_spec(spec)
    if spec != "auto":
        return int(spec), "set by --num_processes"
    busy = round(busy, 2)   # the value printed is the value used
    if gpus:
        n, capacity = gpus, f"{gpus} GPU{'s' if gpus > 1 else ''}"
    else:
        n = max(0, int(cores - busy + 0.5))
        capacity = f"{n} idle core{'s' if n != 1 else ''} ({cores} usable, {busy:.2f} busy)"
    if clients_per_round:
        n = min(n, clients_per_round)
    if n < 2:
        return 1, capacity + (f", {clients_per_round} client per round" if clients_per_round == 1 else "")
    # ``update_cost``: what one client update of the method is worth in small-model updates (Algorithm.
    # client_update_cost; FedBiP's concept training + synthesis of one client: minutes, not a tenth of a second)
    updates = (clients_per_round or 0) * num_rounds * update_cost
    if clients_per_round and updates < MIN_CLIENT_UPDATES:
        return 1, (f"{capacity}, but a short run: {clients_per_round} clients x {num_rounds} rounds = {updates:g} "
                   f"client updates < {MIN_CLIENT_UPDATES}, start-up would not pay")
    if update_cost != 1:
        return n, (f"{capacity}, {clients_per_round or '?'} clients x {num_rounds} rounds x {update_cost:g} "
                   f"(update cost)")
    return n, f"{capacity}, {clients_per_round or '?'} clients x {num_rounds} rounds"


#: how long :func:`busy_cores` watches the CPUs, in seconds (this process sleeps meanwhile)
BUSY_WINDOW_S = 0.5


def busy_cores(window: float = BUSY_WINDOW_S) -> float:
    """How many of this process's usable cores other work keeps busy now: the busy share of each usable CPU over
    ``window`` seconds, summed (psutil's per-CPU times; this process sleeps meanwhile, so it does not count itself).

    Not the 1-minute load average (used before), which lags: it decays over minutes, so after other work (pip in
    ``scripts/setup.sh``, a previous job) it still counts cores that are idle by now. Measured on the 2-core box:
    seconds after two one-core jobs ended, FedBiP's recipe printed "0 idle cores (2 usable, load 1.57)" and ran in
    one process. A burst of other work that pauses during the window is missed. Half a second is paid once, and only
    by runs that could use several processes (:func:`hfpfl.cli._processes_to_launch` asks first with 0 busy).
    psutil lists the online CPUs in order; with CPUs offline below a usable one the positions no longer equal CPU
    ids and the reading is of other CPUs (not handled: machines here have every CPU online)."""
    import psutil

    percent = psutil.cpu_percent(interval=window, percpu=True)
    try:
        cpus = [c for c in os.sched_getaffinity(0) if c < len(percent)]
    except AttributeError:  # not Linux: every CPU is usable
        cpus = range(len(percent))
    return sum(percent[c] for c in cpus) / 100.0


def machine(measure_busy: bool = True) -> dict:
    """What :func:`decide` reads from this machine now: usable cores, busy cores (:func:`busy_cores`; 0 without
    ``measure_busy``, which makes :func:`decide` an upper bound), CUDA GPUs."""
    import torch
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cores = usable_cores()
    busy = busy_cores() if measure_busy and not gpus and cores > 1 else 0.0
    return {"cores": cores, "busy": busy, "gpus": gpus}


class Workers:
    """The processes :func:`fork_workers` made: ``rank`` is this process's; the main process (rank 0) holds the
    others' pids and waits for them."""

    def __init__(self, rank: int, pids: list[int]):
        self.rank, self.pids, self.codes = rank, pids, {}

    def signal(self, signum: int) -> None:
        for pid in self.pids:
            if pid not in self.codes:
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the other processes (at most ``timeout`` s, then SIGTERM, then SIGKILL after 10 s more); returns
        the first non-zero exit code among them (0 when all succeeded)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        escalated = 0
        while len(self.codes) < len(self.pids):
            for pid in self.pids:
                if pid in self.codes:
                    continue
                try:
                    done, status = os.waitpid(pid, os.WNOHANG if deadline is not None else 0)
                except ChildProcessError:
                    done, status = pid, 0
                except InterruptedError:
                    continue
                if done:
                    self.codes[pid] = os.waitstatus_to_exitcode(status) if status else 0
            if deadline is not None and len(self.codes) < len(self.pids):
                if time.monotonic() > deadline:
                    self.signal(signal.SIGTERM if escalated == 0 else signal.SIGKILL)
                    escalated += 1
                    deadline = time.monotonic() + 10
                time.sleep(0.05)
        codes = [c for c in self.codes.values() if c]
        return (128 - codes[0] if codes[0] < 0 else codes[0]) if codes else 0


def forked() -> bool:
    """This process is one of :func:`fork_workers`' (the main one included)."""
    return os.environ.get("HFPFL_FORKED") == "1"


def fork_workers(n: int) -> Workers:
    """Fork this process into ``n`` CPU processes, ranks 0..n-1 of one gloo group (this process stays rank 0);
    returns each process's :class:`Workers`. Call it before anything creates accelerate's process state, CUDA or
    torch's thread pool. Each process then sees the variables torchrun would set (``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and ``ACCELERATE_USE_CPU=1``, so
    ``Accelerator()`` joins the group like under ``accelerate launch --multi_gpu``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(n),
                       "LOCAL_WORLD_SIZE": str(n), "ACCELERATE_USE_CPU": "1", "HFPFL_FORKED": "1"})
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(1, n):
        pid = os.fork()
        if pid == 0:
            os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank)})
            return Workers(rank, [])
        pids.append(pid)
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0"})
    return Workers(0, pids)


def relaunch(n: int, argv: list[str], *, script: str | None = None, module: str | None = None,
             output_dir: str | None = None) -> int:
    """Run ``script`` (or ``python -m module``) with ``argv`` in ``n`` processes through accelerate's launcher;
    returns its exit code. The resolved ``output_dir`` is passed on, so every process writes to the same folder."""
    import torch
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(n), "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no"]
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["ACCELERATE_USE_CPU"] = "1"   # real CPU processes (gloo); accelerate's --cpu would run only one
    if n > 1:
        cmd.append("--multi_gpu")        # accelerate's name for "several processes", CPU processes included
    cmd += ["--module", module] if module else [script]
    cmd += [*argv, "--num_processes", str(n)]
    if output_dir:
        cmd += ["--output_dir", output_dir]
    proc = subprocess.Popen(cmd, env=env)
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt as e:
            # Ctrl-C reaches every process of the terminal's group by itself; a SIGTERM sent to this process only is
            # passed on. Either way the processes save their round and print how to resume; wait for them.
            if getattr(e, "signum", None) == signal.SIGTERM:
                proc.send_signal(signal.SIGTERM)
            continue
