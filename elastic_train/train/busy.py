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
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist


class StepClock:
    """One process's step clock (see the module docstring)."""

    def __init__(self) -> None:
        self._last: float | None = None
        self._launched = 0.0
        self._completed = 0.0
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
        self.last_busy = None if last is None else max(0.0, now - last - wait)
        return self.last_busy


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
    buf = bucket.buffer()
    buf.div_(dist.get_world_size(state.group))
    clock = state.clock
    clock.launched()
    fut = dist.all_reduce(buf, group=state.group, async_op=True).get_future()

    def done(f: torch.futures.Future[Any]) -> torch.Tensor:
        clock.completed()
        return f.value()[0]

    return fut.then(done)


# DDP checks a hook's annotations by identity; postponed (string) annotations would fail that check.
_timed_allreduce.__annotations__ = {
    "state": _Timed,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
