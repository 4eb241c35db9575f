"""Workers' figures for their agent's metrics: one small JSON file per worker process, ``stats-<pid>.json``,
in the agent's directory (:data:`~elastic_train.envvars.ENV_OUTCOME_DIR`, which the worker already has).

A worker calls :func:`record_step` after each committed step (``Checkpointer`` does); the file is rewritten
atomically at most once a second, and at once on the first step of a new round (the agent times its
recoveries by it). The agent reads every worker's file at scrape time (:func:`read_stats`); what it reads is
checked like anything read back: a malformed file is skipped. Outside an agent's directory nothing is written.

This is the seam to re-point when the agent and its workers share a typed channel: one message with these
fields per step (or per second) carries the same facts.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from elastic_train.envvars import ENV_OUTCOME_DIR

#: File name prefix of a worker's stats (``stats-<pid>.json``) in the agent's directory.
STATS_PREFIX = "stats-"
#: Least seconds between two writes of a worker's file (the first step of a round is written at once).
WRITE_EVERY = 1.0


@dataclass(slots=True)
class Timing:
    """Count, total and last of one kind of timed work."""

    count: int = 0
    sum: float = 0.0
    last: float = 0.0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.sum += seconds
        self.last = seconds


@dataclass(slots=True)
class WorkerStats:
    """What one worker process reports."""

    pid: int
    rank: int = 0
    local_rank: int = 0
    round: int | None = None
    """Rendezvous round of the worker's group at its last step."""
    step: int = 0
    """The last step committed."""
    time: float = 0.0
    """Unix time of that step."""
    round_first_step: float | None = None
    """Unix time of the first step committed in :attr:`round` (the end of a recovery)."""
    steps_per_s: float = 0.0
    """Steps per second between the last two writes."""
    snapshot: Timing = field(default_factory=Timing)
    """Seconds the training thread spent in each save of the state (the memory tier's snapshot)."""
    durable: Timing = field(default_factory=Timing)
    """Seconds of each durable checkpoint, from its save to its commit."""
    durable_bytes: int = 0
    """Bytes of the durable checkpoints committed."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(d: Any) -> WorkerStats | None:
        """A worker's stats read back (untrusted): None unless every field has its type."""
        if not isinstance(d, dict):
            return None
        try:
            out = WorkerStats(
                pid=_int(d["pid"]),
                rank=_int(d.get("rank", 0)),
                local_rank=_int(d.get("local_rank", 0)),
                round=None if d.get("round") is None else _int(d["round"]),
                step=_int(d.get("step", 0)),
                time=_num(d.get("time", 0.0)),
                round_first_step=None if d.get("round_first_step") is None else _num(d["round_first_step"]),
                steps_per_s=_num(d.get("steps_per_s", 0.0)),
                snapshot=_timing(d.get("snapshot")),
                durable=_timing(d.get("durable")),
                durable_bytes=_int(d.get("durable_bytes", 0)),
            )
        except (KeyError, TypeError, ValueError):
            return None
        return out


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(v)
    return v


def _num(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
        raise ValueError(v)
    return float(v)


def _timing(d: Any) -> Timing:
    if not isinstance(d, dict):
        raise ValueError(d)
    return Timing(_int(d.get("count", 0)), _num(d.get("sum", 0.0)), _num(d.get("last", 0.0)))


class StatsWriter:
    """This process's stats file (one per worker process; see :func:`writer`)."""

    def __init__(self, directory: str | None, environ: Mapping[str, str]) -> None:
        self.directory = directory if directory and os.path.isdir(directory) else None
        self.stats = WorkerStats(
            pid=os.getpid(),
            rank=_env_int(environ, "RANK"),
            local_rank=_env_int(environ, "LOCAL_RANK"),
        )
        self._written = 0.0
        self._rate_from: tuple[float, int] | None = None
        self._durable_step: int | None = None

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def record_step(
        self,
        *,
        round: int | None,
        step: int,
        snapshot_s: float,
        durable: tuple[int, float, int] | None = None,
    ) -> None:
        """Count a committed step: its round, the seconds its save took, and the newest durable checkpoint
        committed so far (``(step, seconds, bytes)``; one already counted is not counted again)."""
        if self.directory is None:
            return
        now = time.time()
        st = self.stats
        new_round = round != st.round or st.round_first_step is None
        if new_round:
            st.round, st.round_first_step = round, now
        st.step, st.time = step, now
        st.snapshot.add(max(0.0, snapshot_s))
        if durable is not None and durable[0] != self._durable_step:
            self._durable_step = durable[0]
            st.durable.add(max(0.0, durable[1]))
            st.durable_bytes += max(0, durable[2])
        if new_round or now - self._written >= WRITE_EVERY:
            if self._rate_from is not None and not new_round and now > self._rate_from[0]:
                st.steps_per_s = max(0.0, (step - self._rate_from[1]) / (now - self._rate_from[0]))
            self._rate_from = (now, step)
            self._write(now)

    def _write(self, now: float) -> None:
        assert self.directory is not None
        path = os.path.join(self.directory, f"{STATS_PREFIX}{self.stats.pid}.json")
        tmp = f"{path}.tmp"
        with contextlib.suppress(OSError):
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.stats.to_json(), f)
            os.replace(tmp, path)
            self._written = now


def _env_int(environ: Mapping[str, str], name: str) -> int:
    raw = environ.get(name, "")
    return int(raw) if raw.isdigit() else 0


_WRITER: StatsWriter | None = None


def writer(environ: Mapping[str, str] | None = None) -> StatsWriter:
    """This process's :class:`StatsWriter` (created on first use from the environment)."""
    global _WRITER
    if _WRITER is None or _WRITER.stats.pid != os.getpid():  # a forked child writes its own file
        env = os.environ if environ is None else environ
        _WRITER = StatsWriter(env.get(ENV_OUTCOME_DIR), env)
    return _WRITER


def read_stats(directory: str) -> dict[int, WorkerStats]:
    """Every worker's stats in an agent's directory, by pid (unreadable or malformed files left out)."""
    out: dict[int, WorkerStats] = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return out
    for name in names:
        if not (name.startswith(STATS_PREFIX) and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                st = WorkerStats.from_json(json.load(f))
        except (OSError, ValueError):
            continue
        if st is not None and name == f"{STATS_PREFIX}{st.pid}.json":
            out[st.pid] = st
    return out


def forget(directory: str, pid: int) -> None:
    """Remove a worker's stats file (the agent does, once it counted a finished process's totals)."""
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(directory, f"{STATS_PREFIX}{pid}.json"))
