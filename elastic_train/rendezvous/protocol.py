"""The etcd3 rendezvous protocol, without torch: one participant joining rounds.

Keys of a run, all under ``/elastic_train/<run_id>/``:

- ``nodes/<node>``  (leased) ``{"addr", "store_port", "host", "pid"}``: the node is alive.
- ``join/<node>``   (leased) ``{"target": R, "reason": ...}``: the node asks to be in round R.
- ``inproc/<node>`` (leased) present while the node's workers re-form in-process (hot recovery): a node that
  joins a round all of whose live members have it starts its workers on standby (:mod:`.standby`).
- ``round``         ``{"round", "members": [rank order], "nodes": {id: {"addr", "store_port"}}, "failure"}``:
  the last closed round, written only by a compare-and-set on its own mod revision.
- ``failures``      failures spent so far (written in the same transaction as the round it caused).
- ``budget``        ``{"times", "leaves"}``: the recent failures' times and the clean leaves
  (:mod:`elastic_train.rendezvous.budget`), written with ``failures`` or with a round a leave caused.
- ``left/<node>``   (own lease) ``{"time", "round", "reason"}``: the node left on purpose (SIGTERM,
  :mod:`elastic_train.rendezvous.leave`); the close of the next round uses and deletes it.
- ``closed``        ``{"reason": "finished"|"budget"|"failed", "message", "step", "time"}``: no more rounds.
- ``config``        ``{"failure_budget", "failure_window", "min_nodes", "max_nodes"}``: written once, by the
  first node.
- ``identity``      ``{"fingerprint", "settings", "time", "node"}``: the settings every node must share
  (:mod:`elastic_train.rendezvous.identity`), written once by the first node; a node with other settings is
  refused before it writes any key.

Lifecycle: waiting (no round yet) → running → finished | failed (``closed``). Once a run is closed, its keys
are moved onto a lease of :data:`RUN_RECORD_TTL`: the record stays readable by ``status`` and keeps the name
from being silently reopened, then expires so the name can be used again.

Per round each node writes one join key and one node closes the round with one transaction: O(N) writes.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elastic_train.etcd.client import Etcd, cmp_mod, cmp_version, op_delete, op_put
from elastic_train.etcd.errors import EtcdError
from elastic_train.log import get_logger
from elastic_train.rendezvous import budget
from elastic_train.rendezvous.config import RendezvousConfig, run_prefix
from elastic_train.rendezvous.decide import (
    FAILURE_REASONS,
    Joiner,
    assign_ranks,
    count_waiting,
    decide_close,
    hold_for_startup_reports,
    identical_startup_failure,
    is_startup_report,
)
from elastic_train.rendezvous.errors import (
    FailureBudgetExhausted,
    JobFailed,
    NodeLeft,
    RendezvousClosed,
    RendezvousJoinTimeout,
    RunRefused,
)
from elastic_train.rendezvous.identity import JobIdentity
from elastic_train.rendezvous.outcome import seconds
from elastic_train.rendezvous.view import LeaseKeeper, RunView

log = get_logger(__name__)

#: Least seconds between two evaluations of the forming round by the node expected to close it (or while that
#: is not known yet), and by every other node. A watch batch that brings no new ``round`` record within these
#: intervals is folded into the next evaluation: each one costs O(N), and in a large job a batch arrives with
#: almost every join. Others only step in when the closer is silent for a lease TTL, so they look less often.
CLOSER_EVAL_INTERVAL = 0.02
FOLLOWER_EVAL_INTERVAL = 0.25
#: Longest wait for the watch to show this node's own join before the forming round is evaluated again.
OWN_JOIN_WAIT = 0.05
#: Seconds a node leaves its workers running after members re-joined because theirs failed before any step
#: (their own failure, if it is the same, then reaches the round first; see ``_hold_for_startup_failures``).
STARTUP_REPORT_GRACE = 3.0
#: Longest such a hold lasts (``decide.hold_for_startup_reports``).
STARTUP_REPORT_HOLD_MAX = 30.0
#: Seconds a probe of a silent member's store port waits for the connection (refused: the agent is gone).
PROBE_TIMEOUT = 0.05
#: Seconds before a member whose store port accepted a probe is probed again in the same round: a killed
#: agent's port may accept while the kernel still tears the process down.
REPROBE_INTERVAL = 0.1
#: Seconds a finishing node keeps trying to write the run's ``closed`` mark while etcd is unreachable.
CLOSE_PATIENCE = 30.0
#: Seconds a closed run's record (closed mark, identity, last round, failures) stays in etcd.
RUN_RECORD_TTL = 7 * 24 * 3600
#: Keys of a run that are not on a node's lease (they outlive the nodes until the run is closed).
RUN_RECORD_KEYS = ("closed", "identity", "round", "failures", "budget", "config")
#: Seconds an identity written by a node binds the run even before that node's lease shows up (unless a round
#: closed since: its nodes were past their start).
IDENTITY_FRESH = 10.0


def run_view(etcd: Etcd, run_id: str) -> RunView:
    """A (not yet started) watch-driven view of a run's keys, as a :class:`Participant` reads them."""
    return RunView(etcd, run_prefix(run_id), activity_prefixes=("nodes/", "join/"))


def new_node_id() -> str:
    """A node id unique per agent process: host, pid and a random suffix."""
    host = socket.gethostname().split(".")[0][:40] or "node"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True, slots=True)
class RoundRecord:
    """A closed round as stored in ``round``."""

    round: int
    members: list[str]
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    failure: bool = False
    kind: str = budget.SCALE
    """What brought the run here from the round before (:func:`budget.transition_kind`; the first round:
    scale)."""

    def encode(self) -> bytes:
        return json.dumps(
            {"round": self.round, "members": self.members, "nodes": self.nodes, "failure": self.failure,
             "kind": self.kind, "time": time.time()}
        ).encode()  # fmt: skip

    @staticmethod
    def decode(raw: bytes) -> RoundRecord:
        d = json.loads(raw)
        kind = d.get("kind") if d.get("kind") in (budget.FAILURE, budget.LEAVE) else budget.SCALE
        return RoundRecord(
            int(d["round"]), list(d["members"]), dict(d.get("nodes", {})), bool(d.get("failure")), str(kind)
        )


@dataclass(frozen=True, slots=True)
class RoundResult:
    """What a participant got from a closed round."""

    round: int
    rank: int
    world_size: int
    members: list[str]
    nodes: dict[str, dict[str, Any]]


@dataclass(kw_only=True, slots=True)
class ProtocolSettings:
    run_id: str
    min_nodes: int
    max_nodes: int
    lease_ttl: float = 3.0
    settle: float = 1.0
    join_window: float | None = None
    """Seconds after the first node asked for a follow-up round before it closes without the live nodes
    that have not asked (``None``: ``settle``)."""
    join_timeout: float = 600.0
    failure_budget: int = 10
    failure_window: float = 3600.0
    """Seconds over which ``failure_budget`` failures are counted (0: the run's whole life)."""
    keepalive_interval: float | None = None
    identity: JobIdentity | None = None
    """The settings every node of the run must share (``None``: not checked)."""
    identity_wait: float = 120.0
    """Seconds a node whose identity differs from a live run's waits for that run's nodes to go away."""
    hot: bool = True
    """Membership changes are handled by the workers in-process where they can (:mod:`.hot`)."""

    @classmethod
    def from_config(cls, cfg: RendezvousConfig) -> ProtocolSettings:
        """The protocol settings of a job's rendezvous config (the identity is left to the handler)."""
        return cls(
            run_id=cfg.run_id,
            min_nodes=cfg.min_nodes,
            max_nodes=cfg.max_nodes,
            lease_ttl=cfg.lease_ttl,
            settle=cfg.settle,
            join_window=cfg.join_window,
            join_timeout=cfg.join_timeout,
            failure_budget=cfg.failure_budget,
            failure_window=cfg.failure_window,
            keepalive_interval=cfg.keepalive_interval,
            identity_wait=cfg.identity_wait,
            hot=cfg.hot,
        )


@dataclass(slots=True)
class JoinState:
    """Where one :meth:`Participant.join` stands: the round it asks for, and when to look again."""

    target: int
    """The round this node asks to be in."""
    reason: str
    """Why it joins (:data:`elastic_train.rendezvous.decide.REASONS`), written in its join key."""
    deadline: float
    """Monotonic time the join gives up (``join_timeout``)."""
    join_written: bool = False
    """Whether this node's join key asks for :attr:`target` yet."""
    close_due: float | None = None
    """Monotonic time the forming round was first seen ready to close (others step in a lease TTL later)."""
    next_eval: float = 0.0
    """Earliest monotonic time of the next evaluation of the forming round."""
    first_join_seen: float | None = None
    """Monotonic time this node first saw a node ask for :attr:`target` (the join window starts there)."""
    probed: dict[str, bool] = field(default_factory=dict)
    """Members of the last round that have not asked for :attr:`target`, probed: True when known gone."""
    reprobe: dict[str, float] = field(default_factory=dict)
    """Probed members whose port accepted: monotonic time when they may be probed again."""

    def missed(self, latest: int) -> None:
        """Round ``latest`` closed without this node: ask for the next one, as excluded unless it was a
        failure or a lost node that brought it here."""
        self.target = latest + 1
        self.reason = self.reason if self.reason in ("failure", "lost") else "excluded"
        self.join_written = False
        self.close_due = None
        self.next_eval = 0.0
        self.first_join_seen = None
        self.probed = {}
        self.reprobe = {}


@dataclass(frozen=True, slots=True)
class CloseAttempt:
    """What a decision to close the forming round was made on; the close transaction writes from it."""

    previous: RoundRecord | None
    """The last closed round (``None`` before the first)."""
    previous_revision: int
    """Its ``round`` key's mod revision (0 when absent): the transaction's fence."""
    joins: dict[str, Joiner]
    """The live nodes asking for :attr:`target`."""
    live: set[str]
    """Every node with a lease."""
    target: int
    """The round being closed."""


class Participant:
    """One node of a run: keeps its lease, joins rounds, reports who waits.

    Args:
        etcd: a connected client.
        settings: the run's rendezvous settings.
        addr: address other nodes reach this one at.
        store_port: port of this node's TCPStore (0 when it hosts none).
        node_id: defaults to :func:`new_node_id`.
        view: a started :func:`run_view` of the same run to read instead of a watch of this participant's
            own (several participants hosted in one process, as the scale benchmark runs them); it is
            left running by :meth:`leave`.
    """

    def __init__(
        self,
        etcd: Etcd,
        settings: ProtocolSettings,
        *,
        addr: str,
        store_port: int = 0,
        node_id: str | None = None,
        view: RunView | None = None,
    ) -> None:
        self.etcd = etcd
        self.s = settings
        self.prefix = run_prefix(settings.run_id)
        self.node_id = node_id or new_node_id()
        self.addr = addr
        self.store_port = store_port
        self._own_view = view is None
        self.view = view if view is not None else run_view(etcd, settings.run_id)
        self.lease = LeaseKeeper(
            etcd, settings.lease_ttl, self._write_leased_keys, interval=settings.keepalive_interval
        )
        self.round: int | None = None
        self.members: list[str] = []
        #: The lease keeper's loss count when this node's round closed (see :meth:`_put_join`).
        self._losses_at_round = 0
        self._join_value: bytes | None = None
        self._started = False
        self._lock = threading.Lock()
        self._waiting_cause: str | None = None
        self._join_cache: dict[str, tuple[int, Joiner | None]] = {}
        self._report_seen: dict[tuple[str, int], float] = {}
        self._rec_cache: tuple[int, RoundRecord | None] = (0, None)
        #: Set when this node was turned away: it wrote nothing and must not close the run.
        self.refused = False
        #: How this node's workers failed, sent with its next join (``decide.identical_startup_failure``):
        #: ``{"exit_code", "error", "trained", "ran_s"}``, or ``None``.
        self.failure_report: dict[str, Any] | None = None
        #: How far this node's workers' scripts got (``outcome.script_clock``), set by the handler.
        self.script_clock: Callable[[], tuple[bool, float | None] | None] | None = None
        #: Whether ``inproc/<node>`` says this node's workers re-form in-process (:meth:`advertise_inproc`).
        self.inproc = False
        self._inproc_lock = threading.Lock()
        #: Set once this node announced that it leaves (:func:`elastic_train.rendezvous.leave.announce`): it
        #: writes nothing more.
        self.leaving = False

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> None:
        """Write this node's keys under a fresh lease and start following the run (idempotent)."""
        with self._lock:
            if self._started:
                return
            if self._own_view:
                self.view.start()
            try:
                self._claim(time.monotonic() + self.s.identity_wait)
            except (RunRefused, RendezvousClosed):
                self.refused = True
                if self._own_view:
                    self.view.stop()
                raise
            cfg = json.dumps(
                {
                    "failure_budget": self.s.failure_budget,
                    "failure_window": self.s.failure_window,
                    "min_nodes": self.s.min_nodes,
                    "max_nodes": self.s.max_nodes,
                }
            ).encode()
            self.etcd.txn([cmp_version(self.prefix + "config", 0)], [op_put(self.prefix + "config", cfg)])
            self.lease.start()
            self._started = True
            log.info("rendezvous_node_started", node=self.node_id, addr=self.addr, run_id=self.s.run_id)

    # -- identity and lifecycle checks before any key is written ---------------------------------------------

    def _claim(self, deadline: float) -> None:
        """Make sure this node may take part in the run, before it writes a lease or a join key.

        Records this node's identity if the run has none (create-if-absent), takes over a run whose nodes are
        all gone, and waits up to ``deadline`` for a live run with other settings to go away.

        Raises:
            RunRefused: the run finished or failed, or a live run with other settings held it until
                ``deadline``.
            RendezvousClosed: the run finished moments ago with this node's settings (a late node of it).
        """
        mine = self.s.identity
        announced = False
        while True:
            with self.view.cond:
                closed = self._closed()
                kv = self.view.get("identity")
                live = self._live()
                rnd = self.view.get("round")
            if closed is not None:
                self._refuse_closed(closed, kv.value if kv else None)
            if mine is None:
                return
            if kv is None:
                value = mine.encode(time=time.time(), node=self.node_id)
                ok, _ = self.etcd.txn(
                    [cmp_version(self.prefix + "identity", 0), cmp_version(self.prefix + "closed", 0)],
                    [op_put(self.prefix + "identity", value)],
                )
                if ok:
                    log.info("run_identity_recorded", run_id=self.s.run_id, fingerprint=mine.fingerprint)
                    return
                self._await_key("identity")
                continue
            try:
                theirs = JobIdentity.decode(kv.value)
                recorded_at = float(json.loads(kv.value).get("time") or 0.0)
            except (ValueError, TypeError, AttributeError):
                theirs, recorded_at = JobIdentity({"identity": "(unreadable)"}), 0.0
            if theirs.fingerprint == mine.fingerprint:
                return
            line = theirs.refusal(self.s.run_id, mine)
            # A round closed since the identity was recorded: its nodes had leases after it, so with none
            # live now they are gone (not still starting), however recently the identity was written.
            formed_since = rnd is not None and rnd.mod_revision > kv.mod_revision
            fresh = time.time() - recorded_at <= max(IDENTITY_FRESH, 3 * self.s.lease_ttl)
            if not live and (formed_since or not fresh):
                if self._take_over(kv.mod_revision, mine):
                    log.warning(
                        "run_taken_over",
                        run_id=self.s.run_id,
                        reason="no live node holds the run and it did not finish; resuming it with this "
                        "node's settings",
                        previous=line,
                    )
                    return
                continue
            if time.monotonic() >= deadline:
                raise RunRefused(line)
            if not announced:
                announced = True
                log.warning(
                    "run_identity_differs",
                    run_id=self.s.run_id,
                    detail=line,
                    waiting_s=round(max(0.0, deadline - time.monotonic()), 1),
                    live_nodes=len(live),
                    hint="waiting for that job's nodes to leave (a Job deleted moments ago); then this node "
                    "takes the run over",
                )
            with self.view.cond:
                self.view.cond.wait(min(1.0, max(0.05, deadline - time.monotonic())))

    def _check_identity_kept(self) -> None:
        """Refuse to re-join a run that nodes with other settings took over while this one was away
        (stopped past its lease, its peers gone). Call with ``view.cond`` held."""
        mine, kv = self.s.identity, self.view.get("identity")
        if mine is None or kv is None:
            return
        try:
            theirs = JobIdentity.decode(kv.value)
        except ValueError:
            return
        if theirs.fingerprint != mine.fingerprint:
            self.refused = True
            raise RunRefused(f"{theirs.refusal(self.s.run_id, mine)} (the run was taken over)")

    def _await_key(self, key: str, timeout: float = 2.0) -> None:
        """Wait (briefly) until the view shows ``key``, after a transaction lost to its writer."""
        end = time.monotonic() + timeout
        with self.view.cond:
            while self.view.get(key) is None and time.monotonic() < end:
                self.view.cond.wait(0.1)

    def _take_over(self, identity_rev: int, mine: JobIdentity) -> bool:
        """Replace the identity of a run nobody holds (compare-and-set on its revision)."""
        cfg = json.dumps(
            {
                "failure_budget": self.s.failure_budget,
                "failure_window": self.s.failure_window,
                "min_nodes": self.s.min_nodes,
                "max_nodes": self.s.max_nodes,
            }
        ).encode()
        ok, resp = self.etcd.txn(
            [cmp_mod(self.prefix + "identity", identity_rev), cmp_version(self.prefix + "closed", 0)],
            [
                op_put(self.prefix + "identity", mine.encode(time=time.time(), node=self.node_id)),
                op_put(self.prefix + "config", cfg),
            ],
        )
        # Until the watch delivers it, the view would still show the identity just replaced.
        end = time.monotonic() + (5.0 if ok else 0.2)
        with self.view.cond:
            while self.view.revision < int(resp.header.revision) and time.monotonic() < end:
                self.view.cond.wait(0.05)
        return ok

    def _refuse_closed(self, closed: dict[str, Any], identity_raw: bytes | None) -> None:
        """Turn a new node away from a closed run, with the way forward in the line."""
        run = self.s.run_id
        theirs: JobIdentity | None = None
        if identity_raw is not None:
            try:
                theirs = JobIdentity.decode(identity_raw)
            except ValueError:
                theirs = None
        url = (theirs.settings.get("checkpoint.url") if theirs else None) or "CHECKPOINT_URL"
        forward = f"--run-id NEW_ID --resume-from {url}/{run}"
        reason = closed.get("reason")
        if reason == "finished":
            mine = self.s.identity
            same = mine is None or theirs is None or theirs.fingerprint == mine.fingerprint
            try:
                age = time.time() - float(closed.get("time") or 0.0)
            except (TypeError, ValueError):
                age = float("inf")
            if same and age < self.s.identity_wait:
                log.info("rendezvous_run_already_finished", run_id=run, finished_s_ago=round(age, 1))
                raise RendezvousClosed(finished_line(run, closed))
            raise RunRefused(
                f"run {run} finished{_at_step(closed)}{_when(closed.get('time'))}; start a new run with "
                "another run id "
                f"(to continue from its checkpoint: {forward})"
            )
        why = str(closed.get("message") or reason or "failed")
        raise RunRefused(
            f"run {run} failed: {why}; to continue, start a new run from its newest checkpoint: {forward}"
        )

    def _write_leased_keys(self, lease_id: int) -> None:
        if self.leaving:
            return
        node = {
            "addr": self.addr,
            "store_port": self.store_port,
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        self.etcd.put(self.prefix + "nodes/" + self.node_id, json.dumps(node).encode(), lease_id)
        if self._join_value is not None:
            self.etcd.put(self.prefix + "join/" + self.node_id, self._join_value, lease_id)
        if self.inproc:
            self.etcd.put(self.prefix + "inproc/" + self.node_id, b"1", lease_id)

    def leave(self) -> None:
        """Stop keep-alives and revoke the lease: peers see this node gone at once."""
        if self._own_view:
            self.view.stop()
        if self._started:
            self.lease.stop(revoke=True)

    # -- state read from the view -----------------------------------------------------------------------

    def _round_record(self) -> tuple[RoundRecord | None, int]:
        kv = self.view.get("round")
        if kv is None:
            return None, 0
        if self._rec_cache[0] != kv.mod_revision:
            self._rec_cache = (kv.mod_revision, RoundRecord.decode(kv.value))
        return self._rec_cache[1], kv.mod_revision

    def _closed(self) -> dict[str, Any] | None:
        kv = self.view.get("closed")
        return json.loads(kv.value) if kv is not None else None

    def _failures(self) -> int:
        kv = self.view.get("failures")
        return int(kv.value) if kv is not None else 0

    def _live(self) -> set[str]:
        return set(self.view.under("nodes/"))

    def _joins(self) -> dict[str, Joiner]:
        out = {}
        for node, kv in self.view.under("join/").items():
            cached = self._join_cache.get(node)
            if cached is not None and cached[0] == kv.mod_revision:
                joiner = cached[1]
            else:
                try:
                    d = json.loads(kv.value)
                    code = d.get("exit_code")
                    joiner = Joiner(
                        node,
                        int(d["target"]),
                        str(d.get("reason", "start")),
                        kv.create_revision,
                        exit_code=code if isinstance(code, int) and not isinstance(code, bool) else None,
                        error=str(d.get("error") or "")[:2000],
                        trained=d.get("trained") is True,
                        ran_s=seconds(d.get("ran_s")),
                    )
                except (ValueError, KeyError, TypeError):
                    joiner = None
                self._join_cache[node] = (kv.mod_revision, joiner)
            if joiner is not None:
                out[node] = joiner
        return out

    def is_closed(self) -> bool:
        with self.view.cond:
            return self._closed() is not None

    def check_open(self) -> None:
        """Raise what a join would raise if the run is closed.

        Raises:
            RendezvousClosed, FailureBudgetExhausted, JobFailed: the run is closed.
        """
        with self.view.cond:
            self._check_closed()

    def num_waiting(self) -> int:
        """Nodes (lost members, rejoining members, newcomers) that make this node's round obsolete."""
        with self.view.cond:
            closed = self._closed()
            if closed is not None:
                failed = closed.get("reason") in ("budget", "failed")
                return 1 if failed and self.round is not None else 0
            rec, _ = self._round_record()
            live = self._live()
            joins = self._joins()
            n = count_waiting(
                my_round=self.round,
                latest_round=rec.round if rec else 0,
                members=self.members,
                live=live,
                joins=joins,
                max_nodes=self.s.max_nodes,
            )
            if n > 0 and self._hold_for_startup_failures(live, joins):
                return 0
            if n > 0 and self._waiting_cause is None:
                self._waiting_cause = self._classify(rec, live, joins, local_failure=False)
            return n

    def _hold_for_startup_failures(self, live: set[str], joins: dict[str, Joiner]) -> bool:
        """Whether to leave this node's workers alone a moment longer although members re-joined.

        When every member that re-joined did so because its workers failed before any step (a report for
        ``decide.identical_startup_failure``), this node's workers, started at the same time, are likely
        about to fail the same way: the join is not acted on while ``decide.hold_for_startup_reports`` says
        so (at least :data:`STARTUP_REPORT_GRACE` s, at most :data:`STARTUP_REPORT_HOLD_MAX` s). A lost
        member or any other joiner is acted on at once.
        """
        if self.round is None or any(m not in live for m in self.members):
            return False
        waiting = [j for j in joins.values() if j.target > self.round and j.node_id != self.node_id]
        if not waiting or not all(is_startup_report(j) and j.node_id in self.members for j in waiting):
            return False
        now = time.monotonic()
        first = min(self._report_seen.setdefault((j.node_id, j.target), now) for j in waiting)
        return hold_for_startup_reports(
            seen_for=now - first,
            peer_ran_s=max(j.ran_s for j in waiting),
            own=self.script_clock() if self.script_clock is not None else None,
            now=now,
            grace=STARTUP_REPORT_GRACE,
            most=STARTUP_REPORT_HOLD_MAX,
        )

    def advertise_inproc(self, on: bool) -> None:
        """Say whether this node's workers re-form in-process (the leased key ``inproc/<node>``): a node
        joining a round whose live members all say so starts its workers on standby (:mod:`.standby`).
        Only changes are written; an etcd error is logged and the change is written at the next call.
        """
        with self._inproc_lock:  # the monitor tick and the hot path's fallback both call this
            if on == self.inproc or not self._started:
                return
            key = self.prefix + "inproc/" + self.node_id
            try:
                if on:
                    self.etcd.put(key, b"1", self.lease.lease_id)
                else:
                    self.etcd.delete(key)
            except EtcdError as exc:
                log.warning("rendezvous_etcd_retry", node=self.node_id, error=str(exc))
                return
            self.inproc = on

    def standby_round(self) -> int | None:
        """The run's last round when this node may start its workers on standby for the next one: the run is
        open, every member of that round other than this node is live (none lost: the others re-form now,
        and a peer that stopped makes them restart), and every one of them (at least one) re-forms
        in-process, so its workers will admit this node's at a step boundary. ``None`` otherwise (start as
        usual)."""
        with self.view.cond:
            if self._closed() is not None:
                return None
            rec, _ = self._round_record()
            if rec is None:
                return None
            live = self._live()
            if any(m not in live for m in rec.members if m != self.node_id):
                return None
            others = [m for m in rec.members if m != self.node_id]
            inproc = self.view.under("inproc/")
            return rec.round if others and all(m in inproc for m in others) else None

    def lost_members(self) -> set[str]:
        """Members of this node's round whose lease is gone."""
        with self.view.cond:
            live = self._live()
            return {m for m in self.members if m not in live}

    def _classify(
        self, rec: RoundRecord | None, live: set[str], joins: dict[str, Joiner], *, local_failure: bool
    ) -> str:
        """Why this node re-joins (see :data:`elastic_train.rendezvous.decide.REASONS`)."""
        if self.round is None:
            return "start"
        if rec is not None and rec.round > self.round:
            return "excluded"
        if any(m not in live for m in self.members):
            return "lost"
        members = set(self.members)
        for j in joins.values():
            if j.target > self.round and (
                j.node_id not in members or j.reason in ("scale", "excluded", "start", "rejoin")
            ):
                return "scale"
        return "failure" if local_failure else "scale"

    # -- joining -----------------------------------------------------------------------------------------

    def join(self) -> RoundResult:
        """Block until a round that includes this node closes.

        Each pass writes this node's join key when it does not ask for the current target yet, or looks at
        the run: adopt a closed round that includes this node, aim at the next one after a round closed
        without it, or evaluate the forming round and, when it is ready and this node is to close it, close
        it with one transaction.

        Raises:
            RendezvousClosed: the run finished (``set_closed``); a late node should exit cleanly.
            FailureBudgetExhausted: the run stopped because its failure budget is spent.
            RendezvousJoinTimeout: no round formed within ``join_timeout``.
            EtcdError: etcd failed for longer than the join allows.
        """
        if self.leaving:
            raise NodeLeft(f"node {self.node_id} left run {self.s.run_id}")
        self.start()
        state = self._begin_join()
        while True:
            if not state.join_written:
                state.join_written = self._etcd_step(
                    state.deadline, self._put_join, state.target, state.reason
                )
                continue
            with self.view.cond:
                step = self._look(state)
            if isinstance(step, RoundResult):
                return step
            if step is not None:
                self._etcd_step(state.deadline, self._try_close, step)
                with self.view.cond:  # let the watch deliver the outcome before deciding again
                    rec, _ = self._round_record()
                    if rec is None or rec.round < step.target:  # not delivered while the close ran
                        self.view.cond.wait(0.2)

    def _begin_join(self) -> JoinState:
        """The first target round and why this node joins; refuses a taken-over or closed run."""
        with self.view.cond:
            self._check_identity_kept()
            rec, _ = self._round_record()
            reason = self._waiting_cause or self._classify(
                rec, self._live(), self._joins(), local_failure=True
            )
            self._waiting_cause = None
            self._check_closed()
        return JoinState(
            target=(rec.round if rec else 0) + 1,
            reason=reason,
            deadline=time.monotonic() + self.s.join_timeout,
        )

    def _look(self, state: JoinState) -> RoundResult | CloseAttempt | None:
        """One look at the run (``view.cond`` held): this node's round if it closed, a close to attempt, or
        ``None`` after waiting for the next change or evaluation time.

        Raises:
            RendezvousClosed, FailureBudgetExhausted, JobFailed: the run is closed.
            RendezvousJoinTimeout: past the join's deadline.
        """
        self._check_closed()
        rec, rec_rev = self._round_record()
        now = time.monotonic()
        if now > state.deadline:
            raise RendezvousJoinTimeout(
                f"rendezvous of run {self.s.run_id!r} did not form within {self.s.join_timeout:.0f}s "
                f"(min_nodes={self.s.min_nodes})"
            )
        if rec is not None and rec.round >= state.target:
            if self.node_id in rec.members:
                return self._adopt(rec)
            state.missed(rec.round)
            return None
        if now < state.next_eval:
            self.view.cond.wait(state.next_eval - now)
            return None
        return self._evaluate(state, rec, rec_rev, now)

    def _evaluate(
        self, state: JoinState, rec: RoundRecord | None, rec_rev: int, now: float
    ) -> CloseAttempt | None:
        """Decide whether the forming round closes now and whether this node closes it (``view.cond`` held).

        The prospective rank 0 closes; the others step in if it has not within a lease TTL. Without a close
        to attempt, waits for the next change (or the settle window's end).
        """
        live = self._live()
        joins = {n: j for n, j in self._joins().items() if j.target == state.target and n in live}
        if self.node_id not in joins:
            # the watch has not delivered this node's own join yet (or its lease is being re-created):
            # deciding now would leave it out of the prospective order, and the prospective rank 0 would
            # then look again only after a follower's interval
            self.view.cond.wait(OWN_JOIN_WAIT)
            return None
        if joins and state.first_join_seen is None:
            state.first_join_seen = now
        decision = decide_close(
            joined=joins,
            live=live,
            min_nodes=self.s.min_nodes,
            max_nodes=self.s.max_nodes,
            settle=self.s.settle,
            quiet_for=now - self.view.last_change,
            has_previous_round=rec is not None,
            gone=self._known_gone(state, rec, live, joins),
            join_window=self.s.settle if self.s.join_window is None else self.s.join_window,
            since_first_join=now - (state.first_join_seen or now),
        )
        order = assign_ranks(rec.members if rec else [], joins.values(), self.s.max_nodes)
        closer = not order or order[0] == self.node_id
        state.next_eval = now + (CLOSER_EVAL_INTERVAL if closer else FOLLOWER_EVAL_INTERVAL)
        if not decision.close:
            state.close_due = None
            self.view.cond.wait(max(0.01, min(decision.wait, state.deadline - now)))
            return None
        state.close_due = state.close_due or now
        if closer or now - state.close_due >= self.s.lease_ttl:
            state.next_eval = 0.0
            return CloseAttempt(rec, rec_rev, joins, live, state.target)
        self.view.cond.wait(min(0.5, self.s.lease_ttl))
        return None

    def _known_gone(
        self, state: JoinState, rec: RoundRecord | None, live: set[str], joins: dict[str, Joiner]
    ) -> set[str]:
        """Members of the last round that are live in etcd but have not asked for this round, and whose agent
        refuses connections to its store port: the process is gone (kill -9, a crash), only its lease has not
        expired yet (``view.cond`` held; a refused loopback or LAN connection answers in well under a
        millisecond). A member whose port accepted is probed again every :data:`REPROBE_INTERVAL` (a killed
        agent's port may accept while its process is torn down); one whose probe got no answer within
        :data:`PROBE_TIMEOUT` is probed once per target round and counts as alive: a stopped or unreachable
        node is left to the lease."""
        if rec is None:
            return set()
        now = time.monotonic()
        for node in rec.members:
            if node not in live or node in joins or node == self.node_id or state.probed.get(node):
                continue
            if node in state.probed and now < state.reprobe.get(node, math.inf):
                continue
            answer = self._probe(node)
            state.probed[node] = answer == "refused"
            if answer == "accepted":
                state.reprobe[node] = now + REPROBE_INTERVAL
            if state.probed[node]:
                log.info("rendezvous_member_gone", node=node, round=state.target, by=self.node_id)
        return {n for n, gone in state.probed.items() if gone and n in live and n not in joins}

    def _probe(self, node: str) -> str:
        """``refused`` when ``node``'s store port (from its node key) refuses a TCP connection, ``accepted``
        when it accepts one, else ``unknown`` (no port, no answer within :data:`PROBE_TIMEOUT`)."""
        kv = self.view.get("nodes/" + node)
        try:
            d = json.loads(kv.value) if kv is not None else {}
            addr, port = str(d["addr"]), int(d["store_port"])
        except (ValueError, KeyError, TypeError):
            return "unknown"
        if port <= 0:
            return "unknown"
        try:
            socket.create_connection((addr, port), timeout=PROBE_TIMEOUT).close()
        except ConnectionRefusedError:
            return "refused"
        except OSError:
            return "unknown"
        return "accepted"

    def _etcd_step(self, deadline: float, fn: Callable[..., object], *args: Any) -> bool:
        """Run one etcd write, ``fn(*args)``; on an etcd error log, pause briefly and report False (the
        caller retries).

        Raises:
            EtcdError: etcd failed past ``deadline``.
        """
        try:
            fn(*args)
            return True
        except EtcdError as exc:
            if time.monotonic() > deadline:
                raise
            log.warning("rendezvous_etcd_retry", node=self.node_id, error=str(exc))
            time.sleep(0.25)
            return False

    def _check_closed(self) -> None:
        closed = self._closed()
        if closed is None:
            return
        if closed.get("reason") == "budget":
            raise FailureBudgetExhausted(str(closed.get("message") or "failure budget exhausted"))
        if closed.get("reason") == "failed":
            raise JobFailed(f"run {self.s.run_id} failed: {closed.get('message') or 'a worker failed'}")
        raise RendezvousClosed(finished_line(self.s.run_id, closed))

    def _put_join(self, target: int, reason: str) -> None:
        lost_since = self.round is not None and self.lease.losses != self._losses_at_round
        if reason in FAILURE_REASONS and lost_since:
            # etcd dropped this node's lease after its round closed: the peers re-formed without it and
            # spent one failure on that; its own workers failing as a consequence is the same failure.
            reason = "rejoin"
        join: dict[str, Any] = {"target": target, "reason": reason, "time": time.time()}
        if reason == "failure" and self.failure_report:
            join.update(self.failure_report)
        self._join_value = json.dumps(join).encode()
        log.info("rendezvous_join", node=self.node_id, target_round=target, reason=reason)
        self.etcd.put(self.prefix + "join/" + self.node_id, self._join_value, self.lease.lease_id)

    def _try_close(self, attempt: CloseAttempt) -> bool:
        """Close the round ``attempt`` was decided on: one transaction, fenced by the last round's revision
        (and by the run not being closed); False when another node's transaction won."""
        previous = attempt.previous.members if attempt.previous else []
        members = assign_ranks(previous, attempt.joins.values(), self.s.max_nodes)
        with self.view.cond:
            used = self._failures()
            nodes_kv = self.view.under("nodes/")
            # -- failure budget and clean leaves (rendezvous/budget.py, rendezvous/leave.py) --
            left = set(self.view.under("left/"))
            kv = self.view.get("budget")
            record = budget.BudgetRecord.decode(kv.value if kv is not None else None)
        kind = budget.transition_kind(previous, members, attempt.joins.values(), attempt.live, left)
        failure = kind == budget.FAILURE
        spent = budget.spend(
            record, now=time.time(), budget=self.s.failure_budget, window=self.s.failure_window, total=used
        )
        used_marks = [n for n in previous if n in left and n not in members]
        record = budget.BudgetRecord(
            spent.record.times if failure else record.times, record.leaves + len(used_marks)
        )
        # -- end of failure budget --
        nodes = {}
        for m in members:
            try:
                d = json.loads(nodes_kv[m].value)
                nodes[m] = {"addr": d.get("addr"), "store_port": d.get("store_port", 0)}
            except (KeyError, ValueError):
                nodes[m] = {"addr": None, "store_port": 0}
        compare = [
            cmp_mod(self.prefix + "round", attempt.previous_revision),
            cmp_version(self.prefix + "closed", 0),
        ]
        startup = identical_startup_failure(previous, attempt.joins.values())
        if startup is not None:  # no restart can help: the run fails, no failure budget spent
            mark = {"reason": "failed", "message": startup, "by": self.node_id, "time": time.time()}
            ok, _ = self.etcd.txn(compare, [op_put(self.prefix + "closed", json.dumps(mark).encode())])
            if ok:
                log.error("identical_startup_failure", run_id=self.s.run_id, error=startup)
                self._expire_record()
            return ok
        if failure and spent.exhausted:
            window = f" in {budget.window_text(self.s.failure_window)}" if self.s.failure_window > 0 else ""
            msg = (
                f"failure budget exhausted for run {self.s.run_id!r}: {spent.in_window} failures{window}, "
                f"budget {self.s.failure_budget} (raise failure_budget in --rdzv-conf or job.yaml to allow "
                "more)"
            )
            ok, _ = self.etcd.txn(
                compare,
                [
                    op_put(self.prefix + "closed", json.dumps({"reason": "budget", "message": msg}).encode()),
                    op_put(self.prefix + "failures", str(used + 1).encode()),
                    op_put(self.prefix + "budget", record.encode()),
                ],
            )
            if ok:
                log.error("failure_budget_exhausted", run_id=self.s.run_id, failures=spent.in_window)
                self._expire_record()
            return ok
        round_record = RoundRecord(attempt.target, members, nodes, failure, kind)
        ops = [op_put(self.prefix + "round", round_record.encode())]
        if failure:
            ops.append(op_put(self.prefix + "failures", str(used + 1).encode()))
        if failure or used_marks:
            ops.append(op_put(self.prefix + "budget", record.encode()))
            ops += [op_delete(self.prefix + "left/" + n) for n in used_marks]
        ok, _ = self.etcd.txn(compare, ops)
        if ok:
            log.info(
                "rendezvous_round_closed",
                round=attempt.target,
                world_size=len(members),
                failure=failure,
                kind=kind,
                left=used_marks or None,
                by=self.node_id,
            )
        return ok

    def _adopt(self, rec: RoundRecord) -> RoundResult:
        self.round = rec.round
        self.members = list(rec.members)
        self._losses_at_round = self.lease.losses
        self._waiting_cause = None
        return RoundResult(
            rec.round, rec.members.index(self.node_id), len(rec.members), list(rec.members), rec.nodes
        )

    # -- closing -----------------------------------------------------------------------------------------

    def close(
        self,
        reason: str = "finished",
        message: str = "",
        *,
        step: int | None = None,
        patience: float = CLOSE_PATIENCE,
    ) -> None:
        """Mark the run closed (first writer wins; later rounds are refused).

        Args:
            reason: ``finished``, or ``failed`` (a non-retryable worker error; ``message`` says why).
            message: one line for ``status`` and for nodes turned away.
            step: the step the job ended at, when known.
            patience: seconds to keep retrying while etcd is unreachable (it may be restarting): without the
                mark, a node that starts after the others finished would wait for peers until its join
                timeout.
        """
        record: dict[str, Any] = {
            "reason": reason,
            "message": message,
            "by": self.node_id,
            "time": time.time(),
        }
        if step is not None:
            record["step"] = step
        value = json.dumps(record).encode()
        deadline = time.monotonic() + patience
        delay = 0.2
        while True:
            try:
                ok, _ = self.etcd.txn(
                    [cmp_version(self.prefix + "closed", 0)], [op_put(self.prefix + "closed", value)]
                )
                if ok:
                    self._expire_record()
                return
            except EtcdError as exc:
                if time.monotonic() + delay > deadline:
                    log.warning("rendezvous_close_failed", error=str(exc))
                    return
                log.info("rendezvous_close_retrying", error=str(exc), in_s=delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _expire_record(self) -> None:
        """Move the closed run's record keys onto a lease of :data:`RUN_RECORD_TTL` (best effort).

        Each key is re-written with its own value under a compare on its revision: nothing changes them once
        the run is closed, and a key changed meanwhile is left for the next closer.
        """
        try:
            kvs, _ = self.etcd.get_prefix(self.prefix)
            lease = self.etcd.lease_grant(RUN_RECORD_TTL)
            for kv in kvs:
                if kv.key[len(self.prefix) :] in RUN_RECORD_KEYS and kv.lease == 0:
                    self.etcd.txn([cmp_mod(kv.key, kv.mod_revision)], [op_put(kv.key, kv.value, lease)])
        except EtcdError as exc:
            log.warning("run_record_expiry_failed", run_id=self.s.run_id, error=str(exc))


def finished_line(run_id: str, closed: dict[str, Any]) -> str:
    """What a node of a finished run says as it leaves (exit 0): the run, its last step, and when."""
    return (
        f"run {run_id} finished{_at_step(closed)}{_when(closed.get('time'))}; this node has nothing left "
        "to do"
    )


def _at_step(closed: dict[str, Any]) -> str:
    step = closed.get("step")
    return f" at step {step}" if isinstance(step, int) and not isinstance(step, bool) else ""


def _when(t: Any) -> str:
    """`` on 2026-12-01 06:40 UTC`` for a Unix time read from etcd (empty if it is not one)."""
    try:
        return time.strftime(" on %Y-%m-%d %H:%M UTC", time.gmtime(float(t)))
    except (TypeError, ValueError, OverflowError):
        return ""
