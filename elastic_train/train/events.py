"""Progress events for the launcher: one JSON line per event, appended by global rank 0.

If the environment variable :data:`ENV_EVENTS` names a file, rank 0 appends
``{"event", "time", "round", "world_size", "step", ...}`` lines to it: ``started``, ``resumed`` (with
``source`` and ``from_step``), ``step`` (``loss``, ``samples_per_s``, ``epoch``), ``checkpoint`` (``seconds``,
``bytes``) and ``done``. Each line is one ``write`` on an ``O_APPEND`` descriptor, so lines from successive
worker generations never interleave and a reader never sees half a line except after a crash mid-write.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from elastic_train.envvars import ENV_EVENTS

EVENTS = ("started", "resumed", "step", "checkpoint", "done")


class EventWriter:
    """Appends events to one file; a no-op when ``path`` is ``None``.

    Args:
        path: the events file (created if missing), or ``None`` for no events.
        round: rendezvous round of this worker group, written into every event.
        world_size: world size of this worker group, written into every event.
    """

    def __init__(self, path: str | None, *, round: int, world_size: int) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else None
        self.round = round
        self.world_size = world_size

    @classmethod
    def from_env(cls, *, rank: int, round: int, world_size: int) -> EventWriter:
        """The writer for this process: rank 0 writes to ``$ELASTIC_TRAIN_EVENTS``, other ranks nothing."""
        path = os.environ.get(ENV_EVENTS) if rank == 0 else None
        return cls(path or None, round=round, world_size=world_size)

    @property
    def enabled(self) -> bool:
        return self._fd is not None

    def emit(self, event: str, step: int, **fields: Any) -> None:
        """Append one event line (``time``, ``round``, ``world_size`` and ``step`` are added)."""
        assert event in EVENTS, event
        if self._fd is None:
            return
        record = {
            "event": event,
            "time": time.time(),
            "round": self.round,
            "world_size": self.world_size,
            "step": step,
            **fields,
        }
        os.write(self._fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_events(path: str) -> list[dict[str, Any]]:
    """All complete event lines of ``path`` in order (a torn last line from a crash is skipped)."""
    events = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events
