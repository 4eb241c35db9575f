"""The node's directory as each side sees it: :class:`AgentChannel` (the torchrun agent's ``etcd3`` handler)
and :class:`WorkerChannel` (a worker process).

Every message is a small JSON file replaced atomically (written beside, then renamed), so a reader never sees
half a record and a writer that dies leaves nothing half-written. What the other side wrote is decoded by
the message types of :mod:`elastic_train.node.messages`, which validate every field: a file that does not
decode is treated as absent.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from elastic_train.envvars import ENV_NODE_DIR
from elastic_train.node.beat import Beat, Beats, clear_beats, read_beats
from elastic_train.node.messages import (
    REFORMATION,
    Assignment,
    Change,
    Cut,
    Ended,
    Fallback,
    Finished,
    Outcome,
    Ready,
    Request,
    ScriptStart,
    Standby,
    Stats,
    Trained,
)
from elastic_train.node.stats import StatsCounter

#: Seconds between two looks at the assignment while a worker waits for it.
POLL_INTERVAL = 0.005
#: Largest file a reader reads (every message is far smaller).
_MAX_BYTES = 64 * 1024

M = TypeVar("M")


class _Directory:
    """Atomic JSON files in one directory."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def _write(self, name: str, record: Mapping[str, Any]) -> None:
        path = self._path(name)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(dict(record), f)
        os.replace(tmp, path)

    def _read(self, name: str, kind: Any) -> Any:
        """The message of type ``kind`` in file ``name``, or None (absent, unreadable, or malformed)."""
        try:
            with open(self._path(name), encoding="utf-8") as f:
                d = json.loads(f.read(_MAX_BYTES))
            return kind.decode(d) if isinstance(d, dict) else None
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def _per_rank(self, kind: Any) -> dict[int, Any]:
        """Rank (or PID) → the message of type ``kind`` in ``<kind.PREFIX><rank>.json`` (malformed ones left
        out)."""
        out: dict[int, Any] = {}
        try:
            names = os.listdir(self.directory)
        except OSError:
            return out
        prefix = kind.PREFIX
        for name in names:
            if name.startswith(prefix) and name.endswith(".json"):
                rank = name[len(prefix) : -len(".json")]
                if rank.isdigit() and len(rank) < 8:
                    message = self._read(name, kind)
                    if message is not None:
                        out[int(rank)] = message
        return out

    def _remove(self, kinds: Iterable[Any]) -> None:
        files = {k.FILE for k in kinds if hasattr(k, "FILE")}
        prefixes = tuple(k.PREFIX for k in kinds if hasattr(k, "PREFIX"))
        with contextlib.suppress(OSError):
            for name in os.listdir(self.directory):
                if name in files or (prefixes and name.startswith(prefixes)):
                    with contextlib.suppress(OSError):
                        os.unlink(self._path(name))


class AgentChannel(_Directory):
    """The agent's side of its node's directory (it creates the directory and names it in
    :data:`~elastic_train.envvars.ENV_NODE_DIR` for the workers it starts).

    Exactly one place writes a worker's round: :meth:`assign`.
    """

    # -- to the workers ------------------------------------------------------------------------------------
    def assign(self, assignment: Assignment) -> None:
        """Where the workers train next: written before torchrun starts them, and after each round formed
        in-process."""
        self._write(Assignment.FILE, assignment.encode())

    def announce(self, round: int) -> None:
        """The group of ``round`` must re-form: the workers stop at their next step boundary."""
        self._write(Change.FILE, Change(round).encode())

    def cut(self, round: int) -> None:
        """Ask the workers of ``round`` to cut their group's connections (a stopped peer blocks them)."""
        self._write(Cut.FILE, Cut(round).encode())

    def end(self, message: str) -> None:
        """Tell standby workers that the run ended before they were admitted (they exit with status 0)."""
        self._write(Ended.FILE, Ended(message).encode())

    def give_up(self, reason: str) -> None:
        """Tell waiting workers that no assignment will come (the agent restarts them instead)."""
        self._write(Fallback.FILE, Fallback(reason).encode())

    def start_group(self) -> None:
        """torchrun starts a new worker group: forget everything of the last one's re-formation (its
        outcomes are read and cleared by :meth:`take_outcomes`; the trained mark and the beats stay)."""
        self._remove(REFORMATION)

    # -- from the workers ----------------------------------------------------------------------------------
    def ready(self) -> dict[int, Ready]:
        """Local rank → its registration for in-process re-formation."""
        return self._per_rank(Ready)

    def cuttable(self) -> bool:
        """True when every registered worker cuts its group's connections when asked."""
        registered = self.ready().values()
        return bool(registered) and all(r.cut for r in registered)

    def requests(self) -> dict[int, Request]:
        """Local rank → its latest request for the next round."""
        return self._per_rank(Request)

    def standbys(self) -> dict[int, Standby]:
        """Local rank → its standby record (built, waiting for admission)."""
        return self._per_rank(Standby)

    def assignment(self) -> Assignment | None:
        """The assignment last published."""
        return self._read(Assignment.FILE, Assignment)

    def fallback(self) -> str | None:
        f = self._read(Fallback.FILE, Fallback)
        return f.reason if f is not None else None

    def outcomes(self) -> list[Outcome]:
        """The outcomes the last worker group left, by rank."""
        return [o for _, o in sorted(self._per_rank(Outcome).items())]

    def take_outcomes(self) -> list[Outcome]:
        """:meth:`outcomes`, removed (before the next worker group starts), script start and finished marks
        with them."""
        outcomes = self.outcomes()
        self._remove((Outcome, ScriptStart, Finished))
        return outcomes

    def finished(self) -> int | None:
        """The step at which every worker of this node's group marked its training ended (its final
        checkpoint committed), else None: from then on nothing the node runs trains or publishes."""
        marks = list(self._per_rank(Finished).values())
        if not marks or len(marks) < max(m.local_workers for m in marks):
            return None
        return max(m.step for m in marks)

    def trained(self) -> Trained | None:
        """The mark of a worker of this node that committed (or resumed past) a step, if any."""
        return self._read(Trained.FILE, Trained)

    def script_clock(self) -> tuple[bool, float | None] | None:
        """How far this node's scripts got: None when none marked a start (not run by the stand-in); else
        (some still wait to start, when the last of the started ones started, on ``time.monotonic()``)."""
        starts = self._per_rank(ScriptStart).values()
        if not starts:
            return None
        started = [s.at for s in starts if s.at is not None]
        return len(started) < len(starts), max(started) if started else None

    def beats(self) -> dict[int, Beats]:
        """The workers' step counters, by PID."""
        return read_beats(self.directory)

    def stats(self) -> dict[int, Stats]:
        """The workers' figures for the metrics, by PID (a file whose PID differs from its name's is left
        out)."""
        return {pid: s for pid, s in self._per_rank(Stats).items() if s.pid == pid}

    def forget_stats(self, pid: int) -> None:
        """Remove the figures of worker ``pid`` (it exited and the agent kept its totals)."""
        with contextlib.suppress(OSError):
            os.unlink(self._path(f"{Stats.PREFIX}{pid}.json"))

    def clear_beats(self) -> None:
        clear_beats(self.directory)


class WorkerChannel(_Directory):
    """A worker's side of its node's directory.

    Args:
        directory: the node's directory.
        local_rank: this worker's rank on the node.
    """

    def __init__(self, directory: str, local_rank: int = 0) -> None:
        super().__init__(directory)
        self.local_rank = local_rank

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> WorkerChannel | None:
        """The channel the agent named, or None (not started by an ``etcd3`` agent)."""
        directory = environ.get(ENV_NODE_DIR)
        if not directory or not os.path.isdir(directory):
            return None
        local = environ.get("LOCAL_RANK", "0")
        return cls(directory, int(local) if local.isdigit() else 0)

    # -- from the agent ------------------------------------------------------------------------------------
    def assignment(self) -> Assignment | None:
        """The assignment the agent published last (None: none, or not one that decodes)."""
        return self._read(Assignment.FILE, Assignment)

    def wait_assignment(self, after: int, timeout: float) -> Assignment | None:
        """The first assignment of a round newer than ``after``, or None after ``timeout`` seconds, when the
        agent gave up on re-forming in-process (its workers are restarted instead) or when the run ended."""
        deadline = time.monotonic() + timeout
        while True:
            a = self.assignment()
            if a is not None and a.round > after:
                return a
            if self.fallback() is not None or self.ended() is not None or time.monotonic() >= deadline:
                return None
            time.sleep(POLL_INTERVAL)

    def change_after(self, round: int) -> bool:
        """True when the agent announced that the group of ``round`` (or a later one) must re-form."""
        if not os.path.exists(self._path(Change.FILE)):  # one stat in the common case
            return False
        c = self._read(Change.FILE, Change)
        return c is not None and c.round >= round

    def cut_asked(self, round: int) -> bool:
        """True when the agent asked the workers of ``round`` (or a later one) to cut their group's
        connections."""
        if not os.path.exists(self._path(Cut.FILE)):
            return False
        c = self._read(Cut.FILE, Cut)
        return c is not None and c.round >= round

    def ended(self) -> str | None:
        e = self._read(Ended.FILE, Ended)
        return e.message if e is not None else None

    def fallback(self) -> str | None:
        f = self._read(Fallback.FILE, Fallback)
        return f.reason if f is not None else None

    # -- to the agent --------------------------------------------------------------------------------------
    def register(self, round: int, *, cut: bool = False) -> None:
        """This worker re-forms in-process from ``round`` on (written once its group formed)."""
        self._write(f"{Ready.PREFIX}{self.local_rank}.json", Ready(round, os.getpid(), cut).encode())

    def request(self, round: int, reason: str) -> None:
        """The group of ``round`` failed or stopped here; this worker waits for the next assignment."""
        self._write(f"{Request.PREFIX}{self.local_rank}.json", Request(round, reason).encode())

    def standby(self, round: int) -> None:
        """This standby worker built what it trains and asks to join the round after ``round``."""
        self._write(f"{Standby.PREFIX}{self.local_rank}.json", Standby(round, os.getpid()).encode())

    def outcome(self, rank: int) -> Outcome | None:
        """What the worker of global rank ``rank`` reported (the stand-in completes a worker's own report)."""
        return self._read(f"{Outcome.PREFIX}{rank}.json", Outcome)

    def report(self, outcome: Outcome) -> None:
        """Leave this worker's outcome for the agent (best effort: an agent that went away reads nothing)."""
        with contextlib.suppress(OSError):
            self._write(f"{Outcome.PREFIX}{outcome.rank}.json", outcome.encode())

    def mark_trained(self, round: int | None) -> None:
        """A worker of this node committed (or resumed past) a step in ``round`` (best effort)."""
        with contextlib.suppress(OSError):
            self._write(Trained.FILE, Trained(round).encode())

    def mark_finished(self, step: int, local_workers: int, round: int | None) -> None:
        """This worker's training ended at ``step`` (the final checkpoint committed) in ``round``, one of
        ``local_workers`` on the node (best effort)."""
        with contextlib.suppress(OSError):
            mark = Finished(step, max(1, local_workers), round)
            self._write(f"{Finished.PREFIX}{self.local_rank}.json", mark.encode())

    def mark_script(self, rank: int, *, started: bool) -> None:
        """The stand-in's script of ``rank`` waits to start (``started=False``) or started now."""
        with contextlib.suppress(OSError):
            at = time.monotonic() if started else None
            self._write(f"{ScriptStart.PREFIX}{rank}.json", ScriptStart(rank, at).encode())

    def beat(self) -> Beat:
        """This process's step counter in the directory."""
        return Beat(self.directory)

    def report_stats(self, stats: Stats) -> None:
        """Replace this process's figures for the agent's metrics (best effort)."""
        with contextlib.suppress(OSError):
            self._write(f"{Stats.PREFIX}{stats.pid}.json", stats.encode())

    def stats_counter(self) -> StatsCounter:
        """This process's counts for the agent's metrics, reported through this channel."""
        return StatsCounter(self.report_stats)
