"""The step beat: a worker's progress, counted where its agent can read it without a system call per step.

Each worker process maps ``beat-<pid>`` (16 bytes) in its node's directory: steps finished (the training
loop's step boundary counts them) and other progress (a worker that waits for its own durable writer is not
blocked on a peer). Counting is a store into a mapped page, incremented in place, so that every counter of
one process (the loop's, a checkpoint manager's) adds to the same file. The agent reads the files to tell a
node whose collectives make progress from one blocked in a collective whose peers went away
(:mod:`elastic_train.rendezvous.fence`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from dataclasses import dataclass

#: File name prefix of a worker's counters (``beat-<pid>``).
PREFIX = "beat-"
_COUNTERS = struct.Struct("<QQ")
_STEPS, _OTHER = 0, 8


@dataclass(frozen=True, slots=True)
class Beats:
    """One worker's counters as its agent read them."""

    steps: int
    """Steps the worker finished."""
    other: int
    """Other progress it reported (waiting on its own writer)."""

    @property
    def total(self) -> int:
        return self.steps + self.other


class Beat:
    """A worker's counters in its node's directory (nothing is counted when ``directory`` is None or gone).

    Args:
        directory: the node's directory.
    """

    def __init__(self, directory: str | None) -> None:
        self.directory = directory
        self._map: mmap.mmap | None = None

    def step(self) -> None:
        """Count one finished step."""
        self._add(_STEPS)

    def progress(self) -> None:
        """Count progress that is not a step (waiting on this worker's own writer, not on a peer)."""
        self._add(_OTHER)

    def _add(self, offset: int) -> None:
        if self._map is None and not self._open():
            return
        assert self._map is not None
        (value,) = struct.unpack_from("<Q", self._map, offset)
        struct.pack_into("<Q", self._map, offset, value + 1)

    def _open(self) -> bool:
        if self.directory is None:
            return False
        path = os.path.join(self.directory, f"{PREFIX}{os.getpid()}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                if os.fstat(fd).st_size < _COUNTERS.size:
                    os.ftruncate(fd, _COUNTERS.size)
                self._map = mmap.mmap(fd, _COUNTERS.size)
            finally:
                os.close(fd)
        except OSError:
            self.directory = None  # the agent went away; nothing to tell
            return False
        return True

    def close(self) -> None:
        if self._map is not None:
            with contextlib.suppress(BufferError, ValueError):
                self._map.close()
            self._map = None


def read_beats(directory: str) -> dict[int, Beats]:
    """The counters in a node's directory: ``{worker pid: Beats}`` (unreadable or foreign files left out)."""
    out: dict[int, Beats] = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return out
    for name in names:
        pid = name[len(PREFIX) :]
        if not name.startswith(PREFIX) or not pid.isdigit():
            continue
        try:
            with open(os.path.join(directory, name), "rb") as f:
                raw = f.read(_COUNTERS.size)
        except OSError:
            continue
        if len(raw) == _COUNTERS.size:
            out[int(pid)] = Beats(*_COUNTERS.unpack(raw))
    return out


def clear_beats(directory: str) -> None:
    """Remove the counters of a worker group that ended."""
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if name.startswith(PREFIX):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(directory, name))
