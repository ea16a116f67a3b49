"""What every entry point shares around a run: where its outputs go (one rule for reusing a folder), what an
interruption leaves behind and says, and random streams that set-up work (pretraining a stand-in) cannot shift.

The output-folder rule, for every recipe and script:

* no ``--output_dir``: a fresh ``outputs/<name>-<YYYYmmdd-HHMMSS>`` folder (as HF example scripts name runs);
* a folder that holds a finished run (``results.json``) or round checkpoints is reused only with
  ``--resume_from_checkpoint latest`` (continue it) or ``--overwrite_output_dir`` (replace hfpfl's own files);
* a file hfpfl did not write is never overwritten, not even with ``--overwrite_output_dir``: a ``config.yaml`` of
  the user's own (say the one passed with ``--config``) makes the folder unusable, with the reason said;
* a run that fails on bad input before it has anything to show removes the folder it created.
"""
from __future__ import annotations

import contextlib
import os
import random
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path

import numpy as np

CONFIG_NAME = "config.yaml"
CONFIG_MARKER = "# hfpfl resolved config"
# files (and folders) a run writes into its output_dir; --overwrite_output_dir removes exactly these
RUN_FILES = ("results.json", "metrics.jsonl", "accuracy_curve.png", "client_accuracy.png", CONFIG_NAME)
RUN_DIRS = ("checkpoints", "shared_adapter")  # shared_adapter: FedDAT's final global A_s


# ------------------------------------------------------------------------------------------------ output folders
def _state():
    """accelerate's process state, created the way ``Accelerator()`` creates it (``ACCELERATE_USE_CPU=1`` launches
    on CPU need ``cpu=True``, or the processes would not see each other)."""
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    return PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))


def default_output_dir(name: str, root: str = "outputs") -> str:
    """``outputs/<name>-<timestamp>``, the same on every process of a multi-process launch."""
    from .launch import launched
    if not launched():  # one process: no process state needed (and none created before a fork)
        return _new_output_dir(name, root)
    path = None
    state = _state()
    if state.is_main_process:
        path = _new_output_dir(name, root)
    if state.num_processes > 1:
        from accelerate.utils import broadcast_object_list
        box = [path]
        broadcast_object_list(box, from_process=0)
        path = box[0]
    return path


def _new_output_dir(name: str, root: str) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = os.path.join(root, f"{name}-{stamp}")
    n = 2
    while os.path.exists(path):
        path, n = os.path.join(root, f"{name}-{stamp}-{n}"), n + 1
    return path


def resolve_output_dir(output_dir: str | None, name: str) -> str:
    return output_dir if output_dir else default_output_dir(name)


def is_hfpfl_config(path: Path) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.readline().startswith(CONFIG_MARKER)
    except OSError:
        return False


def has_checkpoints(out: Path) -> bool:
    root = out / "checkpoints"
    return root.is_dir() and any(p.name.startswith("round-") and (p / "state.json").is_file() for p in root.iterdir())


def check_output_dir(output_dir: str | os.PathLike, *, overwrite: bool, resume: bool,
                     finished_marker: str = "results.json", started_files=()) -> None:
    """Refuse (one-line ValueError / FileExistsError naming the option and the fix) to use ``output_dir`` where a
    run would overwrite something it should not. Writes nothing. ``started_files``: files that mark a started run of
    this kind besides round checkpoints (a tuner's population.pt)."""
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output_dir {str(out)!r} is a file, not a folder; pass a folder path (it is created)")
    for parent in [out, *out.parents]:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"--output_dir {str(out)!r} cannot be created: {str(parent)!r} is a file")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise ValueError(f"--output_dir {str(out)!r} cannot be created or written: no write permission on "
                                 f"{str(parent)!r}; pass another --output_dir")
            break
    if not out.is_dir():
        return
    cfg = out / CONFIG_NAME
    if cfg.exists() and not is_hfpfl_config(cfg):
        raise FileExistsError(f"--output_dir {str(out)!r} holds a {CONFIG_NAME} that hfpfl did not write (your own "
                              f"config?); it is never overwritten: pass another --output_dir")
    if resume:
        return
    finished = (out / finished_marker).exists()
    started = [f for f in started_files if (out / f).exists()]
    if (finished or has_checkpoints(out) or started) and not overwrite:
        what = f"a finished run ({finished_marker})" if finished else \
            f"an unfinished run ({started[0]})" if started else "checkpoints of an unfinished run"
        raise FileExistsError(f"--output_dir {str(out)!r} already holds {what}; pass --resume_from_checkpoint latest "
                              f"to continue it, --overwrite_output_dir to replace it, or another --output_dir")


def clear_run_files(output_dir: str | os.PathLike, extra_files=(), extra_dirs=()) -> None:
    """--overwrite_output_dir: remove the files a previous run wrote (never anything else)."""
    out = Path(output_dir)
    for name in (*RUN_FILES, *extra_files):
        p = out / name
        if name == CONFIG_NAME and p.exists() and not is_hfpfl_config(p):
            continue
        if p.is_file():
            p.unlink()
    for name in (*RUN_DIRS, *extra_dirs):
        shutil.rmtree(out / name, ignore_errors=True)


def prepare_output_dir(output_dir, *, overwrite: bool, resume: bool, main_process: bool = True,
                       run_files=()) -> None:
    """The one output-folder rule: check it (:func:`check_output_dir`), clear a previous run's files on overwrite,
    create it. ``run_files``: the files this kind of run writes besides the common ones (a tuner's population.pt
    first: it marks a started run)."""
    check_output_dir(output_dir, overwrite=overwrite, resume=resume, started_files=run_files[:1])
    if main_process:
        if overwrite and not resume:
            clear_run_files(output_dir, extra_files=run_files)
        try:
            Path(output_dir).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--output_dir {str(output_dir)!r} cannot be created: {e.strerror or e}") from None


@contextlib.contextmanager
def cleanup_on_failure(output_dir: str | os.PathLike | None):
    """If the run fails (any exception) and ``output_dir`` did not exist before it, and the run left nothing to
    resume (no complete checkpoint) nor a result, remove the folder: a failed start leaves no half-written run."""
    out = Path(output_dir) if output_dir else None
    existed = out is None or out.exists()
    try:
        yield
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            raise
        if not existed and out.is_dir() and not has_checkpoints(out) and not (out / "results.json").exists():
            if _state().is_main_process:
                shutil.rmtree(out, ignore_errors=True)
        raise


# ------------------------------------------------------------------------------------------------ interruptions
#: the last SIGINT/SIGTERM that :func:`interruptible` turned into :class:`Interrupted` (None: none yet). In a
#: multi-process run a signal can reach a process while it waits in a collective, which then fails because its
#: peers stopped; the run still counts as interrupted.
last_signal: int | None = None


class Interrupted(KeyboardInterrupt):
    """SIGINT / SIGTERM during a run."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def interruptible():
    """Turn SIGTERM (and SIGINT) into :class:`Interrupted` for the duration of the block (main thread only)."""
    def handler(signum, frame):
        global last_signal
        last_signal = signum
        raise Interrupted(signum)

    try:
        old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def resume_command(argv: list[str], output_dir: str, script: str | None = None) -> str:
    """The command line that resumes this run: same options, the resolved --output_dir, --resume_from_checkpoint
    latest (and without --overwrite_output_dir, which would discard the checkpoints)."""
    drop_with_value = {"--output_dir", "--output-dir", "--resume_from_checkpoint", "--resume-from-checkpoint"}
    drop_flag = {"--overwrite_output_dir", "--overwrite-output-dir"}
    kept, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        key = a.split("=", 1)[0]
        if key in drop_with_value:
            skip = "=" not in a
            continue
        if key in drop_flag:
            if "=" not in a and i + 1 < len(argv) and argv[i + 1].lower() in ("true", "false", "1", "0", "yes", "no"):
                skip = True
            continue
        kept.append(a)
    if script is None:
        script = sys.argv[0]
        script = os.path.relpath(script) if os.path.isabs(script) else script
        launched = (("ACCELERATE_MIXED_PRECISION" in os.environ or "LOCAL_RANK" in os.environ)
                    and os.environ.get("HFPFL_FORKED") != "1")   # forked by the recipe itself: started with python
        prefix = ["accelerate", "launch"] if launched else [os.path.relpath(sys.executable)
                                                             if ".venv" in sys.executable else "python"]
        head = [*prefix, script]
    else:
        head = shlex.split(script)
    return " ".join(shlex.quote(x) for x in [*head, *kept, "--output_dir", output_dir,
                                              "--resume_from_checkpoint", "latest"])


def interrupted_message(argv: list[str], output_dir: str | None, script: str | None = None) -> str:
    if output_dir and has_checkpoints(Path(output_dir)):
        last = max(int(p.name.split("-")[1]) for p in (Path(output_dir) / "checkpoints").iterdir()
                   if p.name.startswith("round-") and (p / "state.json").is_file())
        return f"interrupted; round {last} is saved in {output_dir}; resume with: {resume_command(argv, output_dir, script)}"
    return "interrupted before the first checkpoint; nothing to resume: run the same command again"


# ------------------------------------------------------------------------------------------------ random streams
def configure_determinism(device, deterministic: bool = True) -> None:
    """Make a CUDA run reproducible: same seed -> same numbers. PyTorch's defaults on CUDA are not: cuDNN picks
    convolution kernels by benchmark and computes them in TF32 (measured on an H100: the vectorized and the
    sequential FedAvg round differed by 3e-3 in a conv weight, and two runs of the same seed differed). With
    ``deterministic`` (the default) cuDNN/cuBLAS use deterministic kernels in full float32, and ops without a
    deterministic CUDA kernel warn (``warn_only``) instead of failing. ``False`` turns on cuDNN autotuning and TF32
    (faster; results vary in their last bits). A no-op on the CPU, whose kernels are deterministic already."""
    import torch

    if torch.device(device).type != "cuda":
        return
    if deterministic:
        # cuBLAS needs a fixed workspace to be deterministic; it must be set before its first handle is created
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = not deterministic
    torch.backends.cudnn.allow_tf32 = not deterministic
    torch.backends.cuda.matmul.allow_tf32 = not deterministic
    # scaled-dot-product attention's memory-efficient kernel has a non-deterministic backward (PyTorch warns on the
    # ViT/ViLT tests under deterministic mode); the flash and math kernels remain
    torch.backends.cuda.enable_mem_efficient_sdp(not deterministic)
    torch.use_deterministic_algorithms(deterministic, warn_only=True)


@contextlib.contextmanager
def preserved_rng():
    """Run set-up work (pretraining a stand-in backbone, building data) without shifting the run's random streams:
    the torch, numpy and Python global RNG states are restored afterwards."""
    import torch

    saved = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        torch.set_rng_state(saved[0])
        np.random.set_state(saved[1])
        random.setstate(saved[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
