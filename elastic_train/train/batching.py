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


def share_weight(share: int, step_size: int, world_size: int, reduction: str = "mean") -> float:
    """Factor on a rank's loss so DDP's gradient average over ranks is the mean-loss gradient over the step.

    A step of ``step_size`` samples is split over ``world_size`` ranks; this rank trains ``share`` of them.
    DDP averages gradients, which weights every rank alike; when shares are uneven (``step_size`` not a
    multiple of the world size, or a world larger than the step) the plain mean over a rank's own samples
    would over-weight the samples of smaller shares. Multiplying the rank's loss by this factor fixes that:

    - ``reduction="sum"`` (the rank's loss is the sum over its samples): ``world_size / step_size``;
    - ``reduction="mean"`` (the mean over its samples): ``share · world_size / step_size``.

    A rank with no samples of its own (``share == 0``, e.g. a padded share) gets 0.

    Raises:
        ValueError: ``reduction`` is neither ``"mean"`` nor ``"sum"``.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction: {reduction!r} is neither 'mean' nor 'sum'")
    assert 0 <= share <= step_size and step_size >= 1 and world_size >= 1
    if share == 0:
        return 0.0
    scale = loss_scale(step_size, world_size)
    return scale * share if reduction == "mean" else scale
