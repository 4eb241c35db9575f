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

A model sharded with FSDP2 has no gradient all-reduce to time: its collectives (an all-gather of each
block's parameters before its forward and its backward, a reduce-scatter of its gradients after) run inside
forward and backward, and a fast rank waits for the slowest in whichever it reaches first. There
:func:`time_collectives` wraps each ``fully_shard`` module's all-gather and reduce-scatter (FSDP2's custom
communication interface, around the communication FSDP2 would use) and the clock subtracts the time the
rank spent blocked in them: a synchronous collective's call (gloo's, on the CPU), and the ``wait()`` of an
asynchronous one (a prefetch). On CUDA, FSDP2 runs its collectives on streams of their own and the host
does not block in them: nothing is subtracted and the busy time is the step time, as without the hook.

Costs two clock reads per bucket or collective and one per step; no collective.

The same hooks carry values of the clock's :attr:`StepClock.rider` (speed-weighted shares,
:class:`elastic_train.train.balance.SpeedShares`): appended to the step's first gradient bucket (a sharded
model's: to each rank's chunk of the step's first gradient reduce-scatter), summed over the ranks with it,
and handed back to the clock (:meth:`StepClock.take_carried`).
"""

from __future__ import annotations

import threading
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
    """One process's step clock (see the module docstring).

    Args:
        loop_carries: the training loop carries the rider's values in a collective of its own each step
            when no gradient bucket did (the built-in loop's loss sum); a sharded model's reduce-scatters
            then carry nothing (otherwise the step's first one does, :func:`time_collectives`).
    """

    def __init__(self, *, loop_carries: bool = False) -> None:
        self.loop_carries = loop_carries
        self._last: float | None = None
        self._launched = 0.0
        self._completed = 0.0
        self._blocked = 0.0
        self._blocked_lock = threading.Lock()  # FSDP2 reduces gradients from autograd's threads on CUDA
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

    def blocked(self, seconds: float) -> None:
        """This rank was blocked ``seconds`` waiting for the others outside the gradient all-reduce: in a
        collective of a sharded model, the built-in loop's loss sum, a snapshot's replica exchange (any
        thread)."""
        if seconds <= 0:
            return
        with self._blocked_lock:
            self._blocked += seconds
        self.timed = True

    def lap(self) -> float | None:
        """At a step boundary: the busy seconds of the step since the last boundary (None at the first)."""
        now = time.perf_counter()
        last, self._last = self._last, now
        wait = max(0.0, self._completed - self._launched) if self._launched else 0.0
        with self._blocked_lock:
            wait += self._blocked
            self._blocked = 0.0
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


def time_collectives(model: torch.nn.Module, clock: StepClock) -> None:
    """Time this rank's waits for the others in ``model``'s collectives on ``clock``.

    For a model of one's own (the built-in loop times its own): call it once after wrapping the model in
    DDP, or after sharding it with ``fully_shard``, with :attr:`elastic_train.Checkpointer.clock`, so that
    slow-node detection can tell this rank's work from its wait for the others.

    - A ``DistributedDataParallel`` model gets a communication hook that behaves as DDP's default one
      (divide by the world size, then sum, over the DDP model's process group) and reports each bucket's
      launch and completion. A model with a communication hook of its own cannot take a second one.
    - A model sharded with FSDP2 (it or any of its submodules a ``fully_shard`` module): each such module's
      all-gather and reduce-scatter are wrapped, around the ones it has (torch's, or custom ones set
      before), and report the time the rank was blocked in them (see the module docstring). Set FSDP2's
      own communication options (symmetric memory, custom communication) before this call, not after.

    Raises:
        TypeError: ``model`` is neither a DDP model nor one with ``fully_shard`` modules.
    """
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model.register_comm_hook(_Timed(clock, model.process_group), _timed_allreduce)
        return
    from torch.distributed.fsdp import FSDPModule

    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not sharded:
        raise TypeError(
            f"time_collectives takes a DistributedDataParallel model or a model sharded with fully_shard "
            f"(FSDP2); got a {type(model).__name__} with neither"
        )
    for module in sharded:
        _time_fsdp(module, clock)


def _time_fsdp(module: Any, clock: StepClock) -> None:
    """Wrap one ``fully_shard`` module's all-gather and reduce-scatter (once: a second call re-targets the
    clock). A module whose communication torch does not let us read (see torchcompat) is left untimed."""
    from elastic_train.torchcompat import fsdp_comms

    comms = fsdp_comms(module)
    if comms is None:  # no parameters of its own, or several parameter groups
        return
    gather, scatter = (c.inner if isinstance(c, _TimedComm) else c for c in comms)
    module.set_custom_all_gather(_TimedComm(gather, clock))
    module.set_custom_reduce_scatter(_TimedReduceScatter(scatter, clock))


class _TimedComm:
    """FSDP2's all-gather or reduce-scatter ``inner``, with the time the caller is blocked in it reported.

    It has the shape of FSDP2's ``AllGather`` / ``ReduceScatter`` interfaces (``allocate`` and a call),
    delegating both: the collective, its buffers and its arguments are the inner one's."""

    def __init__(self, inner: Any, clock: StepClock) -> None:
        self.inner = inner
        self.clock = clock

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, *args: Any, **kwargs: Any) -> dist.Work | None:
        started = time.perf_counter()
        work = self.inner(*args, **kwargs)
        self.clock.blocked(time.perf_counter() - started)
        return None if work is None else _TimedWork(work, self.clock)


class _TimedReduceScatter(_TimedComm):
    """A timed reduce-scatter that also carries the clock's rider: the step's first gradient reduce-scatter
    (unless the loop carries it, :attr:`StepClock.loop_carries`) appends the rider's values to each rank's
    chunk of the input, so that every rank receives their sum with its own chunk.

    FSDP2 may reduce with a sum, a mean or a pre-multiplied sum (a divide factor), and in the gradients'
    dtype: a last slot of 1 in every chunk comes back as the factor applied to ``world`` ones, and the
    values are scaled back by it. Every rank computes the same numbers from the same sums (each slot is one
    rank's value and zeros: exact in any float dtype before the scaling), so the ranks agree. The cost is
    one copy of that module's gradients into a buffer a few elements per rank larger, once a step."""

    def __call__(self, *args: Any, **kwargs: Any) -> dist.Work | None:
        if self.clock.rider is None or self.clock.loop_carries or args or kwargs.get("async_op"):
            return super().__call__(*args, **kwargs)
        slots = self.clock.carry()
        if slots is None:
            return super().__call__(*args, **kwargs)
        out, grads, group = kwargs["output_tensor"], kwargs["input_tensor"], kwargs["group"]
        world, n = dist.get_world_size(group), out.numel()
        values = torch.cat([slots.reshape(-1).to(grads), grads.new_ones(1)])
        row = n + values.numel()
        rows = grads.new_empty((world, row))
        rows[:, :n].copy_(grads.view(world, n))
        rows[:, n:].copy_(values.expand(world, values.numel()))
        got = grads.new_empty(row)
        work = super().__call__(**{**kwargs, "output_tensor": got, "input_tensor": rows.view(-1)})
        if work is not None:
            work.wait()
        out.copy_(got[:n])
        summed = got[n:]
        # On the device: read at the commit, after FSDP2 made the step's stream wait for this one.
        self.clock.landed(summed[:-1].double() * (world / summed[-1].double()))
        return None


class _TimedWork(dist.Work):
    """An asynchronous collective's ``Work`` whose ``wait()`` reports the time it blocked."""

    def __init__(self, inner: dist.Work, clock: StepClock) -> None:
        super().__init__()
        self._inner = inner
        self._clock = clock

    def wait(self, timeout: Any = None) -> bool:
        started = time.perf_counter()
        try:
            return self._inner.wait() if timeout is None else self._inner.wait(timeout)
        finally:
            self._clock.blocked(time.perf_counter() - started)

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def is_success(self) -> bool:
        return self._inner.is_success()

    def exception(self) -> Any:
        return self._inner.exception()

    def source_rank(self) -> int:
        return self._inner.source_rank()

    def result(self) -> list[torch.Tensor]:
        return self._inner.result()

    def synchronize(self) -> None:
        self._inner.synchronize()

    def get_future(self) -> torch.futures.Future[Any]:
        return self._inner.get_future()


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
