"""Command-line entry points shared by the recipes (`accelerate launch recipes/<method>.py`) and `hfpfl`."""
from __future__ import annotations

import logging
import os
import sys

USER_ERRORS = (ValueError, FileExistsError, FileNotFoundError, KeyError, OSError)


def _setup_logging() -> None:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    for noisy in ("httpx", "urllib3", "filelock", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def format_table(results: dict) -> str:
    final = results["final"]
    comm = results["communication"]
    lines = [f"{results['method']} on {results['dataset']} ({results['partition']}), {results['num_clients']} clients, "
             f"{results['num_rounds']} rounds, seed {results['seed']}"]
    for k, v in final.items():
        lines.append(f"  {k:<28} {v:.4f}")
    for d, v in results.get("per_domain_accuracy", {}).items():
        lines.append(f"  personal accuracy [{d}]{'':<{max(0, 11 - len(d))}} {v:.4f}")
    lines.append(f"  {'bytes up / down':<28} {comm['bytes_up']:,} / {comm['bytes_down']:,}")
    lines.append(f"  {'wall time':<28} {results['wall_time_s']:.1f} s")
    return "\n".join(lines)


def run_recipe(method: str | None = None, argv: list[str] | None = None, defaults: dict | None = None) -> dict | None:
    """Parse flags (+ --config YAML), run one simulation, print the result table. User errors exit with code 2.
    ``defaults`` are the recipe's own option defaults (below YAML and flags)."""
    from .config import parse_run_args

    _setup_logging()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    prog = os.path.basename(sys.argv[0]) if argv is None else "hfpfl"
    try:
        run, data, method_cfg = parse_run_args(argv, method=method, prog=prog,
                                               description=f"hfpfl: federated simulation ({method or 'any method'})",
                                               defaults=defaults)
        from .federated.engine import Simulation
        sim = Simulation(run, data, method_cfg)
        results = sim.run()
    except USER_ERRORS as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"error: {msg}", file=sys.stderr)
        raise SystemExit(2) from None
    if sim.accelerator.is_main_process:
        print(format_table(results))
        print(f"results: {os.path.join(run.output_dir, 'results.json')}")
    return results


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: hfpfl {run,methods} ...\n  run      run a simulation (hfpfl run --method fedbn --help)\n"
              "  methods  list the methods and their options")
        return
    cmd, rest = argv[0], argv[1:]
    if cmd == "run":
        run_recipe(argv=rest)
    elif cmd == "methods":
        from .algorithms import REGISTRY
        import dataclasses
        for name, cls in sorted(REGISTRY.items()):
            opts = ", ".join(f.name for f in dataclasses.fields(cls.Config)) or "-"
            print(f"{name:<12} {(cls.__doc__ or '').strip().splitlines()[0] if cls.__doc__ else ''}  options: {opts}")
    else:
        print(f"error: unknown command {cmd!r}; use 'run' or 'methods'", file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    main()
