"""JSON-lines files that processes append to (progress events, the data audit): one writer, one reader.

A record is one JSON object on one line, written with one ``write`` on an ``O_APPEND`` descriptor, so the
lines of concurrent or successive writers never interleave. A reader can only see a torn last line: one a
writer is still writing, or one it was killed in the middle of. Readers leave such a line out (a follower
picks it up once its newline arrives), and skip a line that is not a JSON object.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any


class JsonLinesWriter:
    """Appends records to ``path`` (created if missing), one ``write`` per line."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, record: Mapping[str, Any]) -> None:
        assert self._fd is not None, f"{self.path}: writer is closed"
        os.write(self._fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class JsonLinesTail:
    """Follows a JSON-lines file that other processes append to; yields only complete new records."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def poll(self) -> list[dict[str, Any]]:
        """The records completed since the last call (none while the file does not exist)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()  # b"" after a newline, else the torn (or unfinished) last line
        return parse_json_lines(lines)


def parse_json_lines(lines: Iterable[bytes | str]) -> list[dict[str, Any]]:
    """The JSON objects among complete ``lines``, in order; blank lines, malformed ones and JSON values that
    are not objects (a log line of another format, say) are skipped."""
    records = []
    for line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def read_json_lines(path: str) -> list[dict[str, Any]]:
    """Every complete record of ``path`` in order (empty when the file does not exist)."""
    return JsonLinesTail(path).poll()
