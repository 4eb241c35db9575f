"""How long a step kept this rank busy: its wall time less its wait for the gradient all-reduce.

In synchronous data parallel training every rank's step lasts as long as the slowest rank's, so the step
time says nothing about which rank is slow: the fast ranks spend the difference waiting in the step's
all-reduce. DDP launches each gradient bucket's all-reduce from backward as the bucket fills, and the last
bucket is launched when the rank's backward is done; from then until that all-reduce completes the rank only
waits for the others. :class:`StepClock` takes both times from a DDP communication hook (the built-in loop's
:class:`~elastic_train.train.lossreduce.LossCarrier`, or :func:`time_collectives` on a DDP model of one's
own) and, at each step boundary, returns the step's wall time less that wait: the rank's *busy* time, which
slow-node detection compares across nodes (docs/stragglers.md). Without a timed hook the wait is unknown and
the busy time is the step time, the same on every rank: nobody stands out and nobody is flagged.

Costs two clock reads per bucket and one per step; no collective.

The same hooks carry values of the clock's :attr:`StepClock.rider` (speed-weighted shares,
:class:`elastic_train.train.balance.SpeedShares`): appended to the step's first gradient bucket, summed over
the ranks with it, and handed back to the clock (:meth:`StepClock.take_carried`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist


class Rider(Protocol):
    """Values a rank sends with each step's gradients (summed over the ranks)."""

    def slots(self, busy: float | None) -> torch.Tensor:
        """This step's values, given this rank's busy seconds of the step before (None: unknown)."""
        ...


class StepClock:
    """One process's step clock (see the module docstring)."""

    def __init__(self) -> None:
        self._last: float | None = None
        self._launched = 0.0
        self._completed = 0.0
        self.rider: Rider | None = None
        """Values to carry with each step's first gradient bucket (None: nothing)."""
        self._carrying = False
        self._carried: torch.Tensor | None = None
        self.last_busy: float | None = None
        """What :meth:`lap` returned last."""
        self.timed = False
        """True once a hook reported an all-reduce (the busy time is then wall time less the wait)."""

    def launched(self) -> None:
        """A bucket's all-reduce was launched (the training thread, from the comm hook)."""
        self._launched = time.perf_counter()
        self.timed = True

    def completed(self) -> None:
        """A bucket's all-reduce completed (any thread: the future's callback)."""
        self._completed = time.perf_counter()

    def lap(self) -> float | None:
        """At a step boundary: the busy seconds of the step since the last boundary (None at the first)."""
        now = time.perf_counter()
        last, self._last = self._last, now
        wait = max(0.0, self._completed - self._launched) if self._launched else 0.0
        self._launched = self._completed = 0.0
        self._carrying = False
        self.last_busy = None if last is None else max(0.0, now - last - wait)
        return self.last_busy

    def carry(self) -> torch.Tensor | None:
        """The rider's values for this step's first gradient bucket (once a step; None: nothing to carry)."""
        if self.rider is None or self._carrying:
            return None
        self._carrying = True
        return self.rider.slots(self.last_busy)

    def landed(self, values: torch.Tensor) -> None:
        """The carried values came back summed over the ranks (the all-reduce's callback)."""
        self._carried = values

    def take_carried(self) -> torch.Tensor | None:
        """The sum over the ranks of the values carried since the last call (None: none were)."""
        out, self._carried = self._carried, None
        return out


def time_collectives(ddp: torch.nn.parallel.DistributedDataParallel, clock: StepClock) -> None:
    """Register a DDP communication hook that behaves as DDP's default one (divide by the world size, then
    sum, over the DDP model's process group) and reports each bucket's launch and completion to ``clock``.

    For a DDP model of one's own (the built-in loop's hook already reports): call it once after wrapping,
    with :attr:`elastic_train.Checkpointer.clock`, so that slow-node detection can tell this rank's work
    from its wait for the others. A model with a communication hook of its own cannot take a second one.
    """
    ddp.register_comm_hook(_Timed(clock, ddp.process_group), _timed_allreduce)


class _Timed:
    """The hook's state: the clock and the process group."""

    def __init__(self, clock: StepClock, group: Any) -> None:
        self.clock = clock
        self.group = group


def _timed_allreduce(state: _Timed, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return reduce_bucket(bucket, state.group, state.clock)


def reduce_bucket(
    bucket: dist.GradBucket,
    group: Any,
    clock: StepClock | None,
    pending: torch.Tensor | None = None,
    landed: Callable[[torch.Tensor], None] | None = None,
) -> torch.futures.Future[torch.Tensor]:
    """DDP's default reduction of one gradient bucket (divide by the world size, then sum), timed on
    ``clock``. The first bucket (index 0, DDP's small one) also carries ``pending`` (handed summed to
    ``landed``) and the clock's rider's values (handed back to the clock), appended to it in its dtype."""
    buf = bucket.buffer()
    buf.div_(dist.get_world_size(group))
    extra: list[torch.Tensor] = []
    slots = None
    if bucket.index() == 0:
        if pending is not None:
            extra.append(pending)
        slots = clock.carry() if clock is not None else None
        if slots is not None:
            extra.append(slots)
    if clock is not None:
        clock.launched()
    if not extra:
        fut = dist.all_reduce(buf, group=group, async_op=True).get_future()
        return fut.then(lambda f: _done(clock, f.value()[0]))
    n = buf.numel()
    flat = torch.cat([buf, *(e.reshape(-1).to(device=buf.device, dtype=buf.dtype) for e in extra)])

    def split(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        out = f.value()[0]
        at = n
        if pending is not None:
            at += pending.numel()
            if landed is not None:
                landed(out[n:at])
        if slots is not None and clock is not None:
            clock.landed(out[at:])
        return _done(clock, out[:n])

    return dist.all_reduce(flat, group=group, async_op=True).get_future().then(split)


def _done(clock: StepClock | None, out: torch.Tensor) -> torch.Tensor:
    """A bucket's all-reduce completed: tell the step clock (the wait of slow-node detection)."""
    if clock is not None:
        clock.completed()
    return out


# DDP checks a hook's annotations by identity; postponed (string) annotations would fail that check.
_timed_allreduce.__annotations__ = {
    "state": _Timed,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
