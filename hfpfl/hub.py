"""A local Hub cache in the real huggingface_hub layout, and the offline-aware resolution of Hub ids.

Pushing writes ``<cache>/models--org--name/{blobs/<sha256>, snapshots/<commit>/<file> -> ../../blobs/<sha256>,
refs/<revision>}`` -- exactly what ``hf_hub_download`` leaves behind -- so plain
``AutoModel.from_pretrained(repo_id, revision="round-3")`` and ``PeftModel.from_pretrained(base, repo_id,
revision="round-3")`` load it under ``HF_HUB_OFFLINE=1`` (huggingface_hub resolves ``refs/<revision>`` to the commit
and returns the snapshot file when it cannot reach the server). Commits are content addressed: sha1 over the
sorted ``(path, blob sha256)`` pairs, so identical content gives an identical commit.

Only ``.safetensors`` files are ever loaded by this module; pickles (``.bin``/``.pt``/``.pth``/``.pkl``/``.ckpt``) are
refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import torch

__all__ = [
    "OfflineModelError",
    "RevisionNotCachedError",
    "CorruptCheckpointError",
    "UnsafeFormatError",
    "hub_cache_dir",
    "is_offline",
    "validate_repo_id",
    "validate_revision",
    "validate_filename",
    "repo_cache_path",
    "push_folder_to_cache",
    "push_state_dict",
    "pull_state_dict",
    "list_revisions",
    "list_repo_files",
    "require_cached",
    "cached_snapshot",
    "ensure_published",
    "verify_safetensors",
    "resolve_pretrained",
    "use_hub_cache",
    "push_to_hub",
]

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


def ensure_published(
    repo_id: str,
    publish,
    stale=None,
    force: bool = False,
    cache_dir: str | os.PathLike | None = None,
    required_file: str | None = None,
    log=print,
) -> str:
    """The snapshot path of ``repo_id`` in the local cache, published first when it is not cached, when
    ``stale(path)`` gives a reason to replace the cached copy (None: it is current), or when ``force``:
    ``publish()`` writes it (e.g. with :func:`push_folder_to_cache`) and returns its snapshot path. One publisher at a
    time per repo id (a file lock in the cache: several processes of a run may ask at once); whoever waited on the
    lock finds the snapshot its predecessor published."""
    from filelock import FileLock

    validate_repo_id(repo_id)

    def current():
        path = cached_snapshot(repo_id, cache_dir=cache_dir, required_file=required_file)
        return path, (stale(path) if path is not None and stale is not None else None)

    if not force:
        path, reason = current()
        if path is not None and reason is None:
            return path
        if path is not None:
            log(f"[hub] cached {repo_id} {reason}: replacing it")
    locks = Path(hub_cache_dir(cache_dir)) / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    with FileLock(str(locks / ("hfpfl-publish-" + repo_id.replace("/", "--") + ".lock"))):
        if not force:
            path, reason = current()
            if path is not None and reason is None:
                return path
        return str(publish())


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


@contextlib.contextmanager
def resolve_pretrained(
    name_or_path: str,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    repo_type: str = "model",
) -> Iterator[dict]:
    """Context for a ``from_pretrained(name_or_path, **kw)`` call: yields the kwargs (``revision``, ``cache_dir``,
    ``local_files_only``) and turns failures into clear errors.

    * local directory: safetensors files are checked for truncation first.
    * Hub id while offline: :func:`require_cached` fails fast (no 20-second retries) with the fix in the message,
      the cached snapshot is checked, and ``local_files_only=True`` is passed.
    * a safetensors error while loading becomes :class:`CorruptCheckpointError`.
    """
    kw: dict = {}
    if os.path.isdir(name_or_path):
        _verify_folder(name_or_path)
    else:
        looks_like_path = name_or_path.startswith((".", "/", "~")) or os.sep in name_or_path.replace("/", "", 1)
        if looks_like_path:
            raise FileNotFoundError(f"local model path {name_or_path!r} does not exist")
        try:
            validate_repo_id(name_or_path)
        except ValueError as e:
            raise ValueError(f"{name_or_path!r} is neither a built-in name, a local directory nor a Hub id: {e}") from e
        if revision is not None:
            kw["revision"] = revision
        if cache_dir is not None:
            kw["cache_dir"] = str(cache_dir)
        if is_offline() or published_locally(name_or_path, repo_type, cache_dir):
            snapshot = require_cached(name_or_path, repo_type, revision or "main", cache_dir)
            _verify_folder(snapshot)
            kw["local_files_only"] = True
    try:
        yield kw
    except (CorruptCheckpointError, OfflineModelError):
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with context
        from safetensors import SafetensorError

        if isinstance(e, SafetensorError) or "safetensors" in type(e).__module__:
            raise CorruptCheckpointError(f"could not read safetensors checkpoint of {name_or_path!r}: {e}") from e
        if kw.get("local_files_only") and isinstance(e, OSError):
            raise OfflineModelError(
                f"{name_or_path!r} is only partly cached (offline): {e}." + _fix_hint(name_or_path)
            ) from e
        raise


@contextlib.contextmanager
def use_hub_cache(cache_dir: str | os.PathLike, offline: bool = True) -> Iterator[str]:
    """Point huggingface_hub (and thus transformers/peft/diffusers) at ``cache_dir`` -- and offline mode -- for the
    duration of the block. huggingface_hub reads ``HF_HUB_CACHE``/``HF_HUB_OFFLINE`` into constants at import,
    so setting the env vars alone is not enough; this patches the constants too and restores everything after."""
    from huggingface_hub import constants

    saved_env = {k: os.environ.get(k) for k in ("HF_HUB_CACHE", "HF_HUB_OFFLINE")}
    saved = (constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE)
    os.environ["HF_HUB_CACHE"] = str(cache_dir)
    constants.HF_HUB_CACHE = str(cache_dir)
    if offline:
        os.environ["HF_HUB_OFFLINE"] = "1"
        constants.HF_HUB_OFFLINE = True
    try:
        yield str(cache_dir)
    finally:
        constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE = saved
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# --------------------------------------------------------------------------------------------------------------
# a real Hub endpoint
# --------------------------------------------------------------------------------------------------------------
def push_to_hub(
    folder: str | os.PathLike,
    repo_id: str,
    revision: str = "main",
    token: str | None = None,
    private: bool = True,
    commit_message: str | None = None,
    endpoint: str | None = None,
):
    """Upload ``folder`` to a real Hub endpoint (branch ``revision``, created if needed). Pickles are not uploaded.
    Only used when a user configures an endpoint; the simulator itself works on the local cache."""
    from huggingface_hub import HfApi

    validate_repo_id(repo_id)
    validate_revision(revision)
    api = HfApi(token=token, endpoint=endpoint)
    api.create_repo(repo_id, private=private, exist_ok=True)
    if revision != "main":
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    return api.upload_folder(
        folder_path=str(folder),
        repo_id=repo_id,
        revision=revision,
        commit_message=commit_message or f"hfpfl: {revision}",
        ignore_patterns=[f"*{s}" for s in PICKLE_SUFFIXES] + [".*"],
    )
