"""``--num_processes auto|N``: a recipe started with plain ``python`` uses several processes by launching itself
through accelerate (clients sharded over the processes, the same numbers as one process; README "Several processes
and machines"). Under ``accelerate launch`` (or torchrun) the launcher's own settings win and nothing is relaunched.

``auto`` picks, on a machine with CUDA GPUs, one process per GPU; on the CPU, one process per core that is idle now
(usable cores minus the 1-minute load average, rounded), at most one per client trained each round, and at least one.
Measured on a 2-core box (README "Performance"): two processes beat one only when the second core is idle; with it
busy (another job), two processes were slower than one, which is why ``auto`` counts idle cores, not cores.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys


#: ``--num_processes`` when neither the command line, a ``--config`` file nor ``HFPFL_NUM_PROCESSES`` sets it
DEFAULT_NUM_PROCESSES = "1"
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
            load: float | None = None, gpus: int | None = None) -> int:
    """How many processes ``--num_processes spec`` means here (``cores``, ``load``, ``gpus``: for tests)."""
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
        load = os.getloadavg()[0] if load is None and hasattr(os, "getloadavg") else (load or 0.0)
        n = int(cores - load + 0.5)
    if clients_per_round:
        n = min(n, clients_per_round)
    return max(1, n)


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
