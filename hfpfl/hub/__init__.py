"""A local Hub cache in the real huggingface_hub layout, and the offline-aware resolution of Hub ids.

Pushing writes ``<cache>/models--org--name/{blobs/<sha256>, snapshots/<commit>/<file> -> ../../blobs/<sha256>,
refs/<revision>}`` -- exactly what ``hf_hub_download`` leaves behind -- so plain
``AutoModel.from_pretrained(repo_id, revision="round-3")`` and ``PeftModel.from_pretrained(base, repo_id,
revision="round-3")`` load it under ``HF_HUB_OFFLINE=1`` (huggingface_hub resolves ``refs/<revision>`` to the commit
and returns the snapshot file when it cannot reach the server). Commits are content addressed: sha1 over the
sorted ``(path, blob sha256)`` pairs, so identical content gives an identical commit.

Only ``.safetensors`` files are ever loaded by this package; pickles (``.bin``/``.pt``/``.pth``/``.pkl``/``.ckpt``) are
refused. :mod:`.names` checks ids, revisions and file names (and holds the errors), :mod:`.store` writes and reads the
cache, :mod:`.resolve` uses it (publish once, resolve ``from_pretrained`` names offline, upload to a real Hub).
"""

from .names import (PICKLE_SUFFIXES, CorruptCheckpointError, OfflineModelError, RevisionNotCachedError,
                    UnsafeFormatError, hub_cache_dir, is_offline, repo_cache_path, validate_filename, validate_repo_id,
                    validate_revision)
from .resolve import ensure_published, push_to_hub, resolve_pretrained, use_hub_cache
from .store import (LOCAL_MARKER, _fix_hint, cached_snapshot, list_repo_files, list_revisions, published_locally,
                    pull_state_dict, push_folder_to_cache, push_state_dict, require_cached, verify_safetensors)

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
