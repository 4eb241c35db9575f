"""durable.LineageWrite: rank 0's record of where its world starts, written beside the restore.

A storage error writing it costs a warning, not the restore (the manifests still fence a stale writer);
any other error of the write is raised by ``wait`` unless the restore is already raising its own.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import structlog

from elastic_train.checkpoint import durable
from elastic_train.checkpoint.errors import StorageError
from elastic_train.checkpoint.storage import open_storage


class Faulty:
    """A storage whose ``write_small`` (or ``listdir`` and ``read``) raises ``error``; ``gate`` holds the
    write until it is set."""

    def __init__(
        self, inner: Any, *, write: BaseException | None = None, read: BaseException | None = None
    ) -> None:
        self.inner, self.write_error, self.read_error = inner, write, read
        self.gate = threading.Event()
        self.gate.set()

    def join(self, *parts: str) -> str:
        return str(self.inner.join(*parts))

    def listdir(self, path: str) -> list[str]:
        if self.read_error is not None:
            raise self.read_error
        return list(self.inner.listdir(path))

    def read(self, path: str) -> bytes:
        if self.read_error is not None:
            raise self.read_error
        return bytes(self.inner.read(path))

    def write_small(self, path: str, data: bytes) -> None:
        self.gate.wait(10)
        if self.write_error is not None:
            raise self.write_error
        self.inner.write_small(path, data)


@pytest.fixture
def store(tmp_path: Path) -> Any:
    (tmp_path / "run").mkdir()
    return open_storage(str(tmp_path))


@pytest.fixture
def run(tmp_path: Path) -> str:
    return str(tmp_path / "run")


def test_the_record_is_written_by_the_time_wait_returns(store: Any, run: str) -> None:
    faulty = Faulty(store)
    faulty.gate.clear()  # the write is held: the restore goes on meanwhile
    write = durable.LineageWrite(faulty, run, 3, 40)  # type: ignore[arg-type]
    assert write.stamp == 3
    assert durable.read_lineage(store, run) == []
    faulty.gate.set()
    write.wait()
    assert durable.read_lineage(store, run) == [(3, 40)]
    # A second attempt of the same world (a torn slot) keeps its round and replaces the base.
    again = durable.LineageWrite(store, run, 4, 38, again=3)
    again.wait()
    assert again.stamp == 3 and durable.read_lineage(store, run) == [(3, 38)]


def test_a_storage_error_is_logged_not_raised(store: Any, run: str) -> None:
    with structlog.testing.capture_logs() as logs:
        failing_write = durable.LineageWrite(Faulty(store, write=StorageError("disk full")), run, 5, 10)  # type: ignore[arg-type]
        failing_write.wait()
        failing_read = durable.LineageWrite(Faulty(store, read=StorageError("gone")), run, 6, 12)  # type: ignore[arg-type]
        failing_read.wait()
    assert failing_write.stamp == 5
    said = [(e["round"], e["base"], e["error"]) for e in logs if e["event"] == "lineage_not_recorded"]
    assert said == [(5, 10, "disk full")]
    # An old record or listing that cannot be read is no reason to skip writing the new one.
    assert failing_read.stamp == 6 and durable.read_lineage(store, run) == [(6, 12)]


def test_another_error_of_the_write_is_raised_unless_the_restore_raises_its_own(store: Any, run: str) -> None:
    write = durable.LineageWrite(Faulty(store, write=RuntimeError("bug")), run, 2, 0)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="bug"):
        write.wait()
    quiet = durable.LineageWrite(Faulty(store, write=RuntimeError("bug")), run, 2, 0)  # type: ignore[arg-type]
    quiet.wait(quiet=True)
