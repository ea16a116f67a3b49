"""Hub ids, revisions and file names checked, where the local cache keeps a repo, and the errors of this package."""

from __future__ import annotations

import os
import re
from pathlib import Path

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_REPO_TYPES = {"model": "models", "dataset": "datasets", "space": "spaces"}
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_REPO_ID_RE = re.compile(rf"^(?:{_NAME}/)?{_NAME}$")
_REVISION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


# --------------------------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------------------------
class OfflineModelError(OSError):
    """A Hub id is needed but not in the local cache while offline (``HF_HUB_OFFLINE=1``)."""


class RevisionNotCachedError(OfflineModelError):
    """The repo is cached but not at the requested revision; the message lists the known revisions."""


class CorruptCheckpointError(OSError):
    """A checkpoint file is truncated or malformed; the message names the file."""


class UnsafeFormatError(ValueError):
    """Refusal to load a pickle-based file (``.bin``/``.pt``/...)."""


# --------------------------------------------------------------------------------------------------------------
# paths and validation
# --------------------------------------------------------------------------------------------------------------
def hub_cache_dir(cache_dir: str | os.PathLike | None = None) -> str:
    """``cache_dir`` if given, else huggingface_hub's ``constants.HF_HUB_CACHE`` read at call time (it honours the
    ``HF_HUB_CACHE``/``HF_HOME`` env vars at import; tests may patch the constant)."""
    if cache_dir is not None:
        return str(cache_dir)
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def is_offline() -> bool:
    """True when huggingface_hub is in offline mode or ``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE`` is set now."""
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return bool(constants.HF_HUB_OFFLINE) or env.strip().upper() in {"1", "ON", "YES", "TRUE"}


def validate_repo_id(repo_id: str) -> str:
    if not isinstance(repo_id, str) or not repo_id:
        raise ValueError(f"invalid repo id {repo_id!r}: expected 'org/name'")
    if "\\" in repo_id or repo_id.startswith("/") or ".." in repo_id or os.path.isabs(repo_id):
        raise ValueError(f"invalid repo id {repo_id!r}: no absolute paths, '..' or backslashes; expected 'org/name'")
    if not _REPO_ID_RE.match(repo_id) or len(repo_id) > 96:
        raise ValueError(
            f"invalid repo id {repo_id!r}: expected 'org/name' of letters, digits, '.', '_', '-' (max 96 chars)"
        )
    return repo_id


def validate_revision(revision: str) -> str:
    if not isinstance(revision, str) or not _REVISION_RE.match(revision) or ".." in revision:
        raise ValueError(f"invalid revision {revision!r}: letters, digits, '.', '_', '-' only (e.g. 'main', 'round-3')")
    return revision


def validate_filename(filename: str) -> str:
    """A relative POSIX path inside a repo, without '..', absolute parts, backslashes or empty components."""
    if not isinstance(filename, str) or not filename or "\\" in filename or filename.startswith("/"):
        raise ValueError(f"invalid file name {filename!r}: must be a relative path inside the repo")
    parts = filename.split("/")
    if any(p in ("", ".", "..") for p in parts) or os.path.isabs(filename):
        raise ValueError(f"invalid file name {filename!r}: no '..', '.' or empty path components")
    return filename


def _check_repo_type(repo_type: str) -> str:
    if repo_type not in _REPO_TYPES:
        raise ValueError(f"invalid repo_type {repo_type!r}; one of {sorted(_REPO_TYPES)}")
    return repo_type


def repo_cache_path(repo_id: str, repo_type: str = "model", cache_dir: str | os.PathLike | None = None) -> Path:
    """``<cache>/models--org--name`` (huggingface_hub's ``repo_folder_name``)."""
    validate_repo_id(repo_id)
    _check_repo_type(repo_type)
    folder = "--".join([_REPO_TYPES[repo_type], *repo_id.split("/")])
    return Path(hub_cache_dir(cache_dir)) / folder


def _refuse_pickle(filename: str) -> None:
    if filename.lower().endswith(PICKLE_SUFFIXES):
        raise UnsafeFormatError(
            f"refusing to load pickle-based file {filename!r}: hfpfl only loads .safetensors "
            "(convert with safetensors.torch.save_file)"
        )
    if not filename.endswith(".safetensors"):
        raise UnsafeFormatError(f"{filename!r} is not a .safetensors file; hfpfl only loads .safetensors state dicts")

