"""Slow nodes: found from what each node does per step, and what the job does about them.

In synchronous data parallel training every rank's step takes as long as the slowest rank's, so a node's
step time says nothing about which node is slow; the time a node spends *not* blocked in the step's
collectives does. :mod:`.detect` scores each node against the median of the others over a window and flags
one that stays slower than a threshold, with hysteresis; a job-wide slowdown moves the median with it and
flags nobody. :mod:`.policy` decides what a flag leads to (``report``, or ``evict`` through the hot path as a
voluntary leave, never below ``min_nodes``, at most K evictions per window) and how long an evicted node
waits before it rejoins on trial, or that it leaves. :mod:`.record` is what ``elastic-train status`` reads.
All of it is pure: the caller (:mod:`elastic_train.rendezvous.slownodes`, in each agent) feeds figures and
the clock in, and acts on the decisions, each of which is one event with the numbers behind it.
"""

from __future__ import annotations

from elastic_train.straggler.config import StragglerConfig
from elastic_train.straggler.detect import DetectorState, Flag, observe
from elastic_train.straggler.policy import Decision, Probation, decide_evictions, probation

__all__ = [
    "Decision",
    "DetectorState",
    "Flag",
    "Probation",
    "StragglerConfig",
    "decide_evictions",
    "observe",
    "probation",
]
