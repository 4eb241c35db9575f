"""Checksums of share files, computed on several cores while the bytes are written or after they are read.

A plain sha256 of a file is one sequential pass: at 1.7 GB/s with SHA extensions it takes longer than
writing and fsyncing a large share on a fast local disk, so it would cap durable throughput. The checkpoint
format therefore records a **sha256 tree** of each file (:data:`TREE`): the file is cut into consecutive
pieces of :data:`PIECE_BYTES` (the last may be shorter), each piece is hashed with sha256 independently (in
a thread pool; hashlib drops the interpreter lock), and the file's digest is the sha256 of the concatenated
32-byte piece digests. Any changed, missing or reordered byte changes it, as with a plain sha256.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

#: The algorithm's name, as a manifest's ``files[].hash`` says it.
TREE = "sha256-tree-8MiB"
PIECE_BYTES = 8 << 20

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def workers() -> int:
    """Threads that hash pieces at most at once: the cores of this machine (at least 2, at most 8)."""
    return max(2, min(8, os.cpu_count() or 2))


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(workers(), thread_name_prefix="ckpt-digest")
        return _pool


class _Gate:
    """Lets at most ``limit`` pieces of one digest be hashed at once; the limit can be raised later."""

    def __init__(self, limit: int) -> None:
        self._limit = max(1, limit)
        self._active = 0
        self._cond = threading.Condition()

    def __enter__(self) -> None:
        with self._cond:
            while self._active >= self._limit:
                self._cond.wait()
            self._active += 1

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify()

    def widen(self, limit: int) -> None:
        with self._cond:
            self._limit = max(self._limit, limit)
            self._cond.notify_all()


def pieces(views: Sequence[memoryview], piece_bytes: int = PIECE_BYTES) -> list[list[memoryview]]:
    """Cut the byte stream ``views`` (in order) into consecutive pieces of ``piece_bytes`` (no copies)."""
    out: list[list[memoryview]] = []
    current: list[memoryview] = []
    room = piece_bytes
    for v in views:
        v = v.cast("B") if v.format != "B" or v.ndim != 1 else v
        while v.nbytes:
            take = v[:room]
            current.append(take)
            room -= take.nbytes
            v = v[take.nbytes :]
            if room == 0:
                out.append(current)
                current, room = [], piece_bytes
    if current:
        out.append(current)
    return out


def _sha256(parts: Sequence[memoryview]) -> bytes:
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
    return h.digest()


class Pending:
    """A digest being computed in the background; :meth:`hexdigest` waits for it."""

    def __init__(self, futures: list[Future[bytes]], gate: _Gate) -> None:
        self._futures = futures
        self._gate = gate

    def widen(self) -> None:
        """Hash the remaining pieces on every core (the caller now waits on I/O, not the CPU)."""
        self._gate.widen(workers())

    def hexdigest(self) -> str:
        parts = [f.result() for f in self._futures]
        return hashlib.sha256(b"".join(parts)).hexdigest()

    def wait(self) -> None:
        for f in self._futures:
            f.exception()


def _gated(gate: _Gate, parts: Sequence[memoryview]) -> bytes:
    with gate:
        return _sha256(parts)


def start(views: Sequence[memoryview], *, concurrency: int | None = None) -> Pending:
    """Start hashing ``views`` (in order, as one byte stream) in the background (:data:`TREE`).

    Args:
        views: the bytes; the caller keeps them unchanged until :meth:`Pending.hexdigest` returns.
        concurrency: pieces hashed at once until :meth:`Pending.widen` (default: one per core). A writer
            that copies the same bytes into the page cache meanwhile passes one less than the cores.
    """
    pool = _executor()
    gate = _Gate(concurrency or workers())
    return Pending([pool.submit(_gated, gate, g) for g in pieces(views)], gate)


def digest(views: Sequence[memoryview]) -> str:
    """The :data:`TREE` hex digest of ``views`` (in order, as one byte stream)."""
    return start(views).hexdigest()
