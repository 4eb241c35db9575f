"""Constant global batch: micro-batches, gradient accumulation and sample-count loss weighting.

A step of ``n`` samples (``G``, or fewer at an epoch's end) is split over ``W`` ranks; rank ``r`` trains its
share in micro-batches of at most ``train.micro_batch`` samples, accumulating gradients locally (DDP
``no_sync``) and all-reducing only on the last one. Each micro-batch backpropagates::

    sum(per-sample losses) * W / n

DDP averages the gradients over the ``W`` ranks, so the applied gradient is ``(1/n) · Σ_all samples ∇loss_i``:
exactly the gradient of the mean loss over the step's samples, whatever ``W`` and however unevenly the step is
split. A rank with no samples (``W > n``) still runs one empty micro-batch so it joins the all-reduce
with zero gradients.
"""

from __future__ import annotations

from collections.abc import Sequence


def micro_batches(indices: Sequence[int], micro_batch: int) -> list[list[int]]:
    """Split ``indices`` into consecutive chunks of at most ``micro_batch`` (0: one chunk); never empty."""
    items = list(indices)
    if micro_batch <= 0 or len(items) <= micro_batch:
        return [items]
    return [items[i : i + micro_batch] for i in range(0, len(items), micro_batch)]


def loss_scale(step_size: int, world_size: int) -> float:
    """Factor on a rank's summed per-sample loss so DDP's average over ranks gives the mean over the step."""
    assert step_size >= 1 and world_size >= 1
    return world_size / step_size
