"""A run's lifecycle and rendezvous state as read from etcd (``elastic-train status``, ``local`` reports).

States: ``waiting`` (no round yet), ``running``, ``restarting`` (nodes asked for a new round or a member is
lost), ``stopped`` (no node holds the run and it did not finish: starting it again resumes it), ``finished``
(when, at which step) and ``failed`` (why). A run id with no keys at all does not exist
(never started, or its record expired). Everything read back is untrusted: a malformed key is reported as
such, never a traceback.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from elastic_train.etcd.client import Etcd
from elastic_train.rendezvous.budget import BudgetRecord
from elastic_train.rendezvous.config import run_prefix
from elastic_train.rendezvous.records import RoundRecord, decode_join
from elastic_train.straggler.record import StragglerRecord


@dataclass(slots=True)
class Member:
    """One node of the current round."""

    node: str
    addr: str | None
    rank: int
    alive: bool


@dataclass(slots=True)
class JobStatus:
    """Snapshot of a run's rendezvous keys."""

    run_id: str
    round: int
    """Last closed round (0: none yet)."""
    state: str
    """"waiting", "running", "restarting", "stopped", "finished" or "failed" (see the module docstring)."""
    exists: bool = True
    """False when etcd holds no key of the run."""
    members: list[Member] = field(default_factory=list)
    world_size: int = 0
    waiting: list[str] = field(default_factory=list)
    """Nodes that asked for a round after the current one."""
    live_nodes: int = 0
    """Nodes holding a lease on the run (members or not)."""
    failures_used: int = 0
    """Failures over the run's life."""
    failure_budget: int | None = None
    failure_window: float | None = None
    """Seconds over which ``failure_budget`` counts failures (0: the run's life; None: not recorded)."""
    failures_in_window: int = 0
    """Failures counted against the budget now (those in the window)."""
    leaves: int = 0
    """Members that left cleanly (SIGTERM), not counted against the budget."""
    closed: bool = False
    message: str = ""
    """Why the run failed (or the finishing node's note)."""
    finished_step: int | None = None
    """Step the run finished at (when the workers reported it)."""
    closed_at: float | None = None
    """Unix time the run finished or failed."""
    identity: dict[str, Any] = field(default_factory=dict)
    """The settings every node of the run shares (readable copy)."""
    fingerprint: str | None = None
    stragglers: list[StragglerRecord] = field(default_factory=list)
    """Slow nodes: flagged, evicted or on probation (``straggler/<node>``)."""
    unreadable: list[str] = field(default_factory=list)
    """Keys of the run that could not be read (their names)."""

    @property
    def failures_left(self) -> int | None:
        """Failures the run may still survive (None when its budget is not recorded)."""
        if self.failure_budget is None:
            return None
        return max(0, self.failure_budget - self.failures_in_window)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "failures_left": self.failures_left}


def _json(raw: bytes | None) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        d = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return d if isinstance(d, dict) else {}


def _round(raw: bytes | None) -> RoundRecord | None:
    """The run's last round; None before the first, or when its record does not decode."""
    if raw is None:
        return None
    try:
        return RoundRecord.decode(raw)
    except ValueError:
        return None


def _int(value: Any, default: int = 0) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def read_status(etcd: Etcd, run_id: str) -> JobStatus:
    """Read the run's keys once (one range request) and summarize them.

    Args:
        etcd: a connected client.
        run_id: the job's run id (validated).

    Raises:
        EtcdError: etcd failed.
    """
    prefix = run_prefix(run_id)
    kvs, _ = etcd.get_prefix(prefix)
    keys = {kv.key[len(prefix) :]: kv.value for kv in kvs}
    if not keys:
        return JobStatus(run_id=run_id, round=0, state="unknown", exists=False)
    live = {k[len("nodes/") :] for k in keys if k.startswith("nodes/")}
    rec = _round(keys.get("round"))
    cfg = _json(keys.get("config")) or {}
    closed = _json(keys.get("closed"))
    ident = _json(keys.get("identity")) or {}
    rnd = rec.round if rec else 0
    members = []
    for rank, node in enumerate(rec.members if rec else []):
        entry = rec.nodes.get(node) if rec else None
        addr = entry.get("addr") if isinstance(entry, dict) else None
        members.append(Member(node=node, addr=addr, rank=rank, alive=node in live))
    stragglers, unreadable = [], []
    for k, v in sorted(keys.items()):
        if k.startswith("straggler/"):
            try:
                stragglers.append(StragglerRecord.decode(k[len("straggler/") :], v))
            except ValueError:
                unreadable.append(k)
    waiting = []
    for kv in kvs:
        name = kv.key[len(prefix) :]
        if name.startswith("join/"):
            j = decode_join(name[len("join/") :], kv)
            if j is not None and j.target > rnd and j.node_id in live:
                waiting.append(j.node_id)
    if closed is not None:
        state = "finished" if closed.get("reason") == "finished" else "failed"
    elif rec is None:
        state = "waiting"
    elif not live:
        state = "stopped"
    elif waiting or any(not m.alive for m in members):
        state = "restarting"
    else:
        state = "running"
    step = closed.get("step") if closed else None
    at = closed.get("time") if closed else None
    budget = cfg.get("failure_budget")
    window = cfg.get("failure_window", 0)  # a run recorded before windows counted its whole life
    window = float(window) if isinstance(window, int | float) and not isinstance(window, bool) else 0.0
    used = _int(keys.get("failures", b"0"))
    record = BudgetRecord.decode(keys.get("budget"))
    settings = ident.get("settings")
    return JobStatus(
        run_id=run_id,
        round=rnd,
        state=state,
        members=members,
        world_size=len(members),
        waiting=sorted(waiting),
        live_nodes=len(live),
        failures_used=used,
        failure_budget=budget if isinstance(budget, int) and not isinstance(budget, bool) else None,
        failure_window=window,
        failures_in_window=used if window <= 0 else min(used, record.in_window(time.time(), window)),
        leaves=record.leaves,
        closed=closed is not None,
        message=str(closed.get("message", "")) if closed else "",
        finished_step=step if isinstance(step, int) and state == "finished" else None,
        closed_at=float(at) if isinstance(at, int | float) else None,
        identity=settings if isinstance(settings, dict) else {},
        fingerprint=str(ident["fingerprint"]) if "fingerprint" in ident else None,
        stragglers=stragglers,
        unreadable=unreadable,
    )
