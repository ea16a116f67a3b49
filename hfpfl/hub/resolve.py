"""Using the local cache: publishing a repo once (:func:`ensure_published`), resolving a ``from_pretrained`` name
offline with clear errors (:func:`resolve_pretrained`), pointing huggingface_hub at a cache (:func:`use_hub_cache`),
and uploading to a real Hub endpoint (:func:`push_to_hub`)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

from .names import (PICKLE_SUFFIXES, CorruptCheckpointError, OfflineModelError, hub_cache_dir, is_offline,
                    validate_repo_id, validate_revision)
from .store import _fix_hint, _verify_folder, cached_snapshot, published_locally, require_cached


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

