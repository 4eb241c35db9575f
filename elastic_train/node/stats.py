"""A worker's figures for its agent's metrics, counted per step and reported at a bounded rate.

:class:`StatsCounter` adds up what each committed step cost (the save of the state, the newest durable
checkpoint) and hands a :class:`~elastic_train.node.messages.Stats` message to the node's channel at most
once every :data:`REPORT_EVERY` seconds, and at once on the first step of a new round: the agent ends its
recovery clock there. Between reports a step costs a few additions and one monotonic clock read, not a file
write.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

from elastic_train.node.messages import Stats

#: Least seconds between two reports of one worker (the first step of a round is reported at once).
REPORT_EVERY = 1.0


class StatsCounter:
    """One worker process's counts (see the module docstring).

    Args:
        report: where each report goes (the worker's channel: ``WorkerChannel.report_stats``).
        every: least seconds between two reports.
    """

    def __init__(self, report: Callable[[Stats], None], every: float = REPORT_EVERY) -> None:
        self._report = report
        self._every = every
        self.pid = os.getpid()
        self.round: int | None = None
        self.step = 0
        self.round_first_step = 0.0
        self.steps_per_s = 0.0
        self.snapshots = 0
        self.snapshot_s = 0.0
        self.snapshot_last_s = 0.0
        self.durables = 0
        self.durable_s = 0.0
        self.durable_last_s = 0.0
        self.durable_bytes = 0
        self._durable_step: int | None = None
        self._started = False
        self._reported_at = 0.0
        self._rate_from = (0.0, 0)
        self._pending = False
        self._busy: list[float] = []

    def committed(
        self,
        round: int | None,
        step: int,
        save_s: float,
        durable: tuple[int, float, int] | None = None,
        busy_s: float | None = None,
    ) -> None:
        """Count a committed step: its round, the seconds its save took, the newest durable checkpoint
        committed so far (``(step, seconds, bytes)``; one already counted is not counted again), and its
        busy time (the step's wall time less its wait for the gradient all-reduce; None: not timed)."""
        if round != self.round:
            self._busy.clear()  # a new round's first step includes the re-formation: not a step's work
        elif busy_s is not None and busy_s >= 0:
            self._busy.append(busy_s)
        self.snapshots += 1
        self.snapshot_s += save_s
        self.snapshot_last_s = save_s
        if durable is not None:
            self.count_durable(*durable)
        self.step = step
        now = time.monotonic()
        if round != self.round or not self._started:
            self._started = True
            self.round, self.round_first_step = round, time.time()
            self.steps_per_s = 0.0
            self._rate_from = (now, step)
            self._send(now)
        elif now - self._reported_at >= self._every:
            since, first = self._rate_from
            self.steps_per_s = (step - first) / (now - since) if now > since else 0.0
            self._rate_from = (now, step)
            self._send(now)
        else:
            self._pending = True

    def count_durable(self, step: int, seconds: float, nbytes: int) -> None:
        """Count the durable checkpoint of ``step`` (once: one already counted is not counted again); it is
        reported with the next report."""
        if step != self._durable_step:
            self._durable_step = step
            self.durables += 1
            self.durable_s += seconds
            self.durable_last_s = seconds
            self.durable_bytes += nbytes
            self._pending = True

    def flush(self) -> None:
        """Report what was counted since the last report (the worker's training ends)."""
        if self._pending:
            self._send(time.monotonic())

    def _send(self, now: float) -> None:
        self._reported_at = now
        self._pending = False
        busy, self._busy = self._busy, []
        self._report(
            Stats(
                pid=self.pid,
                round=self.round,
                step=self.step,
                time=time.time(),
                round_first_step=self.round_first_step,
                steps_per_s=max(0.0, self.steps_per_s),
                snapshots=self.snapshots,
                snapshot_s=max(0.0, self.snapshot_s),
                snapshot_last_s=max(0.0, self.snapshot_last_s),
                durables=self.durables,
                durable_s=max(0.0, self.durable_s),
                durable_last_s=max(0.0, self.durable_last_s),
                durable_bytes=max(0, self.durable_bytes),
                busy_s=statistics.fmean(busy) if busy else None,
                busy_steps=len(busy),
            )
        )
