"""The run as this agent sees it, for its Prometheus metrics (:mod:`elastic_train.metrics.agent`).

At each scrape :class:`RunObserver` reads the participant's watch of the run (round, world size, the failure
budget: :mod:`elastic_train.rendezvous.budget`) and the workers' figures from the node's channel
(:class:`elastic_train.node.Stats`): nothing is asked of etcd, nothing is added to the agent's monitor tick.
A thread of its own times recoveries: from the first node asking for a new round (the round record's
``asked``) to this node's first step in that round (the first step a worker reports in it), labelled with
what brought the round about (the record's ``kind``) and whether the same worker processes came back (hot)
or new ones (restart).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily

from elastic_train.log import get_logger
from elastic_train.metrics import agent
from elastic_train.node import AgentChannel, Stats
from elastic_train.procs import running
from elastic_train.rendezvous import budget, slownodes
from elastic_train.rendezvous.config import ProtocolSettings
from elastic_train.rendezvous.protocol import Participant

log = get_logger(__name__)

#: Name prefix of every metric.
PREFIX = "elastic_train_"
#: Seconds between two looks of the recovery clock at the participant and the workers' figures.
TICK = 0.2


@dataclass(slots=True)
class _Totals:
    """Work of worker processes that have exited (their figures are removed once counted here)."""

    snapshots: int = 0
    snapshot_s: float = 0.0
    durables: int = 0
    durable_s: float = 0.0
    durable_bytes: int = 0

    def add(self, st: Stats) -> None:
        self.snapshots += st.snapshots
        self.snapshot_s += st.snapshot_s
        self.durables += st.durables
        self.durable_s += st.durable_s
        self.durable_bytes += st.durable_bytes


@dataclass(frozen=True, slots=True)
class _Pending:
    """A round this node joined after another one, waiting for its first step."""

    round: int
    kind: str
    start: float
    before: frozenset[int]
    """Worker pids that reported a step in the round before."""


class RunObserver:
    """Serves this agent's view of the run (see the module docstring).

    Args:
        participant: the handler's participant, or None before it exists.
        channel: the node's channel, where the workers' figures arrive.
        settings: the run's rendezvous settings.
    """

    def __init__(
        self, participant: Callable[[], Participant | None], channel: AgentChannel, settings: ProtocolSettings
    ) -> None:
        self._participant = participant
        self._channel = channel
        self._settings = settings
        self._lock = threading.Lock()
        self._exited = _Totals()
        self._round: int | None = None
        self._pending: _Pending | None = None
        self._seen: dict[int, int | None] = {}  # worker pid -> round of its last reported step
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, port: int, addr: str | None) -> int:
        """Serve the metrics on ``port`` and start the recovery clock; returns the port served.

        Raises:
            OSError: the port cannot be bound.
        """
        bound = agent.serve(port, addr or "0.0.0.0", self._settings.run_id)
        agent.add_collector(self)
        self._thread = threading.Thread(target=self._loop, name="metrics-clock", daemon=True)
        self._thread.start()
        return bound

    def close(self) -> None:
        self._stop.set()
        agent.remove_collector(self)

    # -- the recovery clock ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.wait(TICK):
            try:
                self.tick()
            except Exception as exc:  # never kill the agent for a metric
                log.warning("metrics_clock_failed", error=repr(exc))

    def tick(self) -> None:
        """One look: note a round this node joined, and end a recovery at its first step."""
        p = self._participant()
        if p is None:
            return
        stats = self._stats()
        r = p.round
        with self._lock:
            if r is not None and r != self._round:
                if self._round is not None:
                    kind, start = self._change(p, r)
                    before = frozenset(pid for pid, seen in self._seen.items() if seen == self._round)
                    self._pending = _Pending(r, kind, start, before)
                self._round = r
            pending = self._pending
            if pending is not None:
                firsts = [
                    (st.round_first_step, st.pid)
                    for st in stats.values()
                    if st.round is not None and st.round >= pending.round
                ]
                if firsts:
                    end, pid = min(firsts)
                    path = "hot" if pid in pending.before else "restart"
                    agent.observe_recovery(pending.kind, path, end - pending.start)
                    log.info(
                        "recovery_timed",
                        round=pending.round,
                        kind=pending.kind,
                        path=path,
                        seconds=round(end - pending.start, 3),
                    )
                    self._pending = None
            for pid, st in stats.items():
                self._seen[pid] = st.round

    @staticmethod
    def _change(p: Participant, r: int) -> tuple[str, float]:
        """What brought round ``r`` about (its record's kind) and when the first node asked for it (its
        record's ``asked``; now when the record says nothing, or the view already shows a later round)."""
        now = time.time()
        try:
            with p.view.cond:
                rec, _ = p.run.round_record()
        except ValueError:  # a malformed round record: the protocol raises it where it matters
            rec = None
        if rec is None or rec.round != r:
            return budget.SCALE, now
        asked = rec.asked_at if rec.asked_at is not None and rec.asked_at <= now else now
        return rec.kind, asked

    def _stats(self) -> dict[int, Stats]:
        """The live workers' figures; the totals of exited workers move to :attr:`_exited` (their figures
        removed from the channel)."""
        stats = self._channel.stats()
        for pid, st in list(stats.items()):
            if running(pid):
                continue
            with self._lock:
                self._exited.add(st)
                self._seen.pop(pid, None)
            self._channel.forget_stats(pid)
            del stats[pid]
        return stats

    # -- the scrape --------------------------------------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        run, s, p = self._settings.run_id, self._settings, self._participant()
        joined = p is not None and p.round is not None
        gauges: list[tuple[str, str, float]] = [
            ("round", "Rendezvous round this node trains in (0: none yet)", p.round if p and p.round else 0),
            ("world_size", "Nodes in this node's round", len(p.members) if p is not None and joined else 0),
            ("failure_budget", "Failures the run may survive in any failure window", s.failure_budget),
            ("failure_window_seconds", "The failure window (0: the run's whole life)", s.failure_window),
        ]
        counters: list[tuple[str, str, float]] = []
        if p is not None:
            with p.view.cond:
                record, total = p.run.budget(), p.run.failures()
                evictions = p.view.get(slownodes.EVICTIONS)
                standing = p.view.under(slownodes.STANDING)
            now = time.time()
            in_window = total if s.failure_window <= 0 else record.in_window(now, s.failure_window)
            left = budget.left(record, now=now, budget=s.failure_budget, window=s.failure_window, total=total)
            gauges += [
                ("failures_in_window", "Failures counted against the budget now", in_window),
                ("failure_budget_left", "Failures the run may still survive", left),
            ]
            counters += [
                ("failures", "Failures over the run's life", total),
                ("leaves", "Nodes that left the run cleanly (SIGTERM), not failures", record.leaves),
                ("evictions", "Slow nodes evicted over the run's life (docs/stragglers.md)",
                 slownodes.eviction_total(evictions.value if evictions is not None else None)),
            ]  # fmt: skip
            gauges.append(("slow_nodes", "Nodes flagged as slow, evicted or on probation now", len(standing)))
        stats = self._stats()
        with self._lock:
            t = self._exited
            exited = _Totals(t.snapshots, t.snapshot_s, t.durables, t.durable_s, t.durable_bytes)
        live = list(stats.values())
        gauges += [
            ("workers", "Worker processes of this node reporting steps", len(live)),
            ("step", "The last step a worker of this node committed", max((w.step for w in live), default=0)),
            ("steps_per_second", "Steps per second of this node's workers",
             max((w.steps_per_s for w in live), default=0.0)),
            ("snapshot_last_seconds", "The last snapshot's seconds (slowest worker)",
             max((w.snapshot_last_s for w in live), default=0.0)),
            ("durable_write_last_seconds", "The last durable checkpoint's seconds",
             max((w.durable_last_s for w in live), default=0.0)),
        ]  # fmt: skip
        # durable checkpoints are committed by the job's rank 0: the node holding it reports them
        counters.append(
            ("durable_write_bytes", "Bytes of the durable checkpoints committed",
             exited.durable_bytes + sum(w.durable_bytes for w in live)),
        )  # fmt: skip
        summaries = [
            ("snapshot_seconds", "Seconds the training threads spent saving the state (the memory snapshot)",
             exited.snapshots + sum(w.snapshots for w in live),
             exited.snapshot_s + sum(w.snapshot_s for w in live)),
            ("durable_write_seconds", "Seconds of each durable checkpoint, from its save to its commit",
             exited.durables + sum(w.durables for w in live),
             exited.durable_s + sum(w.durable_s for w in live)),
        ]  # fmt: skip
        for name, doc, value in gauges:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["run_id"])
            g.add_metric([run], float(value))
            yield g
        for name, doc, value in counters:
            c = CounterMetricFamily(PREFIX + name, doc, labels=["run_id"])
            c.add_metric([run], float(value))
            yield c
        for name, doc, count, total_s in summaries:
            m = SummaryMetricFamily(PREFIX + name, doc, labels=["run_id"])
            m.add_metric([run], count, total_s)
            yield m

    def describe(self) -> list[Any]:
        return []  # collected at each scrape only: the values need the run's view
