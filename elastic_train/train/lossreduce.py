"""The step's loss summed over ranks inside DDP's own gradient all-reduce, not in a collective of its own.

The loop reports the global mean loss of every step. A separate all-reduce of one number per step costs
little bandwidth but a full round of latency (and, on a CPU with few cores, thread wake-ups on every rank);
measured on 2 cores it was most of the loop's overhead over a plain DDP loop. :class:`LossCarrier` is a DDP
communication hook that behaves as DDP's default one (divide by the world size, then sum) and, for the first
bucket of the step, appends the step's loss sum to the bucket before the all-reduce and takes it back after.

The first bucket (index 0: the gradients that are ready first) is DDP's small one (``first_bucket_cap``, 1 MiB
by default), so the copy that appending costs stays small whatever the model's size; the last bucket can hold
up to ``bucket_cap_mb`` (25 MiB), and copying it on every step cost a 38 MB model ~3% of a 200 ms step.

The same ride carries, with speed-weighted shares (:mod:`elastic_train.train.balance`), one slot per rank for
the ranks' busy times of the step before: each rank fills its own slot and leaves the others 0, so the sum
is every rank's value, exact and the same on every rank.

Only used when every parameter is float32 or float64 (the appended value takes the bucket's dtype); with
other dtypes the loop keeps its separate all-reduce.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from elastic_train.train.busy import StepClock

PRECISE_DTYPES = (torch.float32, torch.float64)


class LossCarrier:
    """DDP comm hook state: :meth:`arm` before the step's synchronizing backward, :meth:`take` after it."""

    def __init__(self, group: Any = None, clock: StepClock | None = None) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.clock = clock
        self._pending: torch.Tensor | None = None
        self._reduced: torch.Tensor | None = None

    @staticmethod
    def suitable(model: torch.nn.Module) -> bool:
        """True when every trainable parameter has a dtype the loss can ride in without losing precision."""
        return all(p.dtype in PRECISE_DTYPES for p in model.parameters() if p.requires_grad)

    def register(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        ddp.register_comm_hook(self, _hook)

    def arm(self, loss_sum: torch.Tensor, extra: torch.Tensor | None = None) -> None:
        """Carry ``loss_sum`` (this rank's sum of per-sample losses), and ``extra`` values after it, with the
        next synchronizing backward."""
        value = loss_sum.detach().reshape(1)
        if extra is not None:
            value = torch.cat([value, extra.detach().reshape(-1).to(device=value.device, dtype=value.dtype)])
        self._pending = value
        self._reduced = None

    def take(self) -> torch.Tensor | None:
        """The sum over ranks of the armed values (the loss first, then ``extra``), or None when no bucket
        carried them."""
        out, self._reduced, self._pending = self._reduced, None, None
        return out


def _hook(state: LossCarrier, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    world = dist.get_world_size(state.group)
    buf = bucket.buffer()
    buf.div_(world)  # as DDP's default hook: divide first, then sum
    pending = state._pending
    clock = state.clock
    if bucket.index() != 0 or pending is None:
        if clock is not None:
            clock.launched()
        fut = dist.all_reduce(buf, group=state.group, async_op=True).get_future()
        return fut.then(lambda f: _done(clock, f.value()[0]))
    state._pending = None
    flat = torch.cat([buf, pending.to(device=buf.device, dtype=buf.dtype)])
    n = buf.numel()

    def split(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        out = f.value()[0]
        state._reduced = out[n:]
        return _done(clock, out[:n])

    if clock is not None:
        clock.launched()
    return dist.all_reduce(flat, group=state.group, async_op=True).get_future().then(split)


def _done(clock: StepClock | None, out: torch.Tensor) -> torch.Tensor:
    """A bucket's all-reduce completed: tell the step clock (slow-node detection's wait)."""
    if clock is not None:
        clock.completed()
    return out


# DDP checks a hook's annotations by identity; postponed (string) annotations would fail that check.
_hook.__annotations__ = {
    "state": LossCarrier,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
