"""The Trainer's data at any world size: a constant global batch in micro-batches of the per-device batch.

A step of ``n`` samples (the global batch ``G``, fewer for an epoch's last step) is split over the ``W`` ranks
of the round in contiguous shares (:class:`~elastic_train.train.sampler.ElasticSampler`). Every rank trains
its share in the same number of micro-batches, the Trainer's ``gradient_accumulation_steps`` at this world::

    m = ceil(ceil(n / W) / b)        b = per_device_train_batch_size

so the largest share fits in ``m`` micro-batches of at most ``b`` samples (the memory the script was written
for), and each share is split into ``m`` nearly equal chunks. With speed-weighted shares (``shares="speed"``)
``m`` stays that of even shares (the Trainer sizes its epoch by it), so a rank whose share grew trains
micro-batches of up to twice ``b`` samples (a share is at most twice the even one), a slower one smaller
ones. DDP needs every rank's backward of every
micro-batch, so a chunk without a sample (a share smaller than ``m``, a world larger than the step) is one
padding sample whose loss counts for nothing (:func:`micro_weights`; its labels are masked).

The decisions are pure functions; :class:`MicroBatchSampler` puts them behind a DataLoader's batch sampler.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

from elastic_train.train.balance import share_bounds
from elastic_train.train.sampler import ElasticBatchSampler


def accumulation(step_size: int, world_size: int, micro_batch: int) -> int:
    """Micro-batches per rank for a step of ``step_size`` samples over ``world_size`` ranks (at least 1)."""
    assert step_size >= 1 and world_size >= 1 and micro_batch >= 1, (step_size, world_size, micro_batch)
    largest_share = -(-step_size // world_size)
    return max(1, -(-largest_share // micro_batch))


def split(indices: Sequence[int], count: int) -> list[list[int]]:
    """``indices`` in ``count`` consecutive chunks whose sizes differ by at most one (some may be empty)."""
    items = list(indices)
    chunks = []
    for j in range(count):
        lo, hi = share_bounds(len(items), count, j)
        chunks.append(items[lo:hi])
    return chunks


def step_sizes(dataset_len: int, global_batch: int) -> list[int]:
    """Samples of each step of an epoch: ``G`` each, the last one what is left."""
    full, rest = divmod(dataset_len, global_batch)
    return [global_batch] * full + ([rest] if rest else [])


def epoch_micro_batches(dataset_len: int, global_batch: int, world_size: int, micro_batch: int) -> int:
    """Micro-batches a rank iterates in a whole epoch (the training DataLoader's length at this world)."""
    return sum(accumulation(n, world_size, micro_batch) for n in step_sizes(dataset_len, global_batch))


def default_global_batch(per_device: int, accumulation_steps: int, local_world_size: int) -> int:
    """The global batch when none is given: ``per_device_train_batch_size * gradient_accumulation_steps``
    times the processes of one node (what the script trains per step on a node of its own)."""
    return per_device * accumulation_steps * max(1, local_world_size)


def micro_weights(counts: Sequence[int], step_size: int, world_size: int, divided_by: int) -> list[float]:
    """Factor on each micro-batch loss of this rank so that DDP's average over the ranks is the gradient of
    the mean loss over the step's ``step_size`` samples.

    For a loss that is the mean over its micro-batch of ``k`` samples, divided by ``divided_by`` before the
    backward (the Trainer divides by the accumulation steps), the factor is ``k · W · divided_by / n``: the
    sum over a rank's micro-batches is then its samples' share of the step's mean times ``W``, which DDP's
    average divides out. A padding micro-batch (``k == 0``) gets 0.

    Args:
        counts: samples in each of this rank's micro-batches of the step (0: padding).
        step_size: samples in the whole step over all ranks.
        world_size: ranks of the round.
        divided_by: what the loss was divided by before the backward (1: nothing).
    """
    assert step_size >= 1 and world_size >= 1 and divided_by >= 1
    return [k * world_size * divided_by / step_size for k in counts]


class MicroBatchSampler(ElasticBatchSampler):
    """The elastic sampler yielding this rank's share of each step as ``accumulation(...)`` micro-batches.

    Iterating yields the micro-batches of the remaining steps of the current epoch, from the committed
    cursor; its length is the whole epoch's (the Trainer sizes its loop and ``state.epoch`` by it). One audit
    line per step and rank holds the samples the rank trains in it (padding left out).

    Args:
        dataset: the training dataset (anything with ``len``).
        global_batch: samples per optimizer step over all ranks, at every world size.
        micro_batch: most samples per micro-batch (the per-device batch).
        seed: epoch ``e`` walks the permutation seeded ``seed + e``.
        world_size, rank, audit_dir, shares: as :class:`~elastic_train.train.sampler.ElasticBatchSampler`
            (the default process group's world by default; even shares by default).
    """

    def __init__(
        self,
        dataset: Any,
        global_batch: int,
        micro_batch: int,
        *,
        seed: int = 0,
        world_size: int | None = None,
        rank: int | None = None,
        audit_dir: str | None = None,
        shares: str = "even",
    ) -> None:
        if micro_batch < 1:
            raise ValueError(f"micro_batch: {micro_batch} must be >= 1")
        super().__init__(
            dataset, global_batch, seed=seed, world_size=world_size, rank=rank, audit_dir=audit_dir,
            shares=shares,
        )  # fmt: skip
        self.micro_batch = micro_batch

    @property
    def accumulation(self) -> int:
        """Micro-batches per full step at the current world size."""
        return accumulation(self.global_batch, self.world_size, self.micro_batch)

    def micro_counts(self) -> tuple[int, list[int]]:
        """The current step's size and the samples of each of this rank's micro-batches in it (0: padding)."""
        plan = self.current()
        chunks = split(plan.indices, accumulation(plan.size, self.world_size, self.micro_batch))
        return plan.size, [len(c) for c in chunks]

    def __len__(self) -> int:
        return epoch_micro_batches(self.dataset_len, self.global_batch, self.world_size, self.micro_batch)

    def __iter__(self) -> Iterator[list[int]]:
        for perm, cursor, indices in self._shares():
            size = min(self.global_batch, self.dataset_len - cursor)
            for chunk in split(indices, accumulation(size, self.world_size, self.micro_batch)):
                yield chunk or [int(perm[cursor])]


def steps_per_epoch(dataset_len: int, global_batch: int) -> int:
    """Optimizer steps in an epoch."""
    return math.ceil(dataset_len / global_batch)
