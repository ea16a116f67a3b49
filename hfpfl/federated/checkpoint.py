"""Round checkpoints: written to a temporary directory, renamed when complete, so a kill never leaves a
checkpoint that looks finished. `latest` is the highest complete round."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

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
