"""The run as this agent sees it, for its Prometheus metrics (:mod:`elastic_train.metrics.agent`).

At each scrape :class:`RunObserver` reads the participant's watch of the run (round, world size, the failure
budget: :mod:`elastic_train.rendezvous.budget`) and the workers' stats files
(:mod:`elastic_train.metrics.stats`): nothing is asked of etcd, nothing is added to the agent's monitor
tick. A thread of its own times recoveries: from the first node asking for a new round (the earliest join key
for it) to this node's first step in that round (the first step a worker reports in it), labelled with what
caused the round (its record's kind) and whether the same worker processes came back (hot) or new ones
(restart).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily

from elastic_train.log import get_logger
from elastic_train.metrics import agent
from elastic_train.metrics.stats import WorkerStats, forget, read_stats
from elastic_train.rendezvous import budget
from elastic_train.rendezvous.protocol import Participant, ProtocolSettings, RoundRecord

log = get_logger(__name__)

#: Name prefix of every metric.
PREFIX = "elastic_train_"
#: Seconds between two looks of the recovery clock at the participant and the workers' stats.
TICK = 0.2


@dataclass(slots=True)
class _Totals:
    """Work of worker processes that have exited (their files are removed once counted here)."""

    snapshot_count: int = 0
    snapshot_sum: float = 0.0
    durable_count: int = 0
    durable_sum: float = 0.0
    durable_bytes: int = 0


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
        directory: the agent's directory, where workers leave their stats files.
        settings: the run's rendezvous settings.
    """

    def __init__(
        self, participant: Callable[[], Participant | None], directory: str, settings: ProtocolSettings
    ) -> None:
        self._participant = participant
        self._directory = directory
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
                    if st.round is not None and st.round >= pending.round and st.round_first_step is not None
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

    def _change(self, p: Participant, r: int) -> tuple[str, float]:
        """What caused round ``r`` (its record's kind) and when the first node asked for it."""
        now = time.time()
        with p.view.cond:
            kv = p.view.get("round")
            joins = p.view.under("join/")
        kind = budget.SCALE
        if kv is not None:
            try:
                rec = RoundRecord.decode(kv.value)
                kind = rec.kind
            except (ValueError, KeyError, TypeError):
                pass
        times = []
        for jkv in joins.values():
            try:
                d = json.loads(jkv.value)
                if int(d["target"]) == r and isinstance(d.get("time"), int | float):
                    times.append(float(d["time"]))
            except (ValueError, KeyError, TypeError):
                continue
        start = min([t for t in times if t <= now] or [now])
        return kind, start

    def _stats(self) -> dict[int, WorkerStats]:
        """The live workers' stats; the totals of exited workers move to :attr:`_exited` (files removed)."""
        stats = read_stats(self._directory)
        for pid, st in list(stats.items()):
            if _alive(pid):
                continue
            with self._lock:
                t = self._exited
                t.snapshot_count += st.snapshot.count
                t.snapshot_sum += st.snapshot.sum
                t.durable_count += st.durable.count
                t.durable_sum += st.durable.sum
                t.durable_bytes += st.durable_bytes
                self._seen.pop(pid, None)
            forget(self._directory, pid)
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
                kv, fkv = p.view.get("budget"), p.view.get("failures")
            record = budget.BudgetRecord.decode(kv.value if kv is not None else None)
            try:
                total = int(fkv.value) if fkv is not None else 0
            except ValueError:
                total = 0
            now = time.time()
            in_window = total if s.failure_window <= 0 else record.in_window(now, s.failure_window)
            left = budget.left(record, now=now, budget=s.failure_budget, window=s.failure_window, total=total)
            gauges += [
                ("failures_in_window", "Failures counted against the budget now", in_window),
                ("failure_budget_left", "Failures the run may still survive", left),
            ]
            counters += [
                ("failures", "Failures over the run's life", total),
                (
                    "leaves",
                    "Nodes that left the run cleanly (SIGTERM), not counted as failures",
                    record.leaves,
                ),
            ]
        stats = self._stats()
        with self._lock:
            t = self._exited
            snap = (t.snapshot_count, t.snapshot_sum)
            durable = (t.durable_count, t.durable_sum, t.durable_bytes)
        live = list(stats.values())
        gauges += [
            ("workers", "Worker processes of this node reporting steps", len(live)),
            ("step", "The last step a worker of this node committed", max((w.step for w in live), default=0)),
            ("steps_per_second", "Steps per second of this node's workers",
             max((w.steps_per_s for w in live), default=0.0)),
            ("snapshot_last_seconds", "The last snapshot's seconds (slowest worker)",
             max((w.snapshot.last for w in live), default=0.0)),
            ("durable_write_last_seconds", "The last durable checkpoint's seconds",
             max((w.durable.last for w in live), default=0.0)),
        ]  # fmt: skip
        # durable checkpoints are committed by the job's rank 0: the node holding it reports them
        counters.append(
            ("durable_write_bytes", "Bytes of the durable checkpoints committed",
             durable[2] + sum(w.durable_bytes for w in live)),
        )  # fmt: skip
        summaries = [
            ("snapshot_seconds", "Seconds the training threads spent saving the state (the memory snapshot)",
             snap[0] + sum(w.snapshot.count for w in live), snap[1] + sum(w.snapshot.sum for w in live)),
            ("durable_write_seconds", "Seconds of each durable checkpoint, from its save to its commit",
             durable[0] + sum(w.durable.count for w in live), durable[1] + sum(w.durable.sum for w in live)),
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
