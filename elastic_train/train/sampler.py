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

Everything in :class:`ElasticSampler` is a pure function of the state; the permutation is cached per epoch.
:class:`ElasticBatchSampler` puts it behind ``DataLoader(dataset, batch_sampler=...)`` for a user's own loop:
it yields this rank's share of each step of the epoch (ahead of training, as a DataLoader with workers
prefetches), while the cursor moves only when a step is committed (:meth:`ElasticBatchSampler.advance`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from elastic_train.envvars import ENV_AUDIT_DIR
from elastic_train.train.balance import share_bounds, share_range, weighted_counts
from elastic_train.train.batching import share_weight
from elastic_train.train.config import check_shares
from elastic_train.train.link import worker_env


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


Weights = tuple[float, ...] | None
"""The ranks' relative shares of a step (None: even shares)."""


def _bounds(size: int, world_size: int, rank: int, weights: Weights) -> tuple[int, int]:
    if weights is None or len(weights) != world_size:
        return share_bounds(size, world_size, rank)
    return share_range(weighted_counts(size, weights, world_size), rank)


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
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "seed": self.seed,
            "dataset_len": self.dataset_len,
            "global_batch": self.global_batch,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved cursor.

        The global batch may differ from the saved one (the cursor is a position in the permutation, so the
        epoch still covers every sample once); the dataset length may not: the permutation would differ.

        Raises:
            ValueError: the state's seed or dataset length differs from this sampler's, or the cursor is
                out of range.
        """
        if int(state["seed"]) != self.seed:
            raise ValueError(f"checkpoint sampler seed {state['seed']} differs from train.seed {self.seed}")
        saved_len = state.get("dataset_len")  # absent in checkpoints of earlier versions
        if saved_len is not None and int(saved_len) != self.dataset_len:
            raise ValueError(
                f"the dataset has {self.dataset_len} samples, but the checkpoint's data order is for "
                f"{int(saved_len)}: the dataset changed since the checkpoint"
            )
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

    def plan(self, world_size: int, rank: int, weights: Weights = None) -> StepPlan:
        """This rank's share of the next step, without advancing (call :meth:`advance` after the step).

        ``weights``: the ranks' relative shares (:func:`~elastic_train.train.balance.weighted_counts`);
        None: even shares.
        """
        size = min(self.global_batch, self.dataset_len - self.cursor)
        lo, hi = _bounds(size, world_size, rank, weights)
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


class ElasticBatchSampler(ElasticSampler):
    """Exactly-once, constant-global-batch data order for ``DataLoader(dataset, batch_sampler=...)``.

    Each item is this rank's share (a list of dataset indices) of one optimizer step: ``global_batch``
    samples over all ranks, fewer for the last step of an epoch. Iterating yields the remaining steps of the
    current epoch, from the committed cursor; a ``for epoch in range(sampler.epoch, epochs)`` loop around it
    resumes where a restored state left off. The cursor is *not* moved by iteration (a DataLoader with
    workers fetches ahead): :meth:`advance` moves it by one step, and ``Checkpointer.commit`` calls it
    after the optimizer step, so the cursor saved with a state always points just after its last step.

    Args:
        dataset: the dataset (anything with ``len``) or its length.
        global_batch: samples per optimizer step over all ranks (``G``), whatever the world size.
        seed: epoch ``e`` walks the permutation seeded ``seed + e``.
        world_size: ranks sharing each step (default: the default process group's size, 1 without one).
        rank: this rank (default: the default process group's rank).
        round: rendezvous round written into audit lines (default: from torchrun's environment).
        audit_dir: append one line per step with the indices this rank takes to
            ``audit_dir/rank-R-round-N.jsonl`` (default: ``$ELASTIC_TRAIN_AUDIT_DIR``; None: no audit).
        pad_empty: a rank whose share of a step is empty (the world is larger than the step) gets the step's
            first sample instead, with a loss weight of 0 (:meth:`loss_weight`): a DataLoader cannot collate
            an empty batch, and DDP needs every rank's backward. False: yield the empty list.
        shares: ``"even"`` (each rank ``G / W`` of every step) or ``"speed"``: each rank's share follows its
            measured speed (:mod:`elastic_train.train.balance`), decided by the group's
            :class:`~elastic_train.train.checkpointer.Checkpointer` from the busy times that ride with the
            gradients (:func:`~elastic_train.train.busy.time_collectives` on a DDP model of one's own).
            Each step is drawn with the shares agreed for it, so :meth:`loss_weight` stays exact.
    """

    def __init__(
        self,
        dataset: Any,
        global_batch: int,
        *,
        seed: int = 0,
        world_size: int | None = None,
        rank: int | None = None,
        round: int | None = None,
        audit_dir: str | None = None,
        pad_empty: bool = True,
        shares: str = "even",
    ) -> None:
        check_shares(shares)
        dataset_len = dataset if isinstance(dataset, int) else len(dataset)
        super().__init__(dataset_len, global_batch, seed)
        if world_size is not None and world_size < 1:
            raise ValueError(f"world_size: {world_size} must be >= 1")
        if rank is not None and not 0 <= rank < (world_size or _default_world()[0]):
            raise ValueError(f"rank: {rank} is outside the world")
        self._world_size = world_size
        self._rank = rank
        self._round = round
        self.audit_dir = audit_dir if audit_dir is not None else (os.environ.get(ENV_AUDIT_DIR) or None)
        self.pad_empty = pad_empty
        self.shares = shares
        #: Optimizer steps committed so far (numbers the audit lines; set from the restored state).
        self.step = 0
        self._generation = 0
        self._audit: Any = None
        self._audited = 0  # highest step with an audit line from this process
        #: (first step, weights) of the shares agreed in this group, in step order (empty: even shares).
        self._schedule: list[tuple[int, Weights]] = []
        self._drawn = 0  # the step the newest iterator yielded last

    # -- where this rank stands ----------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self._world_size if self._world_size is not None else _default_world()[0]

    @property
    def rank(self) -> int:
        return self._rank if self._rank is not None else _default_world()[1]

    def current(self) -> StepPlan:
        """This rank's share of the step being trained now (the one after the committed cursor)."""
        return self.plan(self.world_size, self.rank, self.weights_at(self.step + 1))

    # -- speed-weighted shares -----------------------------------------------------------------------------
    def weights_at(self, step: int) -> Weights:
        """The ranks' relative shares of step ``step`` (None: even)."""
        entry = self._entry(step)
        return self._schedule[entry][1] if entry >= 0 else None

    def set_weights(self, weights: Weights, first_step: int) -> None:
        """Draw the steps from ``first_step`` on with ``weights`` (every rank of the group alike).

        Raises:
            TrainingError: this rank already drew ``first_step`` (a DataLoader iterated further ahead of
                training than the group allowed for): its share of that step would differ from the others'.
        """
        if self._drawn >= first_step:
            from elastic_train.train.errors import TrainingError

            raise TrainingError(
                f"speed-weighted shares: step {first_step} is to be split anew, but this rank already drew "
                f"step {self._drawn}: the loop fetched batches further ahead between a backward and its "
                "commit than the shares allow for; use shares='even'"
            )
        # entries before the one the current step is drawn with are spent; those from first_step on replaced
        kept = self._schedule[max(self._entry(self.step + 1), 0) :]
        self._schedule = [(f, w) for f, w in kept if f < first_step] + [(first_step, weights)]

    def _entry(self, step: int) -> int:
        """Index of the schedule entry step ``step`` is drawn with (-1: none, even shares)."""
        entry = -1
        for i, (first, _) in enumerate(self._schedule):
            if first > step:
                break
            entry = i
        return entry

    def reset_weights(self) -> None:
        """Even shares again (a new group: its ranks agree on nothing yet)."""
        self._schedule = []
        self._drawn = 0

    def ahead(self) -> int:
        """How many steps past the committed one this rank has drawn (a DataLoader's prefetch)."""
        return max(0, self._drawn - self.step)

    def loss_weight(self, reduction: str = "mean") -> float:
        """Factor on this rank's loss of the current step so that DDP's gradient average over the ranks is the
        gradient of the mean loss over the whole step (see :func:`elastic_train.train.batching.share_weight`).

        Args:
            reduction: how the rank's loss was reduced over its samples: ``"mean"`` or ``"sum"``.
        """
        plan = self.current()
        return share_weight(len(plan.indices), plan.size, self.world_size, reduction)

    # -- the state -----------------------------------------------------------------------------------------
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self._generation += 1  # iterators begun before a restore must not go on from the old cursor

    def advance(self, plan: StepPlan | None = None) -> None:
        """Commit one step: move the cursor past the current step (or ``plan``)."""
        super().advance(plan if plan is not None else self.current())
        self.step += 1

    # -- iteration ----------------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Steps left in the current epoch from the committed cursor."""
        return -(-(self.dataset_len - self.cursor) // self.global_batch)

    def __iter__(self) -> Iterator[list[int]]:
        for perm, cursor, indices in self._shares():
            if not indices and self.pad_empty:
                indices = [int(perm[cursor])]
            yield indices

    def _shares(self) -> Iterator[tuple[torch.Tensor, int, list[int]]]:
        """Each step left in the epoch as (the epoch's permutation, the step's cursor, this rank's share of
        it), audited as it is yielded; refuses to go on once the state was restored under it."""
        world, rank = self.world_size, self.rank
        generation, epoch, cursor, step = self._generation, self.epoch, self.cursor, self.step
        audit = self._audit_writer(world, rank)
        perm = epoch_permutation(self.seed, epoch, self.dataset_len)
        while cursor < self.dataset_len:
            if generation != self._generation:
                from elastic_train.train.errors import TrainingError

                raise TrainingError(
                    "the sampler was restored while a DataLoader iterator over it was running: "
                    "restore the state before iterating the DataLoader"
                )
            size = min(self.global_batch, self.dataset_len - cursor)
            step += 1
            lo, hi = _bounds(size, world, rank, self.weights_at(step))
            indices = perm[cursor + lo : cursor + hi].tolist()
            self._drawn = step
            if audit is not None and step > self._audited:
                # A step yielded (prefetched) but not trained when the loop left the DataLoader is yielded
                # again by the next iterator: in the same group, with the same share; one line is enough.
                audit.write(epoch=epoch, step=step, indices=indices)
                self._audited = step
            yield perm, cursor, indices
            cursor += size

    def _audit_writer(self, world: int, rank: int) -> Any:
        if self.audit_dir is None:
            return None
        if self._audit is None or (self._audit.world_size, self._audit.rank) != (world, rank):
            from elastic_train.train.audit import AuditWriter, write_meta

            if self._audit is not None:
                self._audit.close()
            self._audited = 0
            rnd = self._round if self._round is not None else _round()
            self._audit = AuditWriter(self.audit_dir, rank=rank, world_size=world, round=rnd)
            if rank == 0:
                write_meta(
                    self.audit_dir,
                    dataset_len=self.dataset_len,
                    global_batch=self.global_batch,
                    seed=self.seed,
                )
        return self._audit

    def close(self) -> None:
        """Close the audit file (if any)."""
        if self._audit is not None:
            self._audit.close()
            self._audit = None


def _default_world() -> tuple[int, int]:
    """(world size, rank) of the default process group; (1, 0) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _round() -> int:
    """This worker group's rendezvous round (audit lines of a redone step must sort after the first try)."""
    return worker_env().round


def rebuild(loader: DataLoader[Any], batch_sampler: Iterable[list[int]]) -> DataLoader[Any]:
    """``loader`` (a script's or a framework's own ``DataLoader``: its collator, workers, pinning ...) drawing
    its batches from ``batch_sampler``, every other setting kept."""
    workers = loader.num_workers
    extra: dict[str, Any] = {"in_order": loader.in_order} if hasattr(loader, "in_order") else {}
    return DataLoader(
        loader.dataset,
        batch_sampler=batch_sampler,
        num_workers=workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor if workers > 0 else None,
        persistent_workers=loader.persistent_workers if workers > 0 else False,
        pin_memory_device=loader.pin_memory_device,
        **extra,
    )
