"""Checks of a job's checkpoint settings that can be made before anything starts.

A checkpoint root that is a regular file, or a resume source that does not exist, fails the same way on every
attempt. The launcher (``elastic-train run`` and ``local``) runs these checks before it starts an agent, and a
worker runs them when it first starts (so plain ``torchrun`` users learn it at once, not at the first save or
after the failure budget is spent). They raise :class:`CheckpointSetupError`: one line, exit code 2, and a
worker failure that restarting cannot cure.
"""

from __future__ import annotations

import errno
import os
import tempfile
import uuid

from elastic_train.checkpoint import durable
from elastic_train.checkpoint.config import CheckpointConfig
from elastic_train.checkpoint.errors import CheckpointSetupError, StorageError
from elastic_train.checkpoint.storage import LocalStorage, Storage, open_storage
from elastic_train.log import get_logger

log = get_logger(__name__)

#: Name prefix of the empty object written and deleted to prove an object store root is writable.
PROBE_PREFIX = ".elastic_train-write-check-"


def check_root(url: str, options: dict | None = None, *, probe_remote: bool = True) -> None:
    """The checkpoint root ``url`` is a directory this process can write to, or can be created as one.

    Nothing is created: a missing local root needs a writable directory as its nearest existing ancestor;
    an existing one gets an unnamed temporary file; an object store an empty object, deleted at once (unless
    ``probe_remote`` is false). Only a failure that will happen again is refused (a regular file, permission
    denied, a read-only filesystem); a failed write for another reason (an outage) is logged: a node must
    not end a job over a storage hiccup at start-up.

    Raises:
        CheckpointSetupError: the root (or a parent of it) is a regular file, or it is not writable.
        StorageError: the storage cannot be opened or looked at.
    """
    storage = open_storage(url, options)
    root = storage.root
    if storage.kind(root) == "file":
        raise CheckpointSetupError(f"checkpoint root {url}: is a file, not a directory")
    if isinstance(storage, LocalStorage):
        _check_local_root(url, root)
        return
    if not probe_remote:
        return
    probe = storage.join(root, f"{PROBE_PREFIX}{uuid.uuid4().hex[:12]}")
    try:
        storage.write_small(probe, b"")
        storage.remove(probe)
    except StorageError as exc:
        if _permanent(exc.__cause__):
            raise CheckpointSetupError(f"checkpoint root {url}: not writable: {exc}") from exc
        log.warning("checkpoint_root_write_failed", url=url, error=str(exc))


def _permanent(exc: BaseException | None) -> bool:
    """Whether a failed write will fail again the same way (permissions, a read-only filesystem …)."""
    return isinstance(exc, (PermissionError, NotADirectoryError, IsADirectoryError)) or (
        isinstance(exc, OSError) and exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
    )


def _check_local_root(url: str, root: str) -> None:
    existing = root
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise CheckpointSetupError(f"checkpoint root {url}: {existing} is a file, not a directory")
    if existing != root:
        if not os.access(existing, os.W_OK | os.X_OK):
            raise CheckpointSetupError(f"checkpoint root {url}: cannot be created in {existing} (read-only)")
        return
    try:
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as exc:
        if _permanent(exc):
            raise CheckpointSetupError(f"checkpoint root {url}: not writable: {exc.strerror or exc}") from exc
        log.warning("checkpoint_root_write_failed", url=url, error=str(exc))


def check_resume_source(url: str, options: dict | None = None) -> durable.Entry:
    """The newest valid checkpoint at ``url`` (a run directory or one step directory).

    Manifests and file sizes are checked here; checksums when the checkpoint is loaded.

    Raises:
        CheckpointSetupError: nothing is there, it is a file or a checkpoint root, or no checkpoint is valid.
        StorageError: the storage cannot be opened or read.
    """
    storage = open_storage(url, options)
    what = f"resume_from {url}"
    kind = storage.kind(storage.root)
    if kind is None:
        raise CheckpointSetupError(f"{what}: does not exist")
    if kind == "file":
        raise CheckpointSetupError(f"{what}: is a file; name a run directory or one of its step directories")
    _, entries = durable.resolve(storage, storage.root)
    for entry in entries:
        if entry.valid:
            return entry
    if entries:
        newest = entries[0]
        name = newest.path.rstrip("/").rsplit("/", 1)[-1]
        raise CheckpointSetupError(f"{what}: no valid checkpoint ({name}: {newest.problem})")
    runs = durable.runs_under(storage, storage.root)
    if runs:
        shown = ", ".join(runs[:5]) + (", …" if len(runs) > 5 else "")
        raise CheckpointSetupError(f"{what}: is a checkpoint root holding runs {shown}; name one (ROOT/RUN)")
    raise CheckpointSetupError(f"{what}: no checkpoints here")


def run_has_state(cfg: CheckpointConfig, run_id: str, storage: Storage | None = None) -> bool:
    """Whether the run already has state of its own (then ``resume_from`` is not used, so not checked)."""
    from elastic_train.checkpoint.shmfiles import snapshot_files

    storage = storage or open_storage(cfg.url, cfg.storage_options)
    if durable.newest_valid(storage, storage.join(storage.root, run_id)) is not None:
        return True
    return bool(cfg.memory and snapshot_files(cfg.memory_dir, run_id))


def check_settings(cfg: CheckpointConfig, run_id: str) -> None:
    """Every check of this module a job's ``checkpoint:`` section can fail (see :func:`check_root` and
    :func:`check_resume_source`); the resume source only while the run has no state of its own.

    Raises:
        CheckpointSetupError: one line naming the setting and what is wrong with it.
        StorageError: a storage cannot be opened or read.
    """
    check_root(cfg.url, cfg.storage_options)
    if cfg.resume_from:
        if run_has_state(cfg, run_id):
            log.info("resume_from_unused", run_id=run_id, resume_from=cfg.resume_from)
        else:
            check_resume_source(cfg.resume_from, cfg.storage_options)
