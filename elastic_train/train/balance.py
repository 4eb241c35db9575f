"""Speed-weighted shares (``train.shares: speed``): a slow rank trains fewer of a step's samples, the others
more.

In synchronous data parallel training every step lasts as long as its slowest rank's work. Evicting a node
slowed ``k`` times leaves the step to ``W - 1`` ranks; keeping it with a share proportional to its speed
keeps its remaining throughput as well: for one of 3 ranks slowed 2x, even shares take ``2 · G/3`` sample
times a step, speed-weighted ones ``G/2.5`` (1.67x faster), evicting it ``G/2`` (1.33x).

How the shares are agreed without a collective of their own: each rank's *busy* time of its previous step
(:class:`elastic_train.train.busy.StepClock`: the step's wall time less the wait for the gradient
all-reduce) rides in DDP's first gradient bucket (:func:`elastic_train.train.busy.reduce_bucket`, the hook of
the built-in loop and of :func:`~elastic_train.train.busy.time_collectives`), one slot per rank. After the
step every rank holds the same vector (each slot is one rank's value plus zeros: exact in any float dtype),
feeds it to its own :class:`ShareBalancer` (:class:`SpeedShares`, at the step's commit), and all of them
reach the same decision from the same numbers, at the same step. The balancer keeps a
cost per sample per rank (its busy time over the samples it trained), the median of the last ``window``
steps trained under the current shares, and proposes shares proportional to the ranks' speeds (1 / cost),
each between ``floor`` and ``cap`` times the even share. It adopts them only when they are predicted to
shorten the step by ``min_gain`` or more (hysteresis: noise on a healthy job moves nothing), then waits for
a full ``window`` under the new shares and checks what they did: when the slowest rank's busy time did not
fall by at least half of ``min_gain`` (a cost that does not scale with the samples: a per-step overhead on a
slow node), the change is undone and the shares are left alone for ``hold`` steps, doubled at each undo. A
rank that became busier with fewer samples than it was before the change (by more than ``min_gain``) has
slowed meanwhile (the window the change was decided on caught its slowdown only in part): no undo, the
shares are decided afresh from the new window.
Repeated, the rule converges on shares that equalise the ranks' busy times; a node that becomes fast again
earns its share back the same way.

The data order is untouched: a step's samples are the same ``G`` positions of the epoch's permutation,
split in contiguous shares of the agreed sizes (exactly-once holds for any split the ranks agree on), and
the loss weighting of :mod:`elastic_train.train.batching` makes the update the mean-loss gradient over the
step for any split. A new worker group starts with even shares.

When the new shares apply: a DataLoader with workers draws steps ahead of training, so a decision taken at
a step's commit cannot change the steps any rank has drawn already. Each rank also carries how far ahead
it has drawn (:meth:`~elastic_train.train.sampler.ElasticBatchSampler.ahead`), and the shares apply from the
first step no rank can have drawn, leaving one more draw of margin: with no prefetch, the step after the
next one.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

#: Defaults of the balancer (see :class:`ShareBalancer`).
WINDOW = 5
MIN_GAIN = 0.05
FLOOR = 0.25
CAP = 2.0
HOLD = 10


def share_bounds(size: int, world_size: int, rank: int) -> tuple[int, int]:
    """Even contiguous share ``[lo, hi)`` of ``size`` samples for ``rank`` of ``world_size``.

    The first ``size % world_size`` ranks get one sample more; shares are disjoint and cover ``range(size)``.
    """
    assert 0 <= rank < world_size, (rank, world_size)
    base, extra = divmod(size, world_size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def weighted_counts(size: int, weights: Sequence[float] | None, world_size: int) -> list[int]:
    """``size`` samples split over ``world_size`` ranks in proportion to ``weights`` (None: the even shares of
    :func:`share_bounds`).

    Largest remainders, ties to the lower rank: a pure function of its arguments, so every rank computes
    the same split. The counts sum to ``size``.
    """
    if weights is None:
        return [hi - lo for lo, hi in (share_bounds(size, world_size, r) for r in range(world_size))]
    assert len(weights) == world_size and all(w > 0 for w in weights), weights
    total = sum(weights)
    exact = [size * w / total for w in weights]
    counts = [int(x) for x in exact]
    left = size - sum(counts)
    order = sorted(range(world_size), key=lambda r: (-(exact[r] - counts[r]), r))
    for r in order[:left]:
        counts[r] += 1
    return counts


def share_range(counts: Sequence[int], rank: int) -> tuple[int, int]:
    """Contiguous share ``[lo, hi)`` of ``rank`` given every rank's count."""
    lo = sum(counts[:rank])
    return lo, lo + counts[rank]


@dataclass(frozen=True, slots=True)
class ShareChange:
    """New shares adopted after ``step``: one event with the numbers behind it."""

    step: int
    """The step whose end decided it (the new shares apply from the step after the next one started)."""
    old: list[int]
    """Each rank's samples of a full step before."""
    new: list[int]
    """And after."""
    cost_ms: list[float]
    """Each rank's busy milliseconds per sample (median of the window)."""
    predicted_s: tuple[float, float]
    """The slowest rank's busy seconds a step under the old shares (measured) and under the new ones
    (predicted; measured when the change undoes one)."""
    why: str = "faster"
    """``faster``, or ``undone`` (the change before did not shorten the step)."""

    def fields(self) -> dict[str, Any]:
        old, new = self.predicted_s
        return {
            "why": self.why,
            "old": self.old,
            "new": self.new,
            "cost_ms_per_sample": self.cost_ms,
            "predicted_step_s": [round(old, 4), round(new, 4)],
            "predicted_gain": round(old / new, 3) if new > 0 else None,
        }


class ShareBalancer:
    """Every rank's copy of the share decision (see the module docstring).

    Args:
        world_size: ranks in the group.
        global_batch: samples in a full step (``G``).
        window: steps under the current shares whose costs are taken (median) before a decision.
        min_gain: adopt new shares only when they shorten the predicted step by this fraction or more.
        floor: the smallest share, as a fraction of the even share ``G / W``.
        cap: the largest share, as a multiple of the even share (it bounds a fast rank's memory growth).
        hold: steps without a change after one is undone (doubled at each further undo).
    """

    def __init__(
        self,
        world_size: int,
        global_batch: int,
        *,
        window: int = WINDOW,
        min_gain: float = MIN_GAIN,
        floor: float = FLOOR,
        cap: float = CAP,
        hold: int = HOLD,
    ) -> None:
        if world_size < 1 or global_batch < 1 or window < 1:
            raise ValueError(
                f"world_size {world_size}, global_batch {global_batch}, window {window}: each must be >= 1"
            )
        if not 0 < floor <= 1 <= cap:
            raise ValueError(f"floor {floor} and cap {cap}: need 0 < floor <= 1 <= cap")
        self.world_size = world_size
        self.global_batch = global_batch
        self.window = window
        self.min_gain = min_gain
        self.floor = floor
        self.cap = cap
        self.hold = hold
        self.weights: tuple[float, ...] | None = None
        """The current shares' weights (None: even)."""
        self._since = 0  # steps numbered below this were trained under other shares
        self._costs: list[deque[float]] = [deque(maxlen=window) for _ in range(world_size)]
        #: After a change: the slowest busy seconds before it, the rank that was that slowest, and the
        #: weights the change replaced.
        self._judge: tuple[float, int, tuple[float, ...] | None] | None = None
        self._undone = 0

    def counts(self, size: int) -> list[int]:
        """Every rank's samples of a step of ``size`` under the current shares."""
        return weighted_counts(size, self.weights, self.world_size)

    def observe(
        self, step: int, size: int, busy: Sequence[float], *, applies_from: int | None = None
    ) -> ShareChange | None:
        """Step ``step`` (of ``size`` samples) kept each rank busy ``busy[r]`` seconds (0: unknown).

        Returns the change adopted after it, or None. Every rank must call it with the same arguments.
        ``applies_from``: the first step a change made now is trained with (default ``step + 2``: the step
        after ``step`` was drawn before its busy times were known); steps before it are not judged.
        """
        assert len(busy) == self.world_size
        first = step + 2 if applies_from is None else applies_from
        assert first > step, (first, step)
        if step < self._since:
            return None
        counts = self.counts(size)
        for r, (n, b) in enumerate(zip(counts, busy, strict=True)):
            if n > 0 and b > 0:
                self._costs[r].append(b / n)
        if any(len(c) < self.window for c in self._costs):
            return None
        cost = [statistics.median(c) for c in self._costs]
        old = self.counts(self.global_batch)
        slowest = max(range(self.world_size), key=lambda r: cost[r] * old[r])
        before = cost[slowest] * old[slowest]
        cost_ms = [round(c * 1000, 3) for c in cost]
        if self._judge is not None:
            earlier, relieved, replaced = self._judge
            self._judge = None
            # busier with fewer samples: that rank's speed changed (the window the change was decided on
            # caught a slowdown only in part), not a cost the split cannot move; decide afresh instead
            slowed = cost[relieved] * old[relieved] > earlier * (1.0 + self.min_gain)
            if before > earlier * (1.0 - self.min_gain / 2) and not slowed:
                self.weights = replaced
                self._undone += 1
                self._restart(first, self.hold * 2 ** (self._undone - 1))
                new = self.counts(self.global_batch)
                return ShareChange(step, old, new, cost_ms, (before, earlier), why="undone")
            self._undone = 0
        weights = self._proposal(cost)
        new = weighted_counts(self.global_batch, weights, self.world_size)
        after = max(c * n for c, n in zip(cost, new, strict=True))
        if new == old or after > before * (1.0 - self.min_gain):
            return None
        if min(new) < 1 <= self.global_batch // self.world_size:
            return None  # a rank without samples could not be measured again
        self._judge = (before, slowest, self.weights)
        self.weights = weights
        self._restart(first, 0)
        return ShareChange(step, old, new, cost_ms, (before, after))

    def _restart(self, first: int, hold: int) -> None:
        """New shares from step ``first`` on: judge only steps trained under them, ``hold`` steps later."""
        self._since = first + hold
        for c in self._costs:
            c.clear()

    def _proposal(self, cost: Sequence[float]) -> tuple[float, ...]:
        """Weights proportional to speed, each share kept within [floor, cap] of the even share: the shares
        ``clamp(λ · speed)`` that sum to 1 (``λ`` by bisection: the sum grows with it)."""
        w = self.world_size
        speed = [1.0 / c for c in cost]
        lo, hi = self.floor / w, self.cap / w

        def shares(scale: float) -> list[float]:
            return [min(hi, max(lo, scale * v)) for v in speed]

        low, high = 0.0, 1.0 / min(speed)  # at ``high`` every share is min(hi, >= 1) >= 1 / w: a sum >= 1
        for _ in range(100):
            mid = (low + high) / 2
            if sum(shares(mid)) < 1.0:
                low = mid
            else:
                high = mid
        return tuple(shares(high))


class ShareDrawer(Protocol):
    """What :class:`SpeedShares` needs of the sampler that draws the shares
    (:class:`~elastic_train.train.sampler.ElasticBatchSampler`)."""

    global_batch: int

    def ahead(self) -> int: ...

    def set_weights(self, weights: tuple[float, ...] | None, first_step: int) -> None: ...


class SpeedShares:
    """One group's speed-weighted shares (an :class:`~elastic_train.train.sampler.ElasticBatchSampler` made
    with ``shares="speed"``): the values each rank carries with a step's gradients (the step clock's
    :attr:`~elastic_train.train.busy.StepClock.rider`) and the decision every rank takes from their sum at
    the step's commit. Made by the group's :class:`~elastic_train.train.checkpointer.Checkpointer`, which
    also resets the sampler to even shares for the new group.

    The carried vector has ``2 · W`` slots: this rank's busy seconds of the step before in slot ``rank``
    (0: unknown, the first step of a group), and how many steps ahead of the committed one it has drawn in
    slot ``W + rank``.
    """

    def __init__(
        self,
        sampler: ShareDrawer,
        *,
        rank: int,
        world_size: int,
        balancer: ShareBalancer | None = None,
    ) -> None:
        self.sampler = sampler
        self.rank = rank
        self.world_size = world_size
        self.balancer = balancer or ShareBalancer(world_size, sampler.global_batch)
        self._last: tuple[int, int] | None = None  # (step, samples) committed last in this group

    def slots(self, busy: float | None) -> torch.Tensor:
        """This rank's values for the step being trained (see the class docstring)."""
        values = torch.zeros(2 * self.world_size, dtype=torch.float64)
        if busy is not None and self._last is not None:
            values[self.rank] = busy
        values[self.world_size + self.rank] = self.sampler.ahead()
        return values

    def decide(self, step: int, size: int, carried: torch.Tensor | None) -> ShareChange | None:
        """At the commit of ``step`` (of ``size`` samples): ``carried`` is the sum over the ranks of the
        values its backward carried (None: none rode). Returns the change adopted, which the sampler then
        draws with; the same on every rank."""
        last, self._last = self._last, (step, size)
        w = self.world_size
        if carried is None or last is None or last[0] != step - 1 or carried.numel() != 2 * w:
            return None
        values = carried.tolist()
        ahead = max(round(v) for v in values[w:])
        first = step + max(ahead, 1) + 1  # the first step no rank can have drawn, one draw of margin
        change = self.balancer.observe(last[0], last[1], values[:w], applies_from=first)
        if change is not None:
            self.sampler.set_weights(self.balancer.weights, first)
        return change
