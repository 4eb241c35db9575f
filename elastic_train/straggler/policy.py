"""What the job does about a slow node: evict it or not, and when an evicted node comes back.

:func:`decide_evictions` turns the flagged nodes into one :class:`Decision` each: evicted (policy ``evict``,
the job stays at ``min_nodes`` or more, and fewer than ``max_evictions`` happened in the last
``eviction_window`` seconds), or kept, with the reason. Worst score first: when the bound allows one eviction,
it is the slowest node's. An eviction is a voluntary leave through the hot path: nobody restarts, exactly-once
data and the global batch hold, no failure budget is spent.

An evicted node waits out a probation (:func:`probation`: ``probation_seconds``, doubled at each eviction of
the same node; longer while its health probe finds it slow, :mod:`elastic_train.rendezvous.probation`) and
rejoins on trial, as a node joining a running job does (its workers built on standby,
admitted at a step boundary): in the job, its own measured step time is judged again by the same detector,
and a node still slow is evicted again. After ``max_trials`` evictions it leaves the job. Such a re-eviction
does not spend the eviction budget: it returns the job to where it was before the trial, and ``max_trials``
bounds how often one node comes and goes (were it counted, a node still slow after its probation would be
kept in, slow, for the rest of the window).
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from elastic_train.straggler.config import StragglerConfig

#: Why a flagged node is kept in the job.
KEPT_REPORT = "policy is report"
KEPT_MIN_NODES = "min_nodes"
KEPT_BUDGET = "eviction budget spent"
KEPT_RESTART = "not every member re-forms in-process (an eviction would restart the others)"


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
    trial: bool = False
    """The node is back on trial after an eviction: evicting it again spends no budget."""

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
            "trial": self.trial,
        }


def decide_evictions(
    *,
    flagged: Sequence[tuple[str, float]],
    world: int,
    min_nodes: int,
    evicted_at: Iterable[float],
    now: float,
    cfg: StragglerConfig,
    in_process: bool = True,
    on_trial: Container[str] = (),
) -> list[Decision]:
    """One decision per flagged node.

    Args:
        flagged: (node, score) of each flagged node still in the job.
        world: nodes in the job now.
        min_nodes: the fewest the job trains with.
        evicted_at: when the job's earlier evictions that spent the budget happened (the clock of ``now``).
        now: the time of the decision.
        cfg: the policy and its bounds.
        in_process: every member of the job re-forms in-process (an eviction restarts nobody).
        on_trial: nodes evicted before in this run, back on trial: evicting one again spends no budget.

    Returns:
        The decisions, worst score first.
    """
    recent = sum(1 for t in evicted_at if now - t < cfg.eviction_window)
    room = world - min_nodes
    budget = cfg.max_evictions - recent
    out = []
    event: Literal["straggler_evict", "straggler_kept"]
    for node, score in sorted(flagged, key=lambda f: (-f[1], f[0])):
        trial = node in on_trial
        if cfg.policy != "evict":
            event, why = "straggler_kept", KEPT_REPORT
        elif not in_process:
            event, why = "straggler_kept", KEPT_RESTART
        elif room <= 0:
            event, why = "straggler_kept", KEPT_MIN_NODES
        elif budget <= 0 and not (trial and cfg.max_evictions > 0):
            event, why = "straggler_kept", KEPT_BUDGET
        else:
            event, why = "straggler_evict", "policy is evict"
        out.append(
            Decision(
                event, node, why, score, world, min_nodes, recent, cfg.max_evictions, cfg.eviction_window,
                trial,
            )
        )  # fmt: skip
        if event == "straggler_evict":
            room -= 1
            if not trial:
                budget, recent = budget - 1, recent + 1
    return out


def changed(previous: Mapping[str, Decision], decisions: Iterable[Decision]) -> list[Decision]:
    """The decisions that differ from the last one made about the same node (what to log: a node kept for
    the same reason step after step is one event, not one per step)."""
    return [
        d for d in decisions if (p := previous.get(d.node)) is None or (p.event, p.why) != (d.event, d.why)
    ]


@dataclass(frozen=True, slots=True)
class Probation:
    """What an evicted node does next: wait out a probation and rejoin on trial, or leave the job."""

    action: Literal["wait", "leave"]
    node: str
    evictions: int
    """This node's evictions so far, the last one included."""
    wait_s: float
    """Seconds it waits before it rejoins (0 when it leaves)."""
    max_trials: int

    @property
    def event(self) -> str:
        return "straggler_probation" if self.action == "wait" else "straggler_leave"

    def fields(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "action": self.action,
            "evictions": self.evictions,
            "wait_s": self.wait_s,
            "max_trials": self.max_trials,
        }


def probation(*, node: str, evictions: int, cfg: StragglerConfig) -> Probation:
    """An evicted node's probation: ``probation_seconds`` after its first eviction, doubled at each one
    after, and no more after ``max_trials`` evictions (it leaves).

    Args:
        node: the evicted node.
        evictions: its evictions so far, this one included (>= 1).
        cfg: ``probation_seconds`` and ``max_trials``.
    """
    assert evictions >= 1, "a probation follows an eviction"
    if evictions >= cfg.max_trials:
        return Probation("leave", node, evictions, 0.0, cfg.max_trials)
    return Probation("wait", node, evictions, cfg.probation_seconds * 2 ** (evictions - 1), cfg.max_trials)
