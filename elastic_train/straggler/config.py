"""Settings of slow-node detection and eviction (``rendezvous.straggler`` in job.yaml)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: What a flagged node leads to: nothing at all (detection off), an event and ``status``, or an eviction.
POLICIES = ("off", "report", "evict")


@dataclass(kw_only=True, slots=True)
class StragglerConfig:
    """When a node counts as slow, and what the job does about it (docs/stragglers.md)."""

    policy: Literal["off", "report", "evict"] = "report"
    """``off``: no detection; ``report``: a flagged node is one event and shown by ``status``; ``evict``:
    it is also cut out through the hot path (a voluntary leave: no failure budget spent), waits out a
    probation and rejoins on trial."""
    threshold: float = 1.5
    """A node is slow while its score (its busy time over the median of the others', the median of its last
    ``window`` reports) is at least this."""
    clear_below: float = 1.2
    """A flagged node is cleared once its score falls below this (hysteresis)."""
    report_every: float = 2.0
    """Seconds between two reports of a node's busy time (one etcd write per node: N / report_every writes
    a second for N nodes)."""
    window: int = 5
    """Reports whose ratios a node's score is the median of: one slow report is noise, a window is not."""
    slow_steps: int = 10
    """Steps a node's score must stay at or above ``threshold`` before it is flagged."""
    slow_seconds: float = 0.0
    """Seconds it must stay there as well (0: the steps alone)."""
    warmup_reports: int = 2
    """A node's first reports (at the job's start, after it rejoins) that are not scored: its first steps pay
    start-up costs (lazy initialisation, compilation, connections) that are not its pace."""
    max_evictions: int = 1
    """Most evictions per ``eviction_window`` (an eviction storm is a job that shrinks itself to nothing); a
    node back on trial after a probation that is evicted again is not counted (``max_trials`` bounds it)."""
    eviction_window: float = 600.0
    """Seconds over which ``max_evictions`` counts."""
    probation_seconds: float = 60.0
    """Seconds an evicted node waits on probation before it rejoins on trial; doubled at each eviction of
    the same node."""
    max_trials: int = 3
    """Evictions of one node after which it leaves the job (exit 0, one line) instead of waiting again."""
    probe_patience: float = 3600.0
    """Seconds an evicted node whose health probe (:mod:`elastic_train.straggler.probe`) still finds it slow
    keeps probing before it leaves the job; 0: no probe (it rejoins on trial after each probation)."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy: {self.policy!r} is not one of {', '.join(POLICIES)}")
        if not 1.0 < self.threshold <= 100.0:
            raise ValueError(f"threshold: {self.threshold:g} must be above 1 (times the others' median)")
        if not 1.0 <= self.clear_below < self.threshold:
            raise ValueError(
                f"clear_below: {self.clear_below:g} must be at least 1 and below threshold "
                f"({self.threshold:g})"
            )
        if not 0.1 <= self.report_every <= 600:
            raise ValueError(f"report_every: {self.report_every:g} must be between 0.1 and 600 seconds")
        if self.window < 1:
            raise ValueError(f"window: {self.window} must be >= 1 report")
        if self.slow_steps < 1:
            raise ValueError(f"slow_steps: {self.slow_steps} must be >= 1")
        if not 0 <= self.warmup_reports <= 1000:
            raise ValueError(f"warmup_reports: {self.warmup_reports} must be between 0 and 1000")
        if self.slow_seconds < 0:
            raise ValueError(f"slow_seconds: {self.slow_seconds:g} must be >= 0")
        if self.max_evictions < 0:
            raise ValueError(f"max_evictions: {self.max_evictions} must be >= 0")
        if self.eviction_window <= 0:
            raise ValueError(f"eviction_window: {self.eviction_window:g} must be > 0 seconds")
        if not 0 <= self.probation_seconds <= 86400:
            raise ValueError(f"probation_seconds: {self.probation_seconds:g} must be between 0 and 86400")
        if self.max_trials < 1:
            raise ValueError(f"max_trials: {self.max_trials} must be >= 1")
        if not 0 <= self.probe_patience <= 30 * 86400:
            raise ValueError(f"probe_patience: {self.probe_patience:g} must be between 0 and 2592000 seconds")

    @property
    def enabled(self) -> bool:
        return self.policy != "off"
