"""The etcd3 rendezvous protocol, without torch: one participant of a run joining rounds.

A :class:`Participant` is one node of a run: it claims its place in the run (:mod:`.claim`), keeps its
lease and follows the run's keys through a watch (:mod:`.view`, :mod:`.records`), tells torchrun's agent when
its round is obsolete (:meth:`Participant.num_waiting`), and joins the next round: it writes its join key,
and the node the rules pick (:mod:`.decide`) closes the round with one transaction (:mod:`.closing`).

Per round each node writes one join key and one node closes the round with one transaction: O(N) writes.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elastic_train.etcd.client import Etcd, cmp_version, op_put
from elastic_train.etcd.errors import EtcdError
from elastic_train.log import get_logger
from elastic_train.rendezvous.claim import Claim, config_record
from elastic_train.rendezvous.closing import CLOSE_PATIENCE, CloseAttempt, Closer
from elastic_train.rendezvous.config import ProtocolSettings, run_prefix
from elastic_train.rendezvous.decide import (
    FAILURE_REASONS,
    Joiner,
    assign_ranks,
    count_waiting,
    decide_close,
    hold_for_startup_reports,
    is_startup_report,
    ranks_before,
)
from elastic_train.rendezvous.errors import (
    FailureBudgetExhausted,
    JobFailed,
    NodeLeft,
    RendezvousClosed,
    RendezvousJoinTimeout,
    RunRefused,
)
from elastic_train.rendezvous.probe import probe_node
from elastic_train.rendezvous.records import (
    RoundRecord,
    RoundResult,
    RunReader,
    finished_line,
    new_node_id,
    parse_join,
    run_view,
)
from elastic_train.rendezvous.view import LeaseKeeper, RunView

log = get_logger(__name__)

__all__ = [
    "CloseAttempt",
    "Forming",
    "JoinState",
    "Participant",
    "ProtocolSettings",
    "RoundRecord",
    "RoundResult",
    "finished_line",
    "run_view",
]

#: Least seconds between two evaluations of the forming round by the node expected to close it (or while that
#: is not known yet), and by every other node. A watch batch that brings no new ``round`` record within these
#: intervals is folded into the next evaluation: each one costs O(N), and in a large job a batch arrives with
#: almost every join. Others only step in when the closer is silent for a lease TTL, so they look less often,
#: sleep through joins and departures (a new record wakes them), do not probe silent members, and may read a
#: picture of the forming round up to their interval old if nothing but joins changed since (shared by the
#: participants of one view, :func:`forming`). A job of N nodes costs its view readers N / interval looks a
#: second in all: what N simulated nodes on a few cores pay, and what N agents spend apart. (A follower that
#: becomes the closer because the closer left mid-round learns it at its next look, within the interval.)
CLOSER_EVAL_INTERVAL = 0.02
FOLLOWER_EVAL_INTERVAL = 1.0
#: Longest wait for the watch to show this node's own join before the forming round is evaluated again.
OWN_JOIN_WAIT = 0.05
#: Longest wait for the view to reach the revision of this node's own join write (it wakes the node as soon
#: as it does; a lagging watch then costs no looks at the run meanwhile).
JOIN_SHOWN_WAIT = 1.0
#: Seconds a node leaves its workers running after members re-joined because theirs failed before any step
#: (their own failure, if it is the same, then reaches the round first; see ``_hold_for_startup_failures``).
STARTUP_REPORT_GRACE = 3.0
#: Longest such a hold lasts (``decide.hold_for_startup_reports``).
STARTUP_REPORT_HOLD_MAX = 30.0
#: Seconds before a member whose store port accepted a probe is probed again in the same round: a killed
#: agent's port may accept while the kernel still tears the process down.
REPROBE_INTERVAL = 0.1


@dataclass(frozen=True, slots=True)
class Forming:
    """The round being formed as one view shows it: shared, read-only, by every reader of that view."""

    live: set[str]
    """Every node with a lease."""
    joins: dict[str, Joiner]
    """The live nodes asking for the round."""
    order: list[str]
    """Its prospective rank order (:func:`~elastic_train.rendezvous.decide.assign_ranks`): ``order[0]``
    closes it."""
    previous_rank: dict[str, int]
    """Each member of the last round by its rank there."""

    def closer_after(self, me: Joiner) -> bool:
        """Whether ``me``, a joiner this picture does not show yet, would come after its first node: then
        ``me`` does not close the round however old the picture is."""
        first = self.joins.get(self.order[0]) if self.order else None
        return first is not None and not ranks_before(self.previous_rank, me, first)


def forming(run: RunReader, target: int, rec: RoundRecord | None, rec_rev: int, max_nodes: int,
            max_age: float) -> Forming:  # fmt: skip
    """The round ``target`` being formed after ``rec`` (``rec_rev``: its revision), from ``run``'s view
    (``cond`` held): computed once per view revision for all its readers, or reused for ``max_age`` seconds
    (:meth:`~elastic_train.rendezvous.view.RunView.memo`)."""

    def compute() -> Forming:
        live = run.live()
        joins = {n: j for n, j in run.joins().items() if j.target == target and n in live}
        previous = rec.members if rec else []
        order = assign_ranks(previous, joins.values(), max_nodes)
        return Forming(live, joins, order, {n: i for i, n in enumerate(previous)})

    return run.view.memo(("forming", target, rec_rev), compute, max_age)


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

    def reprobe_in(self, now: float) -> float | None:
        """Seconds until a member whose port accepted is due to be probed again (0 when one is due now), or
        ``None`` when none is pending: the closing node waits no longer than that for a change."""
        due = [t for node, t in self.reprobe.items() if not self.probed.get(node)]
        return max(0.0, min(due) - now) if due else None


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
        script_clock: how far this node's workers' scripts got (``AgentChannel.script_clock``), for the
            hold of a start-up failure report; None: unknown.
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
        script_clock: Callable[[], tuple[bool, float | None] | None] | None = None,
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
        #: The lease keeper's loss count that this node's round holds (see :attr:`losses_at_round`).
        self._losses_at_round = 0
        #: (the lease keeper's loss count, etcd revision) when this node's leased keys were last written: a
        #: round closed at a later revision holds that lease.
        self._keys_written = (0, 0)
        self._join_value: bytes | None = None
        #: Store revision of this node's last join write (the view shows it once it reached that).
        self._join_revision = 0
        self._started = False
        self._lock = threading.Lock()
        self._waiting_cause: str | None = None
        self._report_seen: dict[tuple[str, int], float] = {}
        #: The run's records as the view holds them.
        self.run = RunReader(self.view)
        self._claim = Claim(etcd, self.run, self.prefix, settings, self.node_id)
        self._closer = Closer(etcd, self.run, self.prefix, settings, self.node_id)
        #: Set when this node was turned away: it wrote nothing and must not close the run.
        self.refused = False
        #: How this node's workers failed, sent with its next join (``decide.identical_startup_failure``):
        #: ``{"exit_code", "error", "trained", "ran_s"}``, or ``None``.
        self.failure_report: dict[str, Any] | None = None
        self._script_clock = script_clock
        #: Whether ``inproc/<node>`` says this node's workers re-form in-process (:meth:`advertise_inproc`).
        self.inproc = False
        self._inproc_lock = threading.Lock()
        #: Set once this node announced that it leaves (:func:`elastic_train.rendezvous.leave.announce`): it
        #: writes nothing more and joins no round.
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
                self._claim.claim(time.monotonic() + self.s.identity_wait)
            except (RunRefused, RendezvousClosed):
                self.refused = True
                if self._own_view:
                    self.view.stop()
                raise
            config = config_record(self.s)
            self.etcd.txn([cmp_version(self.prefix + "config", 0)], [op_put(self.prefix + "config", config)])
            self.lease.start()
            self._started = True
            log.info("rendezvous_node_started", node=self.node_id, addr=self.addr, run_id=self.s.run_id)

    def _check_identity_kept(self) -> None:
        """Refuse to re-join a run that was taken over meanwhile (``view.cond`` held; see :mod:`.claim`)."""
        try:
            self._claim.check_kept()
        except RunRefused:
            self.refused = True
            raise

    def _write_leased_keys(self, lease_id: int) -> None:
        if self.leaving:  # a lease re-created after the leave must not bring the node back
            return
        node = {
            "addr": self.addr,
            "store_port": self.store_port,
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        written = self.etcd.put(self.prefix + "nodes/" + self.node_id, json.dumps(node).encode(), lease_id)
        if self._join_value is not None:
            written = self._join_revision = self.etcd.put(
                self.prefix + "join/" + self.node_id, self._join_value, lease_id
            )
        if self.inproc:
            self.etcd.put(self.prefix + "inproc/" + self.node_id, b"1", lease_id)
        self._keys_written = (self.lease.losses, written)

    def leave(self) -> None:
        """Stop keep-alives and revoke the lease: peers see this node gone at once."""
        if self._own_view:
            self.view.stop()
        if self._started:
            self.lease.stop(revoke=True)

    # -- state read from the view -----------------------------------------------------------------------

    def is_closed(self) -> bool:
        with self.view.cond:
            return self.run.closed() is not None

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
            closed = self.run.closed()
            if closed is not None:
                failed = closed.get("reason") in ("budget", "failed")
                return 1 if failed and self.round is not None else 0
            rec, _ = self.run.round_record()
            live = self.run.live()
            joins = self.run.joins()
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
            own=self._script_clock() if self._script_clock is not None else None,
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
            if on == self.inproc or not self._started or self.leaving:
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

    def lost_members(self) -> set[str]:
        """Members of this node's round whose lease is gone."""
        with self.view.cond:
            live = self.run.live()
            return {m for m in self.members if m not in live}

    def asking_beyond(self, round: int) -> set[str]:
        """Live nodes whose join key asks for a round after ``round``."""
        with self.view.cond:
            live = self.run.live()
            return {n for n, j in self.run.joins().items() if j.target > round and n in live}

    def latest_round(self) -> int:
        """The newest closed round of the run, from the view (0 before the first)."""
        with self.view.cond:
            rec, _ = self.run.round_record()
        return rec.round if rec is not None else 0

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
            NodeLeft: this node left the run (SIGTERM, :mod:`elastic_train.rendezvous.leave`).
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
                self._etcd_step(state.deadline, self._closer.close_round, step)
                with self.view.cond:  # let the watch deliver the outcome before deciding again
                    rec, _ = self.run.round_record()
                    if rec is None or rec.round < step.target:  # not delivered while the close ran
                        self.view.wait_record(0.2)

    def _begin_join(self) -> JoinState:
        """The first target round and why this node joins; refuses a taken-over or closed run."""
        with self.view.cond:
            self._check_identity_kept()
            rec, _ = self.run.round_record()
            reason = self._waiting_cause or self._classify(
                rec, self.run.live(), self.run.joins(), local_failure=True
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
        rec, rec_rev = self.run.round_record()
        now = time.monotonic()
        if now > state.deadline:
            raise RendezvousJoinTimeout(
                f"rendezvous of run {self.s.run_id!r} did not form within {self.s.join_timeout:.0f}s "
                f"(min_nodes={self.s.min_nodes})"
            )
        if rec is not None and rec.round >= state.target:
            if self.node_id in rec.members:
                return self._adopt(rec, rec_rev)
            state.missed(rec.round)
            return None
        if now < state.next_eval:
            self.view.wait_record(state.next_eval - now)
            return None
        return self._evaluate(state, rec, rec_rev, now)

    def _evaluate(
        self, state: JoinState, rec: RoundRecord | None, rec_rev: int, now: float
    ) -> CloseAttempt | None:
        """Decide whether the forming round closes now and whether this node closes it (``view.cond`` held).

        The prospective rank 0 closes; the others step in if it has not within a lease TTL. Without a close
        to attempt, waits for the next change (or the settle window's end); a follower waits for a new
        record only (joins do not wake it) and decides on a picture of the forming round up to
        :data:`FOLLOWER_EVAL_INTERVAL` old.
        """
        own = self.view.get("join/" + self.node_id)
        if own is None or own.value != self._join_value:
            # the watch has not delivered this node's own join yet: deciding now would leave it out of the
            # prospective order, and the prospective rank 0 would then look again only after a follower's
            # interval. (Past its revision, the key went with a lost lease and is being written again.)
            if self.view.revision >= self._join_revision:
                self.view.wait_record(JOIN_SHOWN_WAIT)  # it shows once the lease is granted anew
            else:
                self.view.wait_revision(self._join_revision, JOIN_SHOWN_WAIT)
            return None
        stepping_in = state.close_due is not None and now - state.close_due >= self.s.lease_ttl
        f = self._forming(state, rec, rec_rev, 0.0 if stepping_in else FOLLOWER_EVAL_INTERVAL)
        mine = f.joins.get(self.node_id) or parse_join(self.node_id, own)
        if f.order[:1] == [self.node_id] or (self.node_id not in f.joins and not f.closer_after(mine)):
            f = self._forming(state, rec, rec_rev, 0.0)  # it may close the round: a picture of now
            if self.node_id not in f.joins:  # its lease is being re-created: no node key yet
                self.view.wait_record(OWN_JOIN_WAIT)
                return None
        closer = not f.order or f.order[0] == self.node_id
        if state.first_join_seen is None:
            state.first_join_seen = now
        decision = decide_close(
            joined=f.joins.keys(),
            live=f.live,
            min_nodes=self.s.min_nodes,
            max_nodes=self.s.max_nodes,
            settle=self.s.settle,
            quiet_for=now - self.view.last_change,
            has_previous_round=rec is not None,
            gone=self._known_gone(state, rec, f.live, f.joins) if closer else (),
            join_window=self.s.settle if self.s.join_window is None else self.s.join_window,
            since_first_join=now - (state.first_join_seen or now),
        )
        state.next_eval = now + (CLOSER_EVAL_INTERVAL if closer else FOLLOWER_EVAL_INTERVAL)
        wait = self.view.cond.wait if closer else self.view.wait_record
        if not decision.close:
            state.close_due = None
            pause = min(decision.wait, state.deadline - now)
            # a member whose port accepted (a killed agent's, while the kernel tears it down) is probed
            # again when due, not when its lease expires or the run next changes
            due = state.reprobe_in(now) if closer else None
            wait(max(0.01, pause if due is None else min(pause, due)))
            return None
        state.close_due = state.close_due or now
        if closer or stepping_in:  # a follower steps in on a fresh picture only (``stepping_in``)
            state.next_eval = 0.0
            return CloseAttempt(rec, rec_rev, dict(f.joins), set(f.live), state.target)
        self.view.wait_record(min(0.5, self.s.lease_ttl))
        return None

    def _forming(self, state: JoinState, rec: RoundRecord | None, rec_rev: int, max_age: float) -> Forming:
        return forming(self.run, state.target, rec, rec_rev, self.s.max_nodes, max_age)

    def _known_gone(
        self, state: JoinState, rec: RoundRecord | None, live: set[str], joins: dict[str, Joiner]
    ) -> set[str]:
        """Members of the last round that are live in etcd but have not asked for this round, and whose agent
        refuses connections to its store port: the process is gone (kill -9, a crash), only its lease has not
        expired yet (``view.cond`` held; a refused connection answers within a round trip). A member whose
        port accepted is probed again every :data:`REPROBE_INTERVAL` (a killed agent's port may accept while
        its process is torn down; the closing node's wait ends when one is due, :meth:`JoinState.reprobe_in`);
        one whose probe got no answer in time (:mod:`.probe`) is probed once per target round and counts as
        alive: a stopped or unreachable node is left to the lease."""
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
            else:  # gone, or no answer: not probed again in this round
                state.reprobe.pop(node, None)
            if state.probed[node]:
                log.info("rendezvous_member_gone", node=node, round=state.target, by=self.node_id)
        return {n for n, gone in state.probed.items() if gone and n in live and n not in joins}

    def _probe(self, node: str) -> str:
        """:func:`~elastic_train.rendezvous.probe.probe_node` of ``node``'s store, as its node key says."""
        return probe_node(self.run.node(node))

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
        closed = self.run.closed()
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
        self._join_revision = self.etcd.put(
            self.prefix + "join/" + self.node_id, self._join_value, self.lease.lease_id
        )

    @property
    def losses_at_round(self) -> int:
        """The lease keeper's loss count (``lease.losses``) of the lease this node's round was closed with:
        a loss counted beyond it came after the round closed (the peers may re-form without this node); a
        lease lost and re-created while the join ran, before the round closed, is behind it."""
        return self._losses_at_round

    def _adopt(self, rec: RoundRecord, rec_rev: int) -> RoundResult:
        self.round = rec.round
        self.members = list(rec.members)
        losses, written = self._keys_written
        # keys written after the round closed: it was closed with the lease before (lost since)
        self._losses_at_round = losses if rec_rev > written else losses - 1
        self._waiting_cause = None
        self.failure_report = None  # it went with this round's join; a later join reports afresh
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
        """Mark the run closed (first writer wins; later rounds are refused): see
        :meth:`~elastic_train.rendezvous.closing.Closer.close_run`."""
        self._closer.close_run(reason, message, step=step, patience=patience)
