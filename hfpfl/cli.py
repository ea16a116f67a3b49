"""Command-line entry points shared by the recipes (`accelerate launch recipes/<method>.py`) and `hfpfl`."""
from __future__ import annotations

import contextlib
import os
import sys

from .logs import setup_logging

USER_ERRORS = (ValueError, FileExistsError, FileNotFoundError, KeyError, OSError)



def format_table(results: dict) -> str:
    final = results["final"]
    comm = results["communication"]
    adapter = results.get("adapter")
    what = results["method"] + (f" with {adapter} adapters on {results.get('model')}" if adapter and adapter != "none"
                                else "")
    rounds = results["num_rounds"]
    lines = [f"{what} on {results['dataset']} ({results['partition']}), {results['num_clients']} clients, "
             f"{rounds} round{'s' if rounds != 1 else ''}, seed {results['seed']}"]
    for k, v in final.items():
        lines.append(f"  {k:<28} {v:.4f}")
    for d, v in results.get("per_domain_accuracy", {}).items():
        lines.append(f"  personal accuracy [{d}]{'':<{max(0, 11 - len(d))}} {v:.4f}")
    lines.append(f"  {'bytes up / down':<28} {comm['bytes_up']:,} / {comm['bytes_down']:,}")
    lines.append(f"  {'wall time':<28} {results['wall_time_s']:.1f} s")
    return "\n".join(lines)


def user_error_line(e: BaseException) -> str:
    """The one line a user error prints: the first line of its message (the option named, the fix said)."""
    msg = e.args[0] if isinstance(e, KeyError) and e.args else e
    text = str(msg).strip() or type(e).__name__
    return "error: " + " ".join(text.splitlines()[:1]) + (" (...)" if len(text.splitlines()) > 1 else "")


def _worker() -> bool:
    """A non-main process forked by ``--num_processes`` (its main process reports errors and interruptions)."""
    from .launch import forked
    return forked() and os.environ.get("RANK", "0") != "0"


def fail(e: BaseException) -> None:
    if not _worker():  # every process meets the same bad input; the main process says it once
        print(user_error_line(e), file=sys.stderr, flush=True)
    raise SystemExit(2) from None


def run_recipe(method: str | None = None, argv: list[str] | None = None, defaults: dict | None = None,
               name: str | None = None, data_fn=None, after=None, script: str | None = None,
               description: str | None = None, recipe_settings: dict | None = None,
               top_level: bool | None = None, recipe_options=None) -> dict | None:
    """Parse flags (+ --config YAML), run one simulation, print the result table. User errors exit with code 2 and
    one line; SIGINT/SIGTERM leave the last round checkpoint and print the command that resumes.
    ``defaults`` are the recipe's own option defaults (below YAML and flags); ``name`` names the default output
    folder ``outputs/<name>-<timestamp>`` (default: the method). A recipe with its own benchmark passes
    ``data_fn(run, data) -> FederatedData`` and ``after(sim, results)`` (extra plots, main process only);
    ``script`` names the recipe in messages when ``argv`` is given explicitly; ``recipe_settings`` are the recipe's own
    options that shape its data (checked on resume). ``top_level`` (default: ``argv is None``): this call is the
    program's entry point, so ``--num_processes`` may start more processes (hfpfl.launch); a call from other Python
    code runs in its own process (``auto`` then means one).
    ``recipe_options``: the dataclass of the recipe's own options (hfpfl.options checks in its fields), parsed by
    the same parser as the run, data and method options (in --help, --config files and config.yaml); its values
    are the ``recipe_settings`` (checked on resume) and reach ``data_fn(run, data, recipe)``; ``name`` may then be
    a function of them."""
    workers = []  # the hfpfl.launch.Workers once this process forked
    top = argv is None if top_level is None else top_level
    with worker_exits(workers, close=top):
        return _run_recipe(workers, method, argv, defaults, name, data_fn, after, script, description,
                           recipe_settings, top, recipe_options)


def close_process_group() -> None:
    """The end of a successful multi-process program: every process meets here and destroys the process group while
    the interpreter is still alive. Left to interpreter exit, gloo's worker threads can abort a process ("terminate
    called without an active exception", once in a two-process CI run; pytorch/pytorch#190489). Only on success, as
    torchtitan does: a process that failed must not wait for the others."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


@contextlib.contextmanager
def worker_exits(workers: list, close: bool = True):
    """Around code that may fork (:func:`start_processes`): a forked worker never returns into the caller's code
    (it leaves here with its exit code); the main process waits for the workers and fails if one did. ``close``
    (the program's entry point): on success the process group is closed (:func:`close_process_group`)."""
    try:
        yield
    except BaseException as e:
        if workers and workers[0].rank:
            _exit_worker(e)
        if workers:   # the main process failed or was interrupted: the others stop too (they normally have)
            workers[0].wait(timeout=30)
        raise
    closing_failed = None
    if close:
        try:
            close_process_group()
        except Exception as e:  # noqa: BLE001 - a peer is gone (it failed after the last collective)
            if not workers:
                raise
            closing_failed = e
    if workers:
        if workers[0].rank:
            _exit_worker(closing_failed)
        code = workers[0].wait()
        if code:  # the failed worker's exit code, not the barrier's traceback, says what happened
            print(f"error: a worker process exited with code {code}; see its output above", file=sys.stderr)
            raise SystemExit(code)
        if closing_failed is not None:
            raise closing_failed


def start_processes(n_proc: int, workers: list, output_dir) -> None:
    """``--num_processes``: this program in ``n_proc`` processes (hfpfl.launch). On the CPU it forks here (the
    workers' :class:`~hfpfl.launch.Workers` appended to ``workers``; use inside :func:`worker_exits`); CUDA cannot
    be forked, so with GPUs accelerate's launcher runs the whole command line again and this process exits with it."""
    if n_proc <= 1:
        return
    import torch

    from .launch import fork_workers, relaunch
    if torch.cuda.is_available():
        raise SystemExit(relaunch(n_proc, sys.argv[1:], output_dir=output_dir, script=sys.argv[0]))
    workers.append(fork_workers(n_proc))


def _exit_worker(e: BaseException | None) -> None:
    """A forked worker never returns into its caller's code: it leaves here with its exit code."""
    code = 0
    if isinstance(e, SystemExit):
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    elif isinstance(e, KeyboardInterrupt):
        code = 130
    elif e is not None:
        import traceback
        traceback.print_exception(e)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_recipe(workers, method, argv, defaults, name, data_fn, after, script, description, recipe_settings,
                top_level, recipe_options=None) -> dict | None:
    import dataclasses

    from . import runtime
    from .arguments import parse_run_args
    from .runtime import Interrupted, cleanup_on_failure, interruptible, interrupted_message, resolve_output_dir

    setup_logging()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    prog = script or (os.path.basename(sys.argv[0]) if argv is None else "hfpfl")
    args_list = list(sys.argv[1:] if argv is None else argv)
    run = None
    try:
        with interruptible():
            try:
                run, data, method_cfg, *recipe = parse_run_args(
                    args_list, method=method, prog=prog, defaults=defaults, recipe_options=recipe_options,
                    description=description or f"hfpfl: federated simulation ({method or 'any method'})")
                extra = tuple(recipe)  # the recipe's own options, when it has any
                if extra:
                    recipe_settings = {**dataclasses.asdict(extra[0]), **(recipe_settings or {})}
                folder = name(*extra) if callable(name) else name
                run = dataclasses.replace(run, output_dir=resolve_output_dir(run.output_dir, folder or run.method))
                start_processes(_processes_to_launch(run, data, top_level), workers, run.output_dir)
                with cleanup_on_failure(run.output_dir):
                    from .federated.engine import Simulation
                    sim = Simulation(run, data, method_cfg, fed_data=data_fn(run, data, *extra) if data_fn else None,
                                     recipe_settings=recipe_settings)
                    results = sim.run()
                    if after is not None and sim.accelerator.is_main_process:
                        after(sim, results)
            except USER_ERRORS as e:
                if runtime.last_signal is None:
                    fail(e)
                raise Interrupted(runtime.last_signal) from None
            except Exception:
                if runtime.last_signal is None:  # a collective that failed because the others were interrupted
                    raise
                raise Interrupted(runtime.last_signal) from None
    except KeyboardInterrupt as e:
        code = 128 + (e.signum if isinstance(e, Interrupted) else 2)
        if workers:   # Ctrl-C reached every process of the terminal's group; a SIGTERM sent to this one only: pass
            import signal  # it on. Then wait, so that the message below comes last and nothing is left running.
            if isinstance(e, Interrupted) and e.signum == signal.SIGTERM:
                workers[0].signal(signal.SIGTERM)
            workers[0].wait(timeout=30)
        if not _worker():
            print(interrupted_message(args_list, run.output_dir if run else None,
                                      script=_resume_script(script, argv)), file=sys.stderr, flush=True)
        raise SystemExit(code) from None
    if sim.accelerator.is_main_process:
        print(format_table(results))
        print(f"results: {os.path.join(run.output_dir, 'results.json')}")
    return results


def _resume_script(script: str | None, argv) -> str | None:
    """How the printed resume command starts: None (the program's own command line, python or accelerate launch)
    when this is the program's entry point; else the recipe run with python, or ``hfpfl run``."""
    if argv is None:
        return None
    if script and script.endswith(".py"):
        return f"python {script}"
    return script or "hfpfl run"


def _processes_to_launch(run, data, top_level: bool = True) -> int:
    """How many processes to run in: > 1 when ``--num_processes`` (default ``auto``, hfpfl.launch.decide) asks for
    several and this is not already a launched process. Prints the choice in one line when ``auto`` decided."""
    from .launch import decide, launched, machine
    spec = str(getattr(run, "num_processes", "1"))
    if spec == "1" or launched():
        return 1
    if not top_level:
        if spec == "auto":
            return 1
        raise ValueError("--num_processes: a recipe called from Python runs in this process; start "
                         "the recipe script with --num_processes, or use accelerate launch")
    clients = run.clients_per_round
    if clients is None and data is not None and getattr(data, "num_clients", None):
        clients = max(1, int(round(run.client_fraction * data.num_clients)))
    from .algorithms import get_algorithm
    try:
        cost = get_algorithm(run.method).client_update_cost if run.method else 1.0
    except KeyError:  # an unknown method fails later, with the list of methods
        cost = 1.0
    # the CPUs are watched for half a second only where it can change the answer (a run that could use several)
    n, why = decide(spec, clients, run.num_rounds, update_cost=cost, **machine(measure_busy=False))
    if spec == "auto" and n > 1:
        n, why = decide(spec, clients, run.num_rounds, update_cost=cost, **machine())
    if spec == "auto":
        print(f"using {n} process{'es' if n > 1 else ''}: {why}; set --num_processes "
              f"{'1 to disable' if n > 1 else 'N to force N'}", flush=True)
    return n


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: hfpfl {run,methods} ...\n  run      run a simulation (hfpfl run --method fedbn --help)\n"
              "  methods  list the methods and their options")
        return
    cmd, rest = argv[0], argv[1:]
    if cmd == "run":
        run_recipe(argv=rest, top_level=True)
    elif cmd == "methods":
        from .algorithms import REGISTRY, load_builtin_methods
        load_builtin_methods()
        import dataclasses
        for name, cls in sorted(REGISTRY.items()):
            opts = ", ".join(f.name for f in dataclasses.fields(cls.Config)) or "-"
            print(f"{name:<12} {(cls.__doc__ or '').strip().splitlines()[0] if cls.__doc__ else ''}  options: {opts}")
    else:
        print(f"error: unknown command {cmd!r}; use 'run' or 'methods'", file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    main()
