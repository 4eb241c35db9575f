"""The step's loss summed over ranks inside DDP's own gradient all-reduce, not in a collective of its own.

The loop reports the global mean loss of every step. A separate all-reduce of one number per step costs
little bandwidth but a full round of latency (and, on a CPU with few cores, thread wake-ups on every rank);
measured on 2 cores it was most of the loop's overhead over a plain DDP loop. :class:`LossCarrier` is a DDP
communication hook that behaves as DDP's default one (divide by the world size, then sum) and, for the first
bucket of the step, appends the step's loss sum to the bucket before the all-reduce and takes it back after.

The first bucket (index 0: the gradients that are ready first) is DDP's small one (``first_bucket_cap``, 1 MiB
by default), so the copy that appending costs stays small whatever the model's size; the last bucket can hold
up to ``bucket_cap_mb`` (25 MiB), and copying it on every step cost a 38 MB model ~3% of a 200 ms step.

The same ride carries the values of the step clock's rider (:func:`elastic_train.train.busy.reduce_bucket`;
with speed-weighted shares, each rank's busy time of the step before in a slot of its own).

Only used when every parameter is float32 or float64 (the appended loss takes the bucket's dtype); with
other dtypes the loop keeps its separate all-reduce, and the clock's values ride with the timing hook of
:func:`~elastic_train.train.busy.time_collectives` instead.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from elastic_train.train.busy import StepClock, reduce_bucket

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

    def arm(self, loss_sum: torch.Tensor) -> None:
        """Carry ``loss_sum`` (this rank's sum of per-sample losses) with the next synchronizing backward."""
        self._pending = loss_sum.detach().reshape(1)
        self._reduced = None

    def _land(self, reduced: torch.Tensor) -> None:
        self._reduced = reduced

    def take(self) -> torch.Tensor | None:
        """The sum over ranks of the armed loss (shape ``[1]``), or None when no bucket carried it."""
        out, self._reduced, self._pending = self._reduced, None, None
        return out


def _hook(state: LossCarrier, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    pending = state._pending if bucket.index() == 0 else None
    if pending is not None:
        state._pending = None
    return reduce_bucket(bucket, state.group, state.clock, pending, state._land)


# DDP checks a hook's annotations by identity; postponed (string) annotations would fail that check.
_hook.__annotations__ = {
    "state": LossCarrier,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
