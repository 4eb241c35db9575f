"""Which nodes are slow: each node's time per step against the median of the others', with hysteresis.

The input of a step is, per node, its *busy* time: the time its slowest rank spent on the step outside the
step's collectives (forward, backward, optimizer; what a slow GPU, a throttled CPU or a competing process
stretches). Where the loop cannot tell collective time apart, the step time is all there is, and in
synchronous training that is the same on every node: nobody stands out, and nobody is flagged.

A node's ratio at a step is its busy time over the median of the *other* nodes' (so a slow node of two is
twice the other, not 1.33 times their mean); its score is the median of its last ``window`` ratios (one slow
step is noise). A node whose score, over a full window, stays at or above ``threshold`` for ``slow_steps``
steps (and ``slow_seconds``) is flagged; a flagged node is cleared once its score falls below
``clear_below``. Every flag and clear is one :class:`Flag` with the numbers behind it. When every node slows
down alike (a slow storage, a throttled network) the median moves with them and the ratios stay near 1.

A node's first ``warmup_reports`` reports (at the job's start, after it rejoins, with a new decider, or
after a step it was missing from, which forgets it) are neither scored nor part of the others' median: its
first steps pay for lazy initialisation, compilation, connections and its neighbours' start-up, which are
not its pace. Nor does a score of fewer than ``window`` ratios count towards a flag: the median of one or two
reports is the noise the window is there to drop.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from statistics import median
from typing import Any, Literal

from elastic_train.straggler.config import StragglerConfig


@dataclass(frozen=True, slots=True)
class Flag:
    """A node flagged as slow, or cleared: one event, with the numbers it was decided on."""

    event: Literal["straggler_flagged", "straggler_cleared"]
    node: str
    step: int
    score: float
    """The node's score: the median of its last ratios to the others' median."""
    bar: float
    """What the score crossed: ``threshold`` (flagged) or ``clear_below`` (cleared)."""
    busy_s: float
    """The node's busy time at this step."""
    others_median_s: float
    """The median of the other nodes' busy times at this step."""
    slow_steps: int
    """Steps the score had stayed at or above the threshold."""
    slow_s: float
    """Seconds it had."""
    nodes: int
    """Nodes scored at this step."""

    def fields(self) -> dict[str, Any]:
        """The event's fields for a log line (``log.warning(flag.event, **flag.fields())``)."""
        return {
            "node": self.node,
            "step": self.step,
            "score": round(self.score, 3),
            "bar": self.bar,
            "busy_s": round(self.busy_s, 4),
            "others_median_s": round(self.others_median_s, 4),
            "slow_steps": self.slow_steps,
            "slow_s": round(self.slow_s, 2),
            "nodes": self.nodes,
        }


@dataclass(frozen=True, slots=True)
class Track:
    """One node's standing."""

    ratios: tuple[float, ...] = ()
    """Its last ``window`` ratios."""
    slow_since: tuple[int, float] | None = None
    """Step and time its score reached the threshold in the current streak (kept while flagged)."""
    flagged: bool = False
    seen: int = 0
    """Its reports observed so far (the first ``warmup_reports`` are not scored)."""

    @property
    def score(self) -> float | None:
        return median(self.ratios) if self.ratios else None


@dataclass(frozen=True, slots=True)
class DetectorState:
    """Every scored node's :class:`Track` (treat as immutable: :func:`observe` returns a new state)."""

    tracks: Mapping[str, Track] = field(default_factory=dict)

    @property
    def flagged(self) -> list[str]:
        """Flagged nodes, worst score first."""
        flagged = [n for n, t in self.tracks.items() if t.flagged]
        return sorted(flagged, key=lambda n: (-(self.tracks[n].score or 0.0), n))

    def score(self, node: str) -> float | None:
        track = self.tracks.get(node)
        return track.score if track else None


def median_without(ordered: Sequence[float], value: float) -> float:
    """The median of ``ordered`` (sorted) without one occurrence of ``value``, in O(1).

    Raises:
        ValueError: fewer than two values.
    """
    n = len(ordered)
    if n < 2:
        raise ValueError("a median of the others needs two values at least")
    i = bisect_left(ordered, value)

    def at(k: int) -> float:  # the k-th value of the list without ordered[i]
        return ordered[k] if k < i else ordered[k + 1]

    m = n - 1
    return at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2


def observe(
    state: DetectorState, step: int, busy: Mapping[str, float], now: float, cfg: StragglerConfig
) -> tuple[DetectorState, list[Flag]]:
    """Score one step.

    Args:
        state: the standing before this step.
        step: the step the figures are of.
        busy: each node's busy time at this step (seconds; a node missing here left the job and is
            forgotten, a value that is not a finite non-negative number is ignored).
        now: the time of the step (any clock, the same at every call), for ``slow_seconds``.
        cfg: the thresholds.

    Returns:
        The new standing, and the flags and clears of this step (worst score first).
    """
    if not cfg.enabled:
        return state, []
    values = {
        n: float(b) for n, b in busy.items() if isinstance(b, int | float) and math.isfinite(b) and b >= 0
    }
    tracks: dict[str, Track] = {}
    for node in values:
        track = state.tracks.get(node, Track())
        if track.seen < cfg.warmup_reports:  # still warming up: neither scored nor compared with
            tracks[node] = replace(track, seen=track.seen + 1)
    values = {n: b for n, b in values.items() if n not in tracks}
    ordered = sorted(values.values())
    flags: list[Flag] = []
    for node, b in values.items():
        track = state.tracks.get(node, Track())
        others = median_without(ordered, b) if len(ordered) >= 2 else 0.0
        seen = track.seen + 1
        if others <= 0:  # no one to compare with (a job of one node, or others that report no work)
            tracks[node] = replace(track, seen=seen)
            continue
        ratios = (*track.ratios, b / others)[-cfg.window :]
        score = median(ratios)
        since = track.slow_since
        if score >= cfg.threshold and len(ratios) >= cfg.window:
            since = since or (step, now)
        elif not (track.flagged and score >= cfg.clear_below):
            since = None
        flagged = track.flagged
        slow_steps = step - since[0] + 1 if since else 0
        slow_s = now - since[1] if since else 0.0
        event: Literal["straggler_flagged", "straggler_cleared"] | None = None
        if not flagged and slow_steps >= cfg.slow_steps and slow_s >= cfg.slow_seconds:
            flagged, event, bar = True, "straggler_flagged", cfg.threshold
        elif flagged and score < cfg.clear_below:
            flagged, event, bar = False, "straggler_cleared", cfg.clear_below
        if event is not None:
            flags.append(Flag(event, node, step, score, bar, b, others, slow_steps, slow_s, len(values)))
        tracks[node] = Track(ratios, since, flagged, seen)
    flags.sort(key=lambda f: (-f.score, f.node))
    return DetectorState(tracks), flags
