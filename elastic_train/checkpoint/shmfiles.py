"""The shared-memory snapshot files of a node: their names, their owners, and sweeping the orphans.

A snapshot file is ``elastic_train.<run>+<scope>.<owner pid>-<owner start ms>.<local rank>`` in a tmpfs.
Its *owner* is the process whose lifetime scopes it: the torchrun agent (the worker's parent), which survives
worker restarts, so a restarted worker finds its predecessor's snapshot; for a world of one started without
an agent, the shell (or whatever started it), so the same command run again resumes from memory. Files of
owners that no longer exist are swept at start-up. ``<scope>`` is a digest of the run's durable location:
two jobs of one run id under one owner (two scripts run in turn from one shell, each a world of one named
``default``, with their own checkpoint directories) never read each other's snapshot.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import Callable

import psutil

from elastic_train.envvars import ENV_SHM_OWNER
from elastic_train.log import get_logger
from elastic_train.procs import owner_alive, start_ms

log = get_logger(__name__)

PREFIX = "elastic_train."
_NAME_RE = re.compile(r"^elastic_train\.(?P<run>[^/]+)\.(?P<pid>\d+)-(?P<ctime>\d+)\.(?P<lr>\d+)$")


def owner_identity() -> tuple[int, int]:
    """(pid, start time in ms) of the owner process, which scopes the snapshot's lifetime."""
    pid = int(os.environ.get(ENV_SHM_OWNER) or os.getppid())
    try:
        return pid, start_ms(pid)
    except psutil.NoSuchProcess:
        return pid, 0


def _safe(run_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", run_id)


def snapshot_path(directory: str, run_id: str, local_rank: int, scope: str) -> str:
    """The snapshot file of ``run_id``'s ``local_rank`` under this process's owner, for the run's durable
    location ``scope`` (its checkpoint directory's absolute URL)."""
    pid, ctime = owner_identity()
    digest = hashlib.sha256(scope.encode()).hexdigest()[:12]
    return os.path.join(directory, f"{PREFIX}{_safe(run_id)}+{digest}.{pid}-{ctime}.{local_rank}")


def sweep_stale(directory: str) -> list[str]:
    """Delete snapshot files whose owner process is gone; returns their paths."""
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            m = _NAME_RE.match(name)
            if not m:
                continue
            pid, ctime = int(m["pid"]), int(m["ctime"])
            if not owner_alive(pid, ctime):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(directory, name))
                    removed.append(os.path.join(directory, name))
    return removed


def _snapshots(directory: str, keep: Callable[[re.Match[str]], bool]) -> list[str]:
    """Paths of the snapshot files in ``directory`` whose parsed name ``keep`` accepts."""
    with contextlib.suppress(OSError):
        return sorted(
            os.path.join(directory, n) for n in os.listdir(directory) if (m := _NAME_RE.match(n)) and keep(m)
        )
    return []


def owned_by(directory: str, pid: int, started_ms: int | None = None) -> list[str]:
    """Paths of every snapshot file in ``directory`` whose owner is process ``pid`` (and, given
    ``started_ms``, the process that started then, :func:`~elastic_train.procs.start_ms`, not a later one
    with its PID)."""
    return _snapshots(
        directory,
        lambda m: int(m["pid"]) == pid and (started_ms is None or int(m["ctime"]) == started_ms),
    )


def snapshot_files(directory: str, run_id: str) -> list[str]:
    """Paths of every snapshot file of ``run_id`` in ``directory`` (any owner, any local rank)."""
    run = _safe(run_id)
    return _snapshots(directory, lambda m: m["run"].split("+", 1)[0] == run)


def held_bytes(path: str) -> int:
    """Bytes the snapshot files of ``path``'s run and owner take in its tmpfs (``path`` itself, and its
    siblings of the other local ranks)."""
    directory, prefix = os.path.dirname(path), os.path.basename(path).rsplit(".", 1)[0] + "."
    held = 0
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if name.startswith(prefix):
                with contextlib.suppress(OSError):
                    held += os.stat(os.path.join(directory, name)).st_blocks * 512
    return held


def release_siblings(directory: str, run_id: str, path: str) -> None:
    """Delete the snapshots of ``run_id``'s other local ranks under the owner of ``path`` (the world shrank
    while the owner lived, so no worker of theirs releases them)."""
    prefix = path.rsplit(".", 1)[0] + "."
    for other in snapshot_files(directory, run_id):
        if other.startswith(prefix) and other != path:
            try:
                os.unlink(other)
                log.info("memory_snapshot_released", path=other)
            except FileNotFoundError:
                pass
