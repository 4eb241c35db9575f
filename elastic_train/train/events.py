"""Progress events for the launcher: one JSON line per event, appended by global rank 0.

If the environment variable :data:`ENV_EVENTS` names a file, rank 0 appends
``{"event", "time", "round", "world_size", "step", ...}`` lines to it: ``started``, ``resumed`` (with
``source`` and ``from_step``), ``step`` (``loss``, ``samples_per_s``, ``epoch``), ``checkpoint`` (``seconds``,
``bytes``), ``shares`` (speed-weighted shares changed: ``old``, ``new``, the costs behind it) and ``done``,
through :class:`~elastic_train.train.jsonl.JsonLinesWriter` (lines of successive
worker generations never interleave).
"""

from __future__ import annotations

import os
import time
from typing import Any

from elastic_train.envvars import ENV_EVENTS
from elastic_train.train.jsonl import JsonLinesWriter, read_json_lines

EVENTS = ("started", "resumed", "step", "checkpoint", "shares", "done")


class EventWriter:
    """Appends events to one file; a no-op when ``path`` is ``None``.

    Args:
        path: the events file (created if missing), or ``None`` for no events.
        round: rendezvous round of this worker group, written into every event.
        world_size: world size of this worker group, written into every event.
    """

    def __init__(self, path: str | None, *, round: int, world_size: int) -> None:
        self._out = JsonLinesWriter(path) if path else None
        self.round = round
        self.world_size = world_size

    @classmethod
    def from_env(cls, *, rank: int, round: int, world_size: int) -> EventWriter:
        """The writer for this process: rank 0 writes to ``$ELASTIC_TRAIN_EVENTS``, other ranks nothing."""
        path = os.environ.get(ENV_EVENTS) if rank == 0 else None
        return cls(path or None, round=round, world_size=world_size)

    @property
    def enabled(self) -> bool:
        return self._out is not None

    def emit(self, event: str, step: int, **fields: Any) -> None:
        """Append one event line (``time``, ``round``, ``world_size`` and ``step`` are added)."""
        assert event in EVENTS, event
        if self._out is None:
            return
        record = {
            "event": event,
            "time": time.time(),
            "round": self.round,
            "world_size": self.world_size,
            "step": step,
            **fields,
        }
        self._out.append(record)

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None


def read_events(path: str) -> list[dict[str, Any]]:
    """All complete event lines of ``path`` in order (a torn last line from a crash is left out)."""
    return read_json_lines(path)
