"""Round checkpoints: written to a temporary directory, renamed when complete, so a kill never leaves a
checkpoint that looks finished. `latest` is the highest complete round. :func:`save_round` and :func:`resume` write
and read a simulation's."""
from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .comm import flatten_parts, unflatten_parts
from .distributed import barrier

ROUND_DIR = re.compile(r"^round-(\d{5})$")
COMPLETE = "state.json"


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def round_dir(output_dir, round_idx: int) -> Path:
    return checkpoint_root(output_dir) / f"round-{round_idx:05d}"


def tmp_dir(output_dir, round_idx: int) -> Path:
    return checkpoint_root(output_dir) / f".tmp-round-{round_idx:05d}"


def list_complete(output_dir) -> list[Path]:
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if ROUND_DIR.match(p.name) and (p / COMPLETE).is_file()]
    return sorted(found, key=lambda p: int(ROUND_DIR.match(p.name).group(1)))


def resolve(output_dir, spec: str) -> Path:
    """'latest' -> newest complete checkpoint under output_dir; otherwise a checkpoint directory path."""
    if spec == "latest":
        done = list_complete(output_dir)
        if not done:
            raise FileNotFoundError(f"--resume_from_checkpoint latest: no complete checkpoint under "
                                    f"{checkpoint_root(output_dir)}; start without --resume_from_checkpoint")
        return done[-1]
    path = Path(spec)
    if not (path / COMPLETE).is_file():
        raise FileNotFoundError(f"{spec!r} is not a complete hfpfl checkpoint (no {COMPLETE}); pass 'latest' or a "
                                f"round-NNNNN directory under {checkpoint_root(output_dir)}")
    return path


def save_tensors(tensors: dict, path: Path, metadata: dict | None = None) -> None:
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path), metadata=metadata)


def load_tensors(path: Path) -> dict:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"checkpoint file {str(path)!r} is corrupt or unreadable ({e}); resume from an earlier "
                         f"round directory or start again without --resume_from_checkpoint") from e


def finalize(output_dir, round_idx: int, state: dict, keep: int) -> Path:
    """Write state.json into the temporary dir, rename it into place, prune old checkpoints."""
    tmp, final = tmp_dir(output_dir, round_idx), round_dir(output_dir, round_idx)
    (tmp / COMPLETE).write_text(json.dumps(state))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in list_complete(output_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def read_state(path: Path) -> dict:
    try:
        return json.loads((path / COMPLETE).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"checkpoint {str(path)!r} has a corrupt {COMPLETE}: {e}") from e


# ---------------------------------------------------------------- a simulation's round checkpoints
def save_round(sim, round_idx: int, server_state: dict, elapsed: float) -> None:
    """Round ``round_idx``'s checkpoint: every process's clients, the server state and the run's state, written
    to a temporary folder and renamed once complete."""
    acc = sim.accelerator
    tmp = tmp_dir(sim.output_dir, round_idx)
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(acc)
    save_tensors(sim.store.flatten(), tmp / f"clients-rank{acc.process_index}.safetensors")
    if acc.is_main_process:
        save_tensors(flatten_parts(server_state), tmp / "server.safetensors")
    barrier(acc)
    if acc.is_main_process:
        finalize(sim.output_dir, round_idx, {
            "round": round_idx, "fingerprint": sim.fingerprint(), "history": sim.history,
            "ledger": sim.ledger.to_json(), "elapsed": elapsed, "algorithm": sim.algorithm.state_dict(),
            "server_hparams": dataclasses.asdict(sim._server_hp)}, keep=sim.args.keep_checkpoints)
    barrier(acc)


def resume(sim, spec: str) -> None:
    """Load checkpoint ``spec`` (a round folder or ``latest``) into ``sim``, refusing one written with other
    settings or for more rounds than this run has."""
    path = resolve(sim.output_dir, spec)
    state = read_state(path)
    mine, theirs = sim.fingerprint(), state.get("fingerprint", {})
    diff = _diff(theirs, mine)
    if diff:
        detail = "; ".join(f"{k}: checkpoint={a!r} now={b!r}" for k, (a, b) in list(diff.items())[:6])
        raise ValueError(f"--resume_from_checkpoint: checkpoint {str(path)!r} was written with other settings "
                         f"({detail}); resume with the same settings (only --num_rounds may grow), or start a new "
                         "run with another --output_dir")
    if int(state["round"]) > sim.args.num_rounds:
        raise ValueError(f"--num_rounds {sim.args.num_rounds} is smaller than the checkpoint's round "
                         f"{state['round']}; resume with --num_rounds >= {state['round']}")
    flat = {}
    for f in sorted(path.glob("clients-rank*.safetensors")):  # any world size wrote them: keep the clients we own
        flat.update({k: v for k, v in load_tensors(f).items()
                     if sim.ownership.owns(int(k.split("::", 1)[0]))})
    sim.load_state_dict({"round": state["round"], "server_state": unflatten_parts(
        load_tensors(path / "server.safetensors")), "store": flat, "ledger": state["ledger"],
        "history": state["history"], "algorithm": state.get("algorithm", {}), "elapsed": state.get("elapsed", 0.0),
        "server_hparams": state.get("server_hparams", dataclasses.asdict(sim._server_hp))})


def _diff(old: dict, new: dict, prefix: str = "") -> dict:
    """Flattened keys whose values differ between two nested fingerprints."""
    out = {}
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out.update(_diff(a, b, f"{prefix}{k}."))
        elif a != b and not (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and list(a) == list(b)):
            out[f"{prefix}{k}"] = (a, b)
    return out
