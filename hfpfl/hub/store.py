"""The local Hub cache in huggingface_hub's layout: writing a folder or a state dict as a revision, reading a revision
(offline), and the checks of what is read (safetensors only, not truncated)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from .names import (_COMMIT_RE, OfflineModelError, RevisionNotCachedError, CorruptCheckpointError, UnsafeFormatError,
                    _refuse_pickle, hub_cache_dir, repo_cache_path, validate_filename, validate_revision)


# --------------------------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------------------------
def _sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _commit(storage: Path, revision: str, files: dict[str, Path]) -> Path:
    """Store ``files`` (repo path -> local source) as one snapshot and point ``refs/<revision>`` at it."""
    blobs = storage / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    entries = {}
    for rel, src in sorted(files.items()):
        digest = _sha256(src)
        blob = blobs / digest
        if not blob.exists():
            fd, tmp = tempfile.mkstemp(dir=blobs, prefix=".tmp-")
            os.close(fd)
            shutil.copyfile(src, tmp)
            os.replace(tmp, blob)
        entries[rel] = digest
    commit = hashlib.sha1(json.dumps(sorted(entries.items())).encode()).hexdigest()
    snapshot = storage / "snapshots" / commit
    for rel, digest in entries.items():
        dst = snapshot / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if dst.is_symlink() or dst.exists():
            continue
        target = os.path.relpath(blobs / digest, dst.parent)
        try:
            os.symlink(target, dst)
        except (OSError, NotImplementedError):  # no symlinks (some Windows setups): copy like huggingface_hub does
            shutil.copyfile(blobs / digest, dst)
    _atomic_write_text(storage / "refs" / revision, commit)
    if not (storage / LOCAL_MARKER).is_file():
        _atomic_write_text(storage / LOCAL_MARKER, "published to the local cache by hfpfl.hub\n")
    return snapshot


def push_folder_to_cache(
    folder: str | os.PathLike,
    repo_id: str,
    revision: str = "main",
    repo_type: str = "model",
    cache_dir: str | os.PathLike | None = None,
) -> str:
    """Publish every file under ``folder`` (hidden files skipped) as the new content of ``repo_id@revision``.

    Returns the snapshot path. The revision then holds exactly the folder's files (like a commit that replaces the
    tree); other revisions are untouched.
    """
    validate_revision(revision)
    storage = repo_cache_path(repo_id, repo_type, cache_dir)
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"push_folder_to_cache: {folder} is not a directory")
    files = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_dir() or any(p.startswith(".") for p in rel.split("/")):
            continue
        files[validate_filename(rel)] = path
    if not files:
        raise ValueError(f"push_folder_to_cache: {folder} holds no files")
    return str(_commit(storage, revision, files))


def push_state_dict(
    state: dict[str, torch.Tensor],
    repo_id: str,
    revision: str = "main",
    filename: str = "model.safetensors",
    metadata: dict[str, str] | None = None,
    cache_dir: str | os.PathLike | None = None,
    repo_type: str = "model",
) -> str:
    """Save ``state`` as safetensors into ``repo_id@revision``, keeping the revision's other files (a new commit that
    adds/replaces ``filename``). Returns the snapshot path. Tensors are made contiguous and de-aliased."""
    validate_filename(filename)
    validate_revision(revision)
    if not filename.endswith(".safetensors"):
        raise UnsafeFormatError(f"push_state_dict writes safetensors only; got filename {filename!r}")
    from safetensors.torch import save_file

    storage = repo_cache_path(repo_id, repo_type, cache_dir)
    files: dict[str, Path] = {}
    ref = storage / "refs" / revision
    if ref.is_file():
        old = storage / "snapshots" / ref.read_text().strip()
        if old.is_dir():
            for p in old.rglob("*"):
                if p.is_file():
                    files[p.relative_to(old).as_posix()] = p
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    meta.setdefault("format", "pt")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "state.safetensors"
        save_file({k: v.detach().cpu().contiguous().clone() for k, v in state.items()}, str(path), metadata=meta)
        files[filename] = path
        return str(_commit(storage, revision, files))


# --------------------------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------------------------
def list_revisions(repo_id: str, repo_type: str = "model", cache_dir: str | os.PathLike | None = None) -> list[str]:
    """Revision names (``refs/*``) cached for ``repo_id``, sorted naturally (``round-2`` before ``round-10``)."""
    refs = repo_cache_path(repo_id, repo_type, cache_dir) / "refs"
    if not refs.is_dir():
        return []
    names = [p.relative_to(refs).as_posix() for p in refs.rglob("*") if p.is_file() and not p.name.startswith(".")]
    return sorted(names, key=lambda s: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)])


LOCAL_MARKER = ".hfpfl-local"


def published_locally(repo_id: str, repo_type: str = "model", cache_dir: str | os.PathLike | None = None) -> bool:
    """True for a repo hfpfl published into the local cache (it exists nowhere else): it resolves locally, without
    the ~20 network retries huggingface_hub spends on a repo the Hub does not have, whether or not HF_HUB_OFFLINE
    is set. Marked by :func:`push_folder_to_cache` / :func:`push_state_dict`; ``hfpfl/*`` ids count as local."""
    try:
        storage = repo_cache_path(repo_id, repo_type, cache_dir)
    except ValueError:
        return False
    if not (storage / "refs").is_dir():
        return False
    return repo_id.startswith("hfpfl/") or (storage / LOCAL_MARKER).is_file()


def _fix_hint(repo_id: str) -> str:
    tiny = ""
    if repo_id.startswith("hfpfl/"):
        tiny = f" For hfpfl's tiny backbones run `python recipes/pretrain.py --repo_id {repo_id}` (offline, ~1 min)."
    return (
        f" Fix: run once online (unset HF_HUB_OFFLINE) so it is downloaded, or `hf download {repo_id}`, or point "
        f"HF_HUB_CACHE at a cache that holds it.{tiny}"
    )


def require_cached(
    repo_id: str,
    repo_type: str = "model",
    revision: str = "main",
    cache_dir: str | os.PathLike | None = None,
) -> str:
    """Snapshot path of ``repo_id@revision`` in the local cache, or raise :class:`OfflineModelError` at once
    (:class:`RevisionNotCachedError`, listing the known revisions, when only the revision is missing)."""
    revision = revision or "main"
    storage = repo_cache_path(repo_id, repo_type, cache_dir)
    if not storage.is_dir():
        raise OfflineModelError(
            f"{repo_type} {repo_id!r} is not in the local Hub cache ({hub_cache_dir(cache_dir)})." + _fix_hint(repo_id)
        )
    if _COMMIT_RE.match(revision):
        commit = revision
    else:
        validate_revision(revision)
        ref = storage / "refs" / revision
        if not ref.is_file():
            known = list_revisions(repo_id, repo_type, cache_dir)
            raise RevisionNotCachedError(
                f"revision {revision!r} of {repo_id!r} is not in the local Hub cache; known revisions: {known}."
                + _fix_hint(repo_id)
            )
        commit = ref.read_text().strip()
    snapshot = storage / "snapshots" / commit
    if not snapshot.is_dir():
        raise OfflineModelError(
            f"{repo_id!r}@{revision} points to commit {commit} whose snapshot is missing from the cache "
            f"({snapshot})." + _fix_hint(repo_id)
        )
    return str(snapshot)


def cached_snapshot(
    repo_id: str,
    revision: str = "main",
    repo_type: str = "model",
    cache_dir: str | os.PathLike | None = None,
    required_file: str | None = None,
) -> str | None:
    """Snapshot path of ``repo_id@revision`` when the local cache holds it (with ``required_file`` in it, when given),
    else None; never touches the network."""
    try:
        path = require_cached(repo_id, repo_type, revision, cache_dir)
    except (OfflineModelError, ValueError):
        return None
    if required_file is not None and not (Path(path) / required_file).exists():
        return None
    return path


def list_repo_files(
    repo_id: str, revision: str = "main", repo_type: str = "model", cache_dir: str | os.PathLike | None = None
) -> list[str]:
    snap = Path(require_cached(repo_id, repo_type, revision, cache_dir))
    return sorted(p.relative_to(snap).as_posix() for p in snap.rglob("*") if p.is_file())


def verify_safetensors(path: str | os.PathLike) -> None:
    """Cheap structural check of a safetensors file (header parses, data size matches); raises
    :class:`CorruptCheckpointError` naming the file."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError("file shorter than the 8-byte header length")
            n = int.from_bytes(raw, "little")
            if n <= 0 or 8 + n > size:
                raise ValueError(f"header length {n} exceeds file size {size}")
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + n + end != size:
            raise ValueError(f"tensor data needs {8 + n + end} bytes, file has {size} (truncated?)")
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise CorruptCheckpointError(f"corrupt safetensors checkpoint {os.path.abspath(path)}: {e}") from e


def pull_state_dict(
    repo_id: str,
    revision: str = "main",
    filename: str = "model.safetensors",
    cache_dir: str | os.PathLike | None = None,
    repo_type: str = "model",
    device: str = "cpu",
) -> dict[str, torch.Tensor]:
    """Load ``filename`` of ``repo_id@revision`` from the local cache (safetensors only; pickles refused)."""
    validate_filename(filename)
    _refuse_pickle(filename)
    snapshot = Path(require_cached(repo_id, repo_type, revision, cache_dir))
    path = snapshot / filename
    if not path.is_file():
        raise FileNotFoundError(
            f"{filename!r} not in {repo_id!r}@{revision}; files: {list_repo_files(repo_id, revision, repo_type, cache_dir)}"
        )
    verify_safetensors(path)
    from safetensors.torch import load_file

    return load_file(str(path), device=device)


def _verify_folder(folder: str | os.PathLike) -> None:
    for p in Path(folder).rglob("*.safetensors"):
        verify_safetensors(p)

