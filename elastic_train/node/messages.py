"""One frozen message type per fact an agent and its workers tell each other (see :mod:`elastic_train.node`).

Each message knows its file (:data:`FILE` for one-per-node facts, :data:`PREFIX` plus the worker's rank for
per-worker ones), turns itself into a JSON object (:meth:`encode`) and back (:meth:`decode`). Everything read
from the directory is untrusted: another process wrote it (or a process of an older version, or nobody
whole), so :meth:`decode` checks every field's type and range and raises :class:`ValueError` on anything
else; a reader treats such a file as absent.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

#: Longest text kept in a message (a reason, an error line).
TEXT_MAX = 2000
#: What a worker's outcome may say (:class:`Outcome`).
OUTCOME_STATES = ("finished", "failed", "exited", "restarting")


def _int(d: Mapping[str, Any], key: str, *, low: int | None = 0, high: int | None = None) -> int:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{key}: {v!r} is not an integer")
    if (low is not None and v < low) or (high is not None and v > high):
        raise ValueError(f"{key}: {v} is out of range")
    return v


def _opt_int(d: Mapping[str, Any], key: str, **kw: Any) -> int | None:
    return None if d.get(key) is None else _int(d, key, **kw)


def _text(d: Mapping[str, Any], key: str, default: str | None = None) -> str:
    v = d.get(key, default)
    if not isinstance(v, str):
        raise ValueError(f"{key}: {v!r} is not text")
    return v[:TEXT_MAX]


def _bool(d: Mapping[str, Any], key: str, default: bool = False) -> bool:
    v = d.get(key, default)
    if not isinstance(v, bool):
        raise ValueError(f"{key}: {v!r} is not a boolean")
    return v


def seconds(v: Any) -> float:
    """A duration read from a message or a join key (untrusted): a finite number of seconds in [0, 1 day],
    else 0."""
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return 0.0
    return min(max(float(v), 0.0), 86400.0)


def _opt_seconds(d: Mapping[str, Any], key: str) -> float | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{key}: {v!r} is not a number of seconds")
    return float(v)


# -- workers → agent ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ready:
    """A worker re-forms in-process from ``round`` on (written once its group formed). The agent handles a
    membership change in-process only when every local worker registered."""

    PREFIX: ClassVar[str] = "ready-"
    round: int
    pid: int
    cut: bool = False
    """The worker cuts its group's connections when asked (:class:`Cut`; a gloo group can be cut from another
    thread)."""

    def encode(self) -> dict[str, Any]:
        return {"round": self.round, "pid": self.pid, "cut": self.cut}

    @classmethod
    def decode(cls, d: Mapping[str, Any]) -> Ready:
        return cls(_int(d, "round"), _int(d, "pid", low=1), _bool(d, "cut"))


@dataclass(frozen=True, slots=True)
class Request:
    """The worker's group of ``round`` failed (a collective error) or stopped at a step boundary; it waits for
    the next :class:`Assignment`."""

    PREFIX: ClassVar[str] = "request-"
    round: int
    reason: str

    def encode(self) -> dict[str, Any]:
        return {"round": self.round, "reason": self.reason[:500]}

    @classmethod
    def decode(cls, d: Mapping[str, Any]) -> Request:
        return cls(_int(d, "round"), _text(d, "reason", ""))


@dataclass(frozen=True, slots=True)
class Standby:
    """A worker started on standby built its model and asks to be admitted to the round after ``round``."""

    PREFIX: ClassVar[str] = "standby-"
    round: int
    pid: int

    def encode(self) -> dict[str, Any]:
        return {"round": self.round, "pid": self.pid}

    @classmethod
    def decode(cls, d: Mapping[str, Any]) -> Standby:
        return cls(_int(d, "round"), _int(d, "pid", low=1))


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a worker's training ended, by global rank: ``finished`` (at ``step``), ``failed`` for good (a
    non-retryable error: ``message`` says why), ``exited`` (the script ended with ``code``: ``message`` is
    its own error line, ``kind`` and ``where`` the exception's type and where it was raised when known) or
    ``restarting`` (it leaves for the restart path because its group could not re-form in-process: not a
    failure of the script's)."""

    PREFIX: ClassVar[str] = "rank-"
    rank: int
    state: str
    step: int | None = None
    message: str = ""
    code: int | None = None
    """The exit code (negative: the signal that ended the process)."""
    ran_s: float | None = None
    """Seconds the script ran before it exited."""
    kind: str = ""
    """The type of the exception that ended the script (``RuntimeError``), when the worker knows it."""
    where: str = ""
    """Where it was raised (``train.py:42``), when the worker knows it."""

    def encode(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "state": self.state,
            "step": self.step,
            "message": self.message[:TEXT_MAX],
            "code": self.code,
            "ran_s": self.ran_s,
            "kind": self.kind[:200],
            "where": self.where[:500],
        }

    @classmethod
    def decode(cls, d: Mapping[str, Any]) -> Outcome:
        state = _text(d, "state")
        if state not in OUTCOME_STATES:
            raise ValueError(f"state: {state!r}")
        return cls(
            rank=_int(d, "rank"),
            state=state,
            step=_opt_int(d, "step"),
            message=_text(d, "message", ""),
            code=_opt_int(d, "code", low=-255, high=255),
            ran_s=_opt_seconds(d, "ran_s"),
            kind=_text(d, "kind", "")[:200],
            where=_text(d, "where", "")[:500],
        )


@dataclass(frozen=True, slots=True)
class ScriptStart:
    """The stand-in's script of global rank ``rank`` waits to start (``at`` None) or started at ``at``
    (``time.monotonic()``, one clock for every process of the machine)."""

    PREFIX: ClassVar[str] = "start-"
    rank: int
    at: float | None

    def encode(self) -> dict[str, Any]:
        return {"rank": self.rank, "at": self.at}

    @classmethod
    def decode(cls, d: Mapping[str, Any]) -> ScriptStart:
        at = d.get("at")
        if at is not None and (isinstance(at, bool) or not isinstance(at, float) or not math.isfinite(at)):
            raise ValueError(f"at: {at!r}")
        return cls(_int(d, "rank"), at)


@dataclass(frozen=True, slots=True)
class Finished:
    """A worker's training ended: the run's final checkpoint committed (its collective returned here) at
    ``step`` in ``round``. ``local_workers`` is the node's worker count, so the agent knows when every local
    worker is done: from then on nothing of the node publishes or trains, and no membership change stops
    its workers (they exit, and torchrun's exit barrier ends the run)."""

    PREFIX: ClassVar[str] = "finished-"
    step: int
    local_workers: int
    round: int | None = None

    def encode(self) -> dict[str, Any]:
        return {"step": self.step, "local_workers": self.local_workers, "round": self.round}

    @classmethod
    def decode(cls, d: Mapping[str, Any]) -> Finished:
        return cls(_int(d, "step"), _int(d, "local_workers", low=1), _opt_int(d, "round"))


@dataclass(frozen=True, slots=True)
class Trained:
    """A worker of this node committed a step, or resumed past one (a later failure is not one at start-up);
    ``round`` is the worker's round then."""

    FILE: ClassVar[str] = "trained.json"
    round: int | None = None

    def encode(self) -> dict[str, Any]:
        return {"round": self.round}

    @classmethod
    def decode(cls, d: Mapping[str, Any]) -> Trained:
        return cls(_opt_int(d, "round"))


def _number(d: Mapping[str, Any], key: str) -> float:
    """A finite, non-negative number (seconds, a rate, a Unix time)."""
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{key}: {v!r} is not a non-negative number")
    return float(v)


@dataclass(frozen=True, slots=True)
class Stats:
    """A worker process's figures for its agent's metrics (docs/metrics.md), by PID: counts since the
    process started, replaced at most once a second and at once on the first step of a new round (the agent
    times its recoveries by it)."""

    PREFIX: ClassVar[str] = "stats-"
    pid: int
    round: int | None
    """The round of the worker's group at its last step (None outside a rendezvous round)."""
    step: int
    """The last step committed."""
    time: float
    """Unix time of the report."""
    round_first_step: float
    """Unix time of the first step committed in :attr:`round` (the end of a recovery)."""
    steps_per_s: float = 0.0
    """Steps per second between the last two reports (0 at a round's first)."""
    snapshots: int = 0
    """Saves of the state (the memory tier's snapshot) the training thread made."""
    snapshot_s: float = 0.0
    """Seconds the training thread spent in them."""
    snapshot_last_s: float = 0.0
    durables: int = 0
    """Durable checkpoints committed (by the job's rank 0)."""
    durable_s: float = 0.0
    """Their seconds, each from its save to its commit."""
    durable_last_s: float = 0.0
    durable_bytes: int = 0
    busy_s: float | None = None
    """This worker's mean busy time per step since the last report: the step's wall time less the time it
    waited for its gradient all-reduce (docs/stragglers.md); None when no step was timed. The mean, not the
    median: a node stalled for one step in three loses a third of its pace, which the median hides."""
    busy_steps: int = 0
    """Steps that mean is of."""

    def encode(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "round": self.round,
            "step": self.step,
            "time": self.time,
            "round_first_step": self.round_first_step,
            "steps_per_s": self.steps_per_s,
            "snapshots": self.snapshots,
            "snapshot_s": self.snapshot_s,
            "snapshot_last_s": self.snapshot_last_s,
            "durables": self.durables,
            "durable_s": self.durable_s,
            "durable_last_s": self.durable_last_s,
            "durable_bytes": self.durable_bytes,
            "busy_s": self.busy_s,
            "busy_steps": self.busy_steps,
        }

    @classmethod
    def decode(cls, d: Mapping[str, Any]) -> Stats:
        return cls(
            pid=_int(d, "pid", low=1),
            round=_opt_int(d, "round"),
            step=_int(d, "step"),
            time=_number(d, "time"),
            round_first_step=_number(d, "round_first_step"),
            steps_per_s=_number(d, "steps_per_s"),
            snapshots=_int(d, "snapshots"),
            snapshot_s=_number(d, "snapshot_s"),
            snapshot_last_s=_number(d, "snapshot_last_s"),
            durables=_int(d, "durables"),
            durable_s=_number(d, "durable_s"),
            durable_last_s=_number(d, "durable_last_s"),
            durable_bytes=_int(d, "durable_bytes"),
            busy_s=_number(d, "busy_s") if d.get("busy_s") is not None else None,
            busy_steps=_int(d, "busy_steps") if "busy_steps" in d else 0,
        )


# -- agent → workers ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Assignment:
    """Where this node's workers train: the one record of a worker's round.

    Published by the agent before torchrun starts a worker group (``ranks`` empty: torchrun's environment
    gives each worker its rank), for a standby start (``standby_s`` set: the workers build, then wait that
    long to be admitted) and after every round formed in-process (``ranks`` set: the new global rank of each
    local worker).
    """

    FILE: ClassVar[str] = "assignment.json"
    round: int
    node_rank: int
    """This node's rank among the round's nodes."""
    nodes: int
    """Nodes in the round."""
    master_addr: str
    master_port: int
    ranks: tuple[int, ...] = ()
    """Global rank of each local worker, by local rank (empty: torchrun's environment says)."""
    world_size: int = 0
    """Workers in the round (0 with ``ranks`` empty)."""
    standby_s: float | None = None
    """Set for a standby start: seconds the workers may wait to be admitted to the running job."""
    reform: bool = False
    """The agent re-forms this node's worker group in-process on membership changes (hot recovery)."""

    def __post_init__(self) -> None:
        if not (0 <= self.node_rank < self.nodes and 0 < self.master_port < 65536 and self.round >= 0):
            raise ValueError(f"inconsistent assignment {self!r}")
        if self.ranks and not all(0 <= r < self.world_size for r in self.ranks):
            raise ValueError(f"inconsistent assignment {self!r}")
        if not self.ranks and self.world_size != 0:
            raise ValueError(f"inconsistent assignment {self!r}")

    def rank(self, local_rank: int) -> int:
        """Global rank of local worker ``local_rank``."""
        return self.ranks[local_rank]

    def encode(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "node_rank": self.node_rank,
            "nodes": self.nodes,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "ranks": list(self.ranks),
            "world_size": self.world_size,
            "standby_s": self.standby_s,
            "reform": self.reform,
        }

    @classmethod
    def decode(cls, d: Mapping[str, Any]) -> Assignment:
        ranks = d.get("ranks", [])
        if not isinstance(ranks, list) or len(ranks) > 4096:
            raise ValueError(f"ranks: {ranks!r}")
        return cls(
            round=_int(d, "round"),
            node_rank=_int(d, "node_rank"),
            nodes=_int(d, "nodes", low=1),
            master_addr=_text(d, "master_addr"),
            master_port=_int(d, "master_port"),
            ranks=tuple(_int({"r": r}, "r") for r in ranks),
            world_size=_int(d, "world_size") if "world_size" in d else 0,
            standby_s=_opt_seconds(d, "standby_s"),
            reform=_bool(d, "reform"),
        )


@dataclass(frozen=True, slots=True)
class Change:
    """The group of ``round`` must re-form: workers stop at their next step boundary."""

    FILE: ClassVar[str] = "change.json"
    round: int

    def encode(self) -> dict[str, Any]:
        return {"round": self.round}

    @classmethod
    def decode(cls, d: Mapping[str, Any]) -> Change:
        return cls(_int(d, "round"))


@dataclass(frozen=True, slots=True)
class Cut:
    """The workers of ``round`` are blocked in a collective with a member whose lease expired (a stopped
    peer): cut the group's connections, so that the collective fails and the group re-forms without it."""

    FILE: ClassVar[str] = "cut.json"
    round: int

    def encode(self) -> dict[str, Any]:
        return {"round": self.round}

    @classmethod
    def decode(cls, d: Mapping[str, Any]) -> Cut:
        return cls(_int(d, "round"))


@dataclass(frozen=True, slots=True)
class Ended:
    """The run ended before this node's standby workers were admitted: they exit with status 0."""

    FILE: ClassVar[str] = "ended.json"
    message: str

    def encode(self) -> dict[str, Any]:
        return {"message": self.message[:500]}

    @classmethod
    def decode(cls, d: Mapping[str, Any]) -> Ended:
        return cls(_text(d, "message", ""))


@dataclass(frozen=True, slots=True)
class Fallback:
    """The agent gave up re-forming in-process: no assignment comes, torchrun restarts the workers."""

    FILE: ClassVar[str] = "fallback.json"
    reason: str

    def encode(self) -> dict[str, Any]:
        return {"reason": self.reason[:500]}

    @classmethod
    def decode(cls, d: Mapping[str, Any]) -> Fallback:
        return cls(_text(d, "reason", ""))


#: The messages of one worker group's in-process re-formation, removed when torchrun starts a new group.
REFORMATION = (Ready, Request, Standby, Assignment, Change, Cut, Ended, Fallback)
#: Every message type, for the tests of the round trip.
ALL = (*REFORMATION, Finished, Outcome, ScriptStart, Stats, Trained)

__all__ = [
    "ALL",
    "OUTCOME_STATES",
    "REFORMATION",
    "Assignment",
    "Change",
    "Cut",
    "Ended",
    "Fallback",
    "Finished",
    "Outcome",
    "Ready",
    "Request",
    "ScriptStart",
    "Standby",
    "Stats",
    "Trained",
    "seconds",
]
