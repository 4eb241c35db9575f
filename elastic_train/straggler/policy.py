"""What the job does about a slow node: evict it or not, and when an evicted node comes back.

:func:`decide_evictions` turns the flagged nodes into one :class:`Decision` each: evicted (policy ``evict``,
the job stays at ``min_nodes`` or more, and fewer than ``max_evictions`` happened in the last
``eviction_window`` seconds), or kept, with the reason. Worst score first: when the bound allows one eviction,
it is the slowest node's. An eviction is a voluntary leave through the hot path: nobody restarts, exactly-once
data and the global batch hold, no failure budget is spent.

An evicted node waits on standby and times its own step (a probe) against the job's per-sample time at its
eviction; :func:`judge_probation` readmits it once ``probation_probes`` probes in a row were healthy (below
``clear_below`` times the job's) and ``probation_seconds`` passed, and sends it away (it leaves the job)
when it is still not healthy after ``probation_max_seconds``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from elastic_train.straggler.config import StragglerConfig

#: Why a flagged node is kept in the job.
KEPT_REPORT = "policy is report"
KEPT_MIN_NODES = "min_nodes"
KEPT_BUDGET = "eviction budget spent"


@dataclass(frozen=True, slots=True)
class Decision:
    """Evict a flagged node or keep it: one event, with the numbers behind it."""

    event: Literal["straggler_evict", "straggler_kept"]
    node: str
    why: str
    """``policy is evict`` for an eviction, else why it is kept (:data:`KEPT_REPORT`, ...)."""
    score: float
    world: int
    """Nodes in the job when it was decided."""
    min_nodes: int
    evictions_in_window: int
    """Evictions in the last ``eviction_window`` seconds, before this one."""
    max_evictions: int
    eviction_window_s: float

    def fields(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "why": self.why,
            "score": round(self.score, 3),
            "world": self.world,
            "min_nodes": self.min_nodes,
            "evictions_in_window": self.evictions_in_window,
            "max_evictions": self.max_evictions,
            "eviction_window_s": self.eviction_window_s,
        }


def decide_evictions(
    *,
    flagged: Sequence[tuple[str, float]],
    world: int,
    min_nodes: int,
    evicted_at: Iterable[float],
    now: float,
    cfg: StragglerConfig,
) -> list[Decision]:
    """One decision per flagged node.

    Args:
        flagged: (node, score) of each flagged node still in the job.
        world: nodes in the job now.
        min_nodes: the fewest the job trains with.
        evicted_at: when the job's earlier evictions happened (the clock of ``now``).
        now: the time of the decision.
        cfg: the policy and its bounds.

    Returns:
        The decisions, worst score first.
    """
    recent = sum(1 for t in evicted_at if now - t < cfg.eviction_window)
    room = world - min_nodes
    budget = cfg.max_evictions - recent
    out = []
    event: Literal["straggler_evict", "straggler_kept"]
    for node, score in sorted(flagged, key=lambda f: (-f[1], f[0])):
        if cfg.policy != "evict":
            event, why = "straggler_kept", KEPT_REPORT
        elif room <= 0:
            event, why = "straggler_kept", KEPT_MIN_NODES
        elif budget <= 0:
            event, why = "straggler_kept", KEPT_BUDGET
        else:
            event, why = "straggler_evict", "policy is evict"
        out.append(
            Decision(
                event, node, why, score, world, min_nodes, recent, cfg.max_evictions, cfg.eviction_window
            )
        )
        if event == "straggler_evict":
            room, budget, recent = room - 1, budget - 1, recent + 1
    return out


def changed(previous: Mapping[str, Decision], decisions: Iterable[Decision]) -> list[Decision]:
    """The decisions that differ from the last one made about the same node (what to log: a node kept for
    the same reason step after step is one event, not one per step)."""
    return [
        d for d in decisions if (p := previous.get(d.node)) is None or (p.event, p.why) != (d.event, d.why)
    ]


@dataclass(frozen=True, slots=True)
class Probation:
    """Where an evicted node's probation stands: one event when it ends (readmit or leave)."""

    action: Literal["wait", "readmit", "leave"]
    node: str
    healthy_probes: int
    """Healthy probes in a row, the last one included."""
    needed: int
    last_ratio: float | None
    """The last probe's time over the job's reference (``None``: no probe yet)."""
    on_probation_s: float
    reference_s: float

    @property
    def event(self) -> str:
        return {"wait": "straggler_probation", "readmit": "straggler_readmit", "leave": "straggler_leave"}[
            self.action
        ]

    def fields(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "action": self.action,
            "healthy_probes": self.healthy_probes,
            "needed": self.needed,
            "last_ratio": None if self.last_ratio is None else round(self.last_ratio, 3),
            "on_probation_s": round(self.on_probation_s, 1),
            "reference_s": self.reference_s,
        }


def judge_probation(
    *,
    node: str,
    probes: Sequence[float],
    reference_s: float,
    started: float,
    now: float,
    cfg: StragglerConfig,
) -> Probation:
    """Readmit an evicted node, send it away, or let it wait.

    Args:
        node: the evicted node.
        probes: its own probe times so far, oldest first, per sample (seconds), measured on standby.
        reference_s: the job's per-sample busy time when it was evicted (the others' median).
        started: when its probation began.
        now: the time (the clock of ``started``).
        cfg: ``clear_below``, ``probation_probes``, ``probation_seconds``, ``probation_max_seconds``.
    """
    assert reference_s > 0, "a probation needs the job's time to compare with"
    healthy = 0
    for p in reversed(probes):
        if p / reference_s >= cfg.clear_below:
            break
        healthy += 1
    elapsed = now - started
    last = probes[-1] / reference_s if probes else None
    if healthy >= cfg.probation_probes and elapsed >= cfg.probation_seconds:
        action: Literal["wait", "readmit", "leave"] = "readmit"
    elif elapsed >= cfg.probation_max_seconds:
        action = "leave"
    else:
        action = "wait"
    return Probation(action, node, healthy, cfg.probation_probes, last, elapsed, reference_s)
