"""Exactly-once data order: a global cursor into each epoch's seeded permutation.

The whole job walks one permutation of ``range(dataset_len)`` per epoch, seeded by ``seed + epoch`` and
independent of the world size. Each optimizer step takes the next ``G`` (global batch) positions of that
permutation and splits them over the *current* world size ``W`` in contiguous shares: rank ``r`` gets the
positions ``[start_r, end_r)`` of the step, the first ``n % W`` ranks one sample more than the rest. The
sampler state ``{"epoch", "cursor", "seed"}`` is saved with every checkpoint, so a job that resumes at any
world size continues at the cursor: within an epoch no sample is skipped or repeated.

Epoch boundary: a step never straddles two epochs. When fewer than ``G`` samples are left in the epoch, the
last step of the epoch takes only those (a short step whose loss is the mean over its own sample count); the
next step starts the next epoch at cursor 0. So every epoch covers its permutation exactly once.

Everything here is a pure function of the state; the permutation is cached per epoch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class StepPlan:
    """The samples of one optimizer step and this rank's share of them."""

    epoch: int
    """Epoch the step belongs to."""
    start: int
    """Cursor (position in the epoch's permutation) of the step's first sample."""
    size: int
    """Samples in the whole step over all ranks (``G``, or fewer for the last step of an epoch)."""
    indices: list[int]
    """Dataset indices this rank trains in this step (may be empty when ``W > size``)."""


def share_bounds(size: int, world_size: int, rank: int) -> tuple[int, int]:
    """Contiguous share ``[lo, hi)`` of ``size`` samples for ``rank`` of ``world_size``.

    The first ``size % world_size`` ranks get one sample more; shares are disjoint and cover ``range(size)``.
    """
    assert 0 <= rank < world_size, (rank, world_size)
    base, extra = divmod(size, world_size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def epoch_permutation(seed: int, epoch: int, dataset_len: int) -> torch.Tensor:
    """The permutation of ``range(dataset_len)`` for ``epoch`` (same on every rank and every world size)."""
    gen = torch.Generator()
    gen.manual_seed(seed + epoch)
    return torch.randperm(dataset_len, generator=gen)


class ElasticSampler:
    """Hands out each step's samples for the current rank and advances the global cursor.

    Args:
        dataset_len: number of samples in the dataset.
        global_batch: samples per optimizer step over all ranks (``G``).
        seed: base seed; epoch ``e`` uses permutation seed ``seed + e``.
    """

    def __init__(self, dataset_len: int, global_batch: int, seed: int) -> None:
        if dataset_len < 1:
            raise ValueError(f"dataset_len: {dataset_len} must be >= 1")
        if global_batch < 1:
            raise ValueError(f"global_batch: {global_batch} must be >= 1")
        self.dataset_len = dataset_len
        self.global_batch = global_batch
        self.seed = seed
        self.epoch = 0
        self.cursor = 0
        self._perm: torch.Tensor | None = None
        self._perm_epoch = -1

    def state_dict(self) -> dict[str, Any]:
        """The state that goes into ``state["sampler"]``."""
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved cursor.

        Raises:
            ValueError: the state's seed differs from this sampler's, or the cursor is out of range.
        """
        if int(state["seed"]) != self.seed:
            raise ValueError(f"checkpoint sampler seed {state['seed']} differs from train.seed {self.seed}")
        cursor = int(state["cursor"])
        if not 0 <= cursor < self.dataset_len:
            raise ValueError(f"sampler cursor {cursor} is outside the dataset of {self.dataset_len} samples")
        self.epoch = int(state["epoch"])
        self.cursor = cursor

    def _permutation(self) -> torch.Tensor:
        if self._perm_epoch != self.epoch:
            self._perm = epoch_permutation(self.seed, self.epoch, self.dataset_len)
            self._perm_epoch = self.epoch
        assert self._perm is not None
        return self._perm

    def plan(self, world_size: int, rank: int) -> StepPlan:
        """This rank's share of the next step, without advancing (call :meth:`advance` after the step)."""
        size = min(self.global_batch, self.dataset_len - self.cursor)
        lo, hi = share_bounds(size, world_size, rank)
        perm = self._permutation()
        indices = perm[self.cursor + lo : self.cursor + hi].tolist()
        return StepPlan(epoch=self.epoch, start=self.cursor, size=size, indices=indices)

    def advance(self, plan: StepPlan) -> None:
        """Move the cursor past ``plan``'s step, rolling over to the next epoch at its end."""
        assert plan.epoch == self.epoch and plan.start == self.cursor, "advance() out of order"
        self.cursor += plan.size
        if self.cursor >= self.dataset_len:
            self.epoch += 1
            self.cursor = 0
