"""Reading the event stream the workers write (``ELASTIC_TRAIN_EVENTS``), incrementally."""

from __future__ import annotations

import json
import os
from typing import Any


class EventTail:
    """Follows a JSON-lines file that other processes append to; yields only complete new lines."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def poll(self) -> list[dict[str, Any]]:
        """Return the events appended since the last call (malformed lines are skipped)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()
        events = []
        for line in lines:
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict):
                events.append(event)
        return events


def read_all(path: str) -> list[dict[str, Any]]:
    """Every complete event in ``path`` (empty when it does not exist)."""
    if not os.path.exists(path):
        return []
    return EventTail(path).poll()
