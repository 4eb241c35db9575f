"""Self-fencing of a node cut off from the run, and the publish gate its workers ask before a checkpoint.

A partitioned node keeps running, which is what makes a partition different from a crash. Its peers learn
it is gone when its lease expires and re-form without it; from then on its workers train for nobody, hold
their devices, and may still publish checkpoints of a world that no longer exists. The agent reads its
workers' step beats (:mod:`elastic_train.node.beat`) and decides when to stop them:

- **The lease is gone**: etcd answered a keep-alive with "no such lease" (TTL <= 0) since the round began.
  The peers dropped this node; its workers are stopped at once.
- **Cut off and blocked**: etcd has not confirmed the lease for ``lease_ttl + grace`` seconds (so the peers
  may have re-formed), *and* the workers' step counters have stopped: no step finished for four step times
  (at least :data:`STALL_MIN`; before a step time is known, ``lease_ttl + grace``). Their collectives wait on
  peers that left. The workers are stopped; a fully cut node does not sit in gloo's 30-minute timeout.
  A cut node's peers re-form about a TTL after its last keep-alive; its steps stop then, so its workers are
  gone about ``lease_ttl + 2 s`` after the cut.

An etcd that cannot be reached is not by itself a reason: when etcd is down for everyone no new world can
form, the collectives keep completing, and training goes on (the chaos suite's etcd restarts and quorum
loss). What a worker waits for on its own side is progress, not a stall: a durable save waiting for the
write before it (held up by the publish gate during an outage) beats while it waits, and the gate answers
at once while keep-alives fail. The price of a short stall limit: a step four times slower than usual
*during* an etcd outage stops that node, and its peers then wait for etcd like it (recovering from memory
when etcd returns). Workers that count no steps (a script of one's own that does not checkpoint through
elastic_train) are stopped only when the lease is found gone: their progress cannot be told from a stall.

Stopping goes through torchrun's own path: :meth:`Fence.check` makes ``num_nodes_waiting()`` positive, the
agent stops its workers with SIGTERM and re-joins (no restart of ``max_restarts`` is spent); a worker that
outlives SIGTERM by :data:`KILL_GRACE` seconds is killed. The agent's join then waits for etcd: it re-joins
when etcd answers again, or ends with the run if the run finished meanwhile.

The publish gate (:mod:`elastic_train.node.gate`, served here) answers a worker's "is round R current?" from a
linearizable read of the run's ``round`` key: ``current`` while R is the newest closed round of an open or
finished run, ``stale`` once a newer round closed or this node's lease was found gone, ``unknown`` when etcd
gave no answer within :attr:`Fence.gate_wait` seconds (durable publishing then waits for a later save). While
the lease keeper already finds etcd unreachable, the gate does not ask and answers ``unknown`` at once: a
worker's next durable save waits for the one in flight, so a waiting gate would hold the training loop
through an etcd outage (and the fence would then take the stall for a cut).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass

import psutil

from elastic_train.etcd.errors import EtcdError
from elastic_train.log import get_logger
from elastic_train.metrics.agent import count_fence
from elastic_train.node import CURRENT, STALE, UNKNOWN, AgentChannel, GateServer
from elastic_train.rendezvous.protocol import Participant
from elastic_train.rendezvous.records import RoundRecord

log = get_logger(__name__)

#: Seconds past the lease TTL a node cut off from etcd, whose workers make no progress, waits before it stops
#: them: the peers' lease watch and round close take about this long.
FENCE_GRACE = 0.5
#: Seconds the publish gate waits for etcd to confirm a round before it answers ``unknown``.
GATE_WAIT = 2.0
#: Seconds a worker may take to exit after SIGTERM before the fence kills it.
KILL_GRACE = 1.0
#: Seconds without a finished step that count as blocked, once a step time is known ...
STALL_MIN = 1.0
#: ... or this many step times, when that is longer (slow steps are not a stall).
STALL_STEPS = 4.0


def stall_limit(ttl: float, step_s: float | None, grace: float = FENCE_GRACE) -> float:
    """Seconds without a finished step that count as blocked: :data:`STALL_MIN` or :data:`STALL_STEPS` step
    times, whichever is longer; ``ttl + grace`` before a step time is known (the first step includes start-up
    and restore)."""
    return ttl + grace if step_s is None else max(STALL_MIN, STALL_STEPS * step_s)


def fence_reason(
    *,
    lease_lost: bool,
    etcd_silent_s: float,
    stalled_s: float | None,
    ttl: float,
    grace: float = FENCE_GRACE,
    step_s: float | None = None,
) -> str | None:
    """Why this node's workers must stop now, or None while they may go on (pure; see the module docstring).

    Args:
        lease_lost: etcd answered that this node's lease is gone since the round began.
        etcd_silent_s: seconds since etcd last confirmed the lease.
        stalled_s: seconds since a worker last finished a step (or since the round began); None when no
            worker counts steps (a script that does not use elastic_train's checkpointing): then only a lost
            lease fences, as an etcd outage must not stop a job whose progress cannot be seen.
        ttl: the lease TTL.
        grace: seconds past the TTL.
        step_s: a recent step time, when known (before the round's second step it is not, and a stall
            must last ``ttl + grace``: the first step includes start-up and restore).
    """
    if lease_lost:
        return "lease_lost"
    if stalled_s is None:
        return None
    if etcd_silent_s >= ttl + grace and stalled_s >= stall_limit(ttl, step_s, grace):
        return "cut_off"
    return None


@dataclass(slots=True)
class _Progress:
    """The workers' counters as last read (progress of any kind, and steps), and when one last moved."""

    counts: dict[int, int]
    moved_at: float
    step_s: float | None = None
    steps: dict[int, int] | None = None
    steps_at: float = 0.0
    """When the step counters last moved."""


class Fence:
    """The agent's fence for one node (see the module docstring).

    Args:
        participant: the node's rendezvous participant (its lease keeper and etcd client).
        channel: the node's directory shared with its workers (their beats, the gate's socket).
        gate_wait: seconds the publish gate keeps asking an unreachable etcd before answering ``unknown``.
    """

    def __init__(
        self, participant: Participant, channel: AgentChannel, *, gate_wait: float | None = None
    ) -> None:
        self.participant = participant
        self.channel = channel
        self.ttl = float(participant.lease.ttl)
        self.gate_wait = gate_wait if gate_wait is not None else GATE_WAIT
        self._losses = participant.lease.losses
        self._progress = _Progress({}, time.monotonic())
        self._fired: str | None = None
        self._procs: dict[int, psutil.Process] = {}
        self._stop = threading.Event()
        self._gate: GateServer | None = None

    # -- fencing -------------------------------------------------------------------------------------------

    def arm(self, losses: int | None = None) -> None:
        """A round began and its workers are about to start: reset the baselines. ``losses``: the lease
        keeper's loss count the round holds (:attr:`Participant.losses_at_round`), when one was joined; a
        loss beyond it fences. None: the count now (a standby start, which holds no round yet)."""
        self.channel.clear_beats()
        self._losses = self.participant.lease.losses if losses is None else losses
        self._progress = _Progress({}, time.monotonic())
        self._fired = None
        self._procs = {}

    def joined(self, losses: int) -> None:
        """This node joined a round in-process (its workers kept, e.g. a standby start admitted) that holds
        the lease of loss count ``losses`` (:attr:`Participant.losses_at_round`): a loss before the round
        closed is behind it (the round has this node's current lease); one after it still fences."""
        self._losses = losses

    def check(self, *, lease_loss_handled: bool = False) -> str | None:
        """Called every agent monitor tick while the workers run: the reason to stop them now (once), else
        None. ``lease_loss_handled``: the workers re-form in-process (the hot path re-joins this node), so a
        lease found gone is not a reason; a cut-off node whose workers are blocked still is."""
        if self._fired is not None:
            return None
        now = time.monotonic()
        self._read_progress(now)
        keeper = self.participant.lease
        reason = fence_reason(
            lease_lost=keeper.losses != self._losses and not lease_loss_handled,
            etcd_silent_s=now - keeper.last_ok,
            stalled_s=now - self._progress.moved_at if self._progress.counts else None,
            ttl=self.ttl,
            step_s=self._progress.step_s,
        )
        if reason is None:
            return None
        self._fired = reason
        count_fence(reason)
        log.warning(
            "node_fenced",
            reason=reason,
            round=self.participant.round,
            etcd_silent_s=round(now - keeper.last_ok, 2),
            stalled_s=round(now - self._progress.moved_at, 2),
            workers=sorted(self._procs),
            hint="this node lost its lease or cannot reach etcd while its workers are blocked; stopping them "
            "and re-joining when etcd answers",
        )
        threading.Thread(target=self._kill_stragglers, name="fence-kill", daemon=True).start()
        return reason

    def workers_blocked(self) -> bool:
        """True when the workers count steps and none finished for as long as :meth:`check` counts as a
        stall (:func:`fence_reason`): they wait in a collective that does not return (a stopped peer). Reads
        what the last monitor tick saw; False when no worker counts steps."""
        progress = self._progress
        if not progress.counts:
            return False
        return time.monotonic() - progress.moved_at >= stall_limit(self.ttl, progress.step_s)

    def _read_progress(self, now: float) -> None:
        beats = self.channel.beats()
        counts = {pid: b.total for pid, b in beats.items()}
        steps = {pid: b.steps for pid, b in beats.items()}
        prev = self._progress
        for pid in counts.keys() - self._procs.keys() - {os.getpid()}:  # workers only, never the agent
            with contextlib.suppress(psutil.Error):
                self._procs[pid] = psutil.Process(pid)
        moved = max((n - prev.counts.get(pid, 0) for pid, n in counts.items()), default=0)
        done = max((n - (prev.steps or {}).get(pid, 0) for pid, n in steps.items()), default=0)
        if done > 0:
            if any((prev.steps or {}).values()):  # the first step's time includes start-up and restore
                sample = (now - prev.steps_at) / done  # steps finished since the last read, not reads
                prev.step_s = sample if prev.step_s is None else 0.8 * prev.step_s + 0.2 * sample
            prev.steps_at = now
        if moved > 0:
            prev.moved_at = now
        prev.counts, prev.steps = counts, steps

    def _kill_stragglers(self) -> None:
        """SIGKILL the workers still alive :data:`KILL_GRACE` seconds after the fence fired (torchrun sends
        SIGTERM)."""
        procs = list(self._procs.values())
        _, alive = psutil.wait_procs(procs, timeout=KILL_GRACE)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
                log.warning("fenced_worker_killed", pid=p.pid)

    # -- the publish gate ----------------------------------------------------------------------------------

    def start_gate(self) -> None:
        """Serve the workers' publish-gate questions (:mod:`elastic_train.node.gate`) with
        :meth:`round_state`."""
        self._gate = GateServer(self.channel.directory, self.round_state)

    def round_state(self, round: int) -> str:
        """Whether ``round`` is the run's current round, read from etcd (retried up to :attr:`gate_wait`)."""
        deadline = time.monotonic() + self.gate_wait
        p = self.participant
        keeper = p.lease
        while True:
            if keeper.losses != self._losses or self._fired == "lease_lost":
                return STALE
            if time.monotonic() - keeper.last_ok > max(1.0, 2 * keeper.interval):
                # etcd is known unreachable: answer at once. A worker's next durable save waits for this
                # one, so waiting here would hold its training loop through an etcd outage.
                log.warning("publish_gate_unconfirmed", round=round, error="etcd is unreachable")
                return UNKNOWN
            try:
                # bounded by the gate's own wait: a request etcd never answers (a partition that drops
                # packets) would otherwise hold the worker's next save for the whole RPC timeout
                left = max(0.05, deadline - time.monotonic())
                kv = p.etcd.get(p.prefix + "round", timeout=left)
                latest = RoundRecord.decode(kv.value).round if kv is not None else 0
            except EtcdError as exc:
                if time.monotonic() >= deadline or self._stop.is_set():
                    log.warning("publish_gate_unconfirmed", round=round, error=str(exc))
                    return UNKNOWN
                self._stop.wait(0.25)
                continue
            except ValueError:
                return UNKNOWN  # an unreadable record confirms nothing
            return CURRENT if latest == round else STALE

    def close(self) -> None:
        self._stop.set()
        if self._gate is not None:
            self._gate.close()
