"""Restore, per-step commit and finalize of a :class:`~elastic_train.train.state.TrainState` through the
checkpoint manager's two tiers, with the progress events ``elastic-train local`` follows."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from elastic_train.checkpoint.config import CheckpointConfig
from elastic_train.log import get_logger
from elastic_train.train import hot
from elastic_train.train.balance import SpeedShares
from elastic_train.train.busy import StepClock
from elastic_train.train.errors import NotStateful, TrainingError
from elastic_train.train.events import EventWriter
from elastic_train.train.group import World, current_world
from elastic_train.train.link import GroupChanged, ProcessLink, process_link
from elastic_train.train.sampler import ElasticBatchSampler
from elastic_train.train.state import TrainState

if TYPE_CHECKING:
    from elastic_train.checkpoint.writer import Committed
    from elastic_train.node.gate import Link

log = get_logger(__name__)

StepHook = Callable[[int], None]
"""Called with the step number at :meth:`Checkpointer.commit`, before the state is saved."""


class Manager(Protocol):
    """What :class:`Checkpointer` and the built-in loop need from
    :class:`elastic_train.checkpoint.CheckpointManager`."""

    @property
    def last_committed(self) -> Committed | None:
        """The newest durable checkpoint committed so far (None before the first)."""
        ...

    def restore(self, model: Mapping[str, Any] | None = None) -> Any:
        """Collective: the newest valid state anywhere (``.step``, ``.state``, ``.source``) or ``None``."""
        ...

    def save(self, step: int, state: Callable[[], Any]) -> None:
        """Snapshot and/or checkpoint ``state()`` when due at ``step`` (it is built only then).

        ``state`` returns the state's mapping, or, for a manager whose ``planned_snapshots`` is True, the
        state already flattened (:meth:`TrainState.snapshot`).
        """
        ...

    def finalize(self, step: int, state: Mapping[str, Any]) -> Any: ...

    def close(self) -> None: ...


@runtime_checkable
class Planned(Protocol):
    """A manager that takes a state flattened once and reused (``TrainState.snapshot``) and restores into
    the live tensors (``into=``, ``live=``), when its ``planned_snapshots`` says so."""

    planned_snapshots: bool


@runtime_checkable
class LeavesAtBoundary(Protocol):
    """A manager that can keep the step's memory snapshot when the group re-forms after it."""

    def save_before_leaving(self, step: int, state: Callable[[], Any]) -> bool:
        """Take the step's snapshot without a collective; whether one was taken."""
        ...


@runtime_checkable
class Fenced(Protocol):
    """A manager whose snapshots may copy an optimizer's parameters and state until its next step."""

    def attach(self, optimizer: torch.optim.Optimizer) -> Any:
        """Let snapshots copy ``optimizer``'s tensors while its next step computes (a pre-hook fences)."""
        ...

    def fence(self) -> None:
        """Wait until the last snapshot no longer reads the parameters and optimizer state."""
        ...


@runtime_checkable
class WaitsForPeers(Protocol):
    """A manager whose snapshots can make the training thread wait for its peers."""

    def take_peer_wait(self) -> float:
        """Seconds the training thread waited for the peers since the last call."""
        ...


@runtime_checkable
class Exchanges(Protocol):
    """A manager whose snapshots talk to peers off the training thread (the sharded replica exchange)."""

    def abort(self) -> None:
        """Close after the group broke: that talk, which may wait on the failed peer, is cut short."""
        ...


def close_after(manager: Manager, exc: BaseException) -> None:
    """Close ``manager`` on the way out of a training function that raised ``exc``.

    When ``exc`` broke a group this process re-forms in-process, the agent is asked for the next round
    first (:func:`~elastic_train.train.hot.request_next_round`): it joins while this closes. A peer
    exchange in flight on the manager's own connections (a sharded replica's, on the copier thread) may
    wait on a failed peer, which never answers when it stopped instead of dying: it is cut short (the
    manager's ``abort``) unless the group left whole at a step boundary (an announced change, whose
    exchanges complete).
    """
    hot.request_next_round(exc)
    _close(manager, broken=not isinstance(exc, GroupChanged))


def _close(manager: Manager, *, broken: bool) -> None:
    if broken and isinstance(manager, Exchanges):
        manager.abort()
    else:
        manager.close()


def _manager(cfg: CheckpointConfig, run_id: str, state: TrainState, world: World, link: Link) -> Manager:
    """The checkpoint manager of ``state``: the sharded one when the model's parameters are DTensors
    (FSDP2's ``fully_shard``), the replicated one otherwise."""
    group = dist.group.WORLD if world.world_size > 1 else None
    from elastic_train.checkpoint.sharded.local import is_sharded

    if is_sharded(state.model):
        from elastic_train.checkpoint.sharded.manager import ShardedCheckpointManager

        return ShardedCheckpointManager(
            cfg, run_id, rank=world.rank, world_size=world.world_size, local_rank=world.local_rank,
            local_world_size=world.local_world_size, round=world.round, model=state.model,
            optimizer=state.optimizer, current_state=state.state_dict, group=group, link=link,
        )  # fmt: skip
    from elastic_train.checkpoint import CheckpointManager

    return CheckpointManager(
        cfg, run_id, rank=world.rank, world_size=world.world_size, local_rank=world.local_rank, group=group,
        device=world.device, link=link,
    )  # fmt: skip


class Checkpointer:
    """Restore, per-step commit and finalize of a :class:`TrainState` through both state tiers.

    Every :meth:`commit` copies the state into this rank's shared-memory snapshot; every ``every_steps``
    steps a durable checkpoint is written in the background to ``url/run_id`` (any fsspec URL), in the format
    of the built-in loop. :meth:`restore` is collective and loads the newest valid state held anywhere: a
    surviving rank's memory snapshot (broadcast from it), else the newest durable checkpoint, else
    ``resume_from``. Rank 0 appends progress events to ``$ELASTIC_TRAIN_EVENTS`` (what ``elastic-train
    local`` follows).

    Args:
        state: what to checkpoint.
        url: checkpoint root (default: ``config.url``, itself ``checkpoints`` by default).
        every_steps: durable checkpoint every N steps (0: only the final one; default ``config.every_steps``).
        resume_from: a checkpoint (run root or ``step-N`` directory) to start from when the run has none.
        config: every other checkpoint setting (``keep_last``, ``memory_dir``, ``storage_options`` …).
        run_id: checkpoints go to ``url/run_id`` (default: torchrun's ``--rdzv-id``).
        world: the group the state is trained in (default: :func:`current_world`).
        manager: an existing checkpoint manager to use instead of creating one (the built-in worker's).
        events: progress events (default: rank 0 writes to ``$ELASTIC_TRAIN_EVENTS``).
        hooks: called with the step number at each commit before the save (progress probes, fault
            injection in tests).
        link: this process's end of the node contract (default: :func:`~elastic_train.train.link.
            process_link`): the step beat and the announced membership changes at each commit.
        clock: the step clock a DDP timing hook registered before this Checkpointer reports to
            (:func:`~elastic_train.train.busy.time_collectives`; default: a new one, :attr:`clock`).

    Raises:
        StorageError: the URL's filesystem cannot be opened.
        ValueError: a setting is out of range.
    """

    def __init__(
        self,
        state: TrainState,
        url: str | None = None,
        *,
        every_steps: int | None = None,
        resume_from: str | None = None,
        config: CheckpointConfig | None = None,
        run_id: str | None = None,
        world: World | None = None,
        manager: Manager | None = None,
        events: EventWriter | None = None,
        hooks: Sequence[StepHook] = (),
        link: ProcessLink | None = None,
        clock: StepClock | None = None,
    ) -> None:
        if not isinstance(state, TrainState):
            raise NotStateful(f"state: a {type(state).__name__} is not an elastic_train TrainState")
        self.state = state
        self.link = link or process_link()
        self._unverified_snapshot = partial(state.snapshot, verify=False)
        self.world = world or current_world()
        state.meta = {"world_size": self.world.world_size, "round": self.world.round}
        self._own_events = events is None
        self.events = events or EventWriter.from_env(
            rank=self.world.rank, round=self.world.round, world_size=self.world.world_size
        )
        if manager is None:
            cfg = config or CheckpointConfig()
            changes: dict[str, Any] = {"url": url, "every_steps": every_steps, "resume_from": resume_from}
            cfg = dataclasses.replace(cfg, **{k: v for k, v in changes.items() if v is not None})
            manager = _manager(
                cfg, run_id or self.world.run_id, state, self.world, self.link.checkpoint_link()
            )
        elif url is not None or every_steps is not None or resume_from is not None or config is not None:
            raise ValueError("Checkpointer: give either a manager or checkpoint settings, not both")
        self.manager: Manager = manager
        self._planned = isinstance(manager, Planned) and manager.planned_snapshots is True
        #: The manager's waits for its peers in snapshots, left out of the busy time (checked once here).
        self._peer_wait = manager.take_peer_wait if isinstance(manager, WaitsForPeers) else None
        self.hooks = list(hooks)
        #: Times each step's wait for the gradient all-reduce (reported by the DDP hook of
        #: :func:`elastic_train.train.busy.time_collectives`): slow-node detection compares busy times.
        self.clock = clock or StepClock()
        #: Speed-weighted shares of this group (an ``ElasticBatchSampler(shares="speed")``), else None.
        self.shares = self._speed_shares(state)
        self._share_commits = self._share_carried = 0  # commits of this group, and those that carried
        #: Where the restored state came from (``memory``, ``durable``, ``resume_from``), None when fresh.
        self.source: str | None = None
        self._restored = False
        self._reported: Any = None
        self._last_commit = time.perf_counter()
        # With a manager that can copy the optimizer's tensors while the next step computes (its step
        # pre-hook fences the copy), let it: the snapshot then costs the loop less.
        if isinstance(manager, Fenced) and isinstance(state.optimizer, torch.optim.Optimizer):
            manager.attach(state.optimizer)

    def _speed_shares(self, state: TrainState) -> SpeedShares | None:
        """The group's speed-weighted shares, riding on the step clock; even shares for a new group."""
        sampler = state.sampler
        if not isinstance(sampler, ElasticBatchSampler):
            return None
        sampler.reset_weights()
        if sampler.shares != "speed" or self.world.world_size < 2:
            return None
        shares = SpeedShares(sampler, rank=self.world.rank, world_size=self.world.world_size)
        self.clock.rider = shares
        return shares

    @property
    def step(self) -> int:
        """Optimizer steps committed so far (restored ones included)."""
        return self.state.step

    # -- restore -------------------------------------------------------------------------------------------
    def restore(self) -> int:
        """Collective: load the newest valid state anywhere into the state's objects; returns its step.

        Call it on every rank before the DataLoader is iterated, and before the first :meth:`commit`.
        Returns 0 (and leaves everything as it is) when there is no state anywhere.

        Raises:
            ModelMismatch: the newest checkpoint is of another model (names, shapes or dtypes differ).
            StateMismatch: it does not fit the optimizer, the dataset or an extra object.
            CheckpointError: storage failure or an unreadable ``resume_from``.
        """
        model = self.state.model.state_dict()
        if self._planned:
            # Restored bytes land in the parameters and optimizer buffers themselves where they fit: no
            # snapshot copy may still be reading them.
            if isinstance(self.manager, Fenced):
                self.manager.fence()
            restored = self.manager.restore(  # type: ignore[call-arg]
                model=model, into=self.state.restore_targets, live=self.link.live.get(self.state)
            )
        else:
            restored = self.manager.restore(model=model)
        # a process that re-formed its group in-process may hold the gradients of a step that failed
        self.state.model.zero_grad(set_to_none=True)
        self._restored = True
        self._last_commit = time.perf_counter()
        if restored is None:
            log.info("training_started", step=0)
            self.events.emit("started", 0)
            return 0
        self.load(restored.state)
        self.link.live.set(self.state, self.step)
        self.source = restored.source
        sampler = self.state.sampler
        epoch = sampler.epoch if sampler is not None else None
        log.info("training_resumed", step=self.step, source=restored.source, epoch=epoch)
        self.events.emit("resumed", self.step, source=restored.source, from_step=self.step)
        return self.step

    def load(self, state: Mapping[str, Any]) -> None:
        """Put a state (e.g. one read by hand) into the objects, as :meth:`restore` does with what it finds.

        Raises:
            StateMismatch: the state does not fit the objects.
        """
        # no snapshot copy may be reading what load_state_dict overwrites
        if isinstance(self.manager, Fenced):
            self.manager.fence()
        self.link.live.clear()
        self.state.load_state_dict(state)
        self._restored = True

    def skip_restore(self) -> None:
        """Train from the objects as they are, without looking for a saved state (a later restore still may).

        Only for a state known to be right (e.g. loaded by hand): committing on top of an older state
        than one already saved for this run makes that run's newest snapshot go back in time.
        """
        self._restored = True

    # -- commit --------------------------------------------------------------------------------------------
    def commit(self, loss: float | torch.Tensor | None = None) -> int:
        """After each optimizer step, on every rank: count the step, move the data cursor, save the state.

        The state is copied into shared memory (every ``memory_every_steps``) and handed to the background
        writer when a durable checkpoint is due; this returns without waiting for storage.

        Args:
            loss: this rank's loss of the step, for the progress events (read only when events are on).

        Returns:
            The step number just committed.

        Raises:
            TrainingError: :meth:`restore` was not called first.
            WriteFailed: an earlier background write failed (after its retries).
        """
        samples = self.advance()
        self.save(loss=loss, samples=samples)
        return self.step

    def advance(self) -> int:
        """The first half of :meth:`commit`: count the step and move the sampler past it; returns its size."""
        if not self._restored:
            raise TrainingError("call restore() before the first commit(): it decides where training starts")
        sampler = self.state.sampler
        size = 0
        if sampler is not None:
            plan = (
                sampler.current()
                if isinstance(sampler, ElasticBatchSampler)
                else sampler.plan(self.world.world_size, self.world.rank)
            )
            sampler.advance(plan)
            size = plan.size
        self.state.step += 1
        return size

    def save(
        self, *, loss: float | torch.Tensor | None = None, samples: int = 0, epoch: int | None = None
    ) -> None:
        """The second half of :meth:`commit`: save the state of the step just counted and report it."""
        step = self.step
        busy = self.clock.lap()
        for hook in self.hooks:
            hook(step)
        # A manager that takes a flattened state gets the planned one (no state dicts built per step).
        planned = self._planned
        # Such a manager checks the snapshot's full structure before it publishes the copy (the memory tier
        # on its copier thread): the training thread checks only what costs no tensor access.
        snapshot = self._unverified_snapshot if planned else self.state.state_dict
        try:
            self.link.boundary(step)  # the step beat; a membership change announced: leave here
        except GroupChanged:
            self._leave(step, snapshot)
            raise
        if self.shares is not None:
            self._share(step, samples)
        started = time.perf_counter()
        self.manager.save(step, snapshot)
        saved_s = time.perf_counter() - started
        if self._peer_wait is not None:  # counted in the next step's lap
            self.clock.blocked(self._peer_wait())
        self.link.live.set(self.state, step)
        self.link.mark_trained()  # once per round: a failure from now on is not one at start-up
        committed = self._report_commit()
        if self.link.stats is not None:  # the agent's metrics (none outside an agent)
            durable = (committed.step, committed.seconds, committed.bytes) if committed is not None else None
            self.link.committed(step, saved_s, durable, busy)
        if self.events.enabled:
            now = time.perf_counter()
            rate = samples / max(now - self._last_commit, 1e-9)
            self._last_commit = now
            value = float(loss.detach().item()) if isinstance(loss, torch.Tensor) else loss
            if epoch is None and self.state.sampler is not None:
                sampler = self.state.sampler
                epoch = sampler.epoch if sampler.cursor else sampler.epoch - 1  # the step's own epoch
            self.events.emit("step", step, loss=value, samples_per_s=rate, epoch=epoch)

    def _share(self, step: int, samples: int) -> None:
        """Speed-weighted shares: the ranks' busy times carried by this step decide the next shares."""
        assert self.shares is not None
        carried = self.clock.take_carried()
        self._share_commits += 1
        self._share_carried += carried is not None
        if self._share_commits == 3 and not self._share_carried and self.world.rank == 0:
            log.warning(
                "shares_even",
                reason="no gradient collective carried the ranks' busy times: call "
                "elastic_train.time_collectives(model, ckpt.clock) on the DDP (or FSDP2-sharded) model",
            )
        change = self.shares.decide(step, samples, carried)
        if change is None:
            return
        fields = change.fields()
        if self.world.rank == 0:
            log.info("shares_changed", step=step, **fields)
        self.events.emit("shares", step, **fields)

    def _leave(self, step: int, snapshot: Callable[[], Any]) -> None:
        """The group re-forms after this step: keep its snapshot (memory tier only), so that the members
        start the next group from it instead of redoing it, and nothing is sent to those that hold it."""
        if not isinstance(self.manager, LeavesAtBoundary):
            return
        try:
            if self.manager.save_before_leaving(step, snapshot):
                self.link.live.set(self.state, step)
        except Exception as exc:  # the step is then redone from the previous snapshot, as without this
            log.warning("snapshot_before_leaving_failed", step=step, error=str(exc))

    def _report_commit(self) -> Committed | None:
        """Emit a ``checkpoint`` event for a durable checkpoint committed since the last call; returns the
        newest committed."""
        committed = self.manager.last_committed
        if committed is not None and committed is not self._reported:
            self._reported = committed
            self.events.emit("checkpoint", committed.step, seconds=committed.seconds, bytes=committed.bytes)
        return committed

    # -- the end -------------------------------------------------------------------------------------------
    def finalize(self) -> Committed | None:
        """Collective, at the end of training: write the final durable checkpoint, wait for it, release the
        shared-memory snapshot; returns the committed checkpoint on rank 0 (None elsewhere).

        Raises:
            WriteFailed: the final checkpoint could not be written (after retries).
        """
        committed: Committed | None = self.manager.finalize(self.step, self.state.state_dict())
        final = self._report_commit()
        if self.link.stats is not None and final is not None:  # the final checkpoint, for the metrics
            self.link.stats.count_durable(final.step, final.seconds, final.bytes)
        self.events.emit("done", self.step)
        self.link.mark_finished(self.step, self.world.local_world_size)
        log.info("training_done", step=self.step)
        self._release()
        return committed

    def close(self, *, broken: bool = False) -> None:
        """Stop without a final checkpoint (error paths); the memory snapshot stays for a restarted group.

        ``broken``: the group failed. A peer exchange in flight on the manager's own connections (a sharded
        replica's, on the copier thread) may wait on the failed peer, which never answers when it stopped
        instead of dying, and closing would wait for it: it is cut short (the manager's ``abort``), so that
        this process asks for the next round without waiting out the close's timeout.
        """
        _close(self.manager, broken=broken)
        self._release()

    def close_after(self, exc: BaseException) -> None:
        """:meth:`close` on the way out of a training function that raised ``exc`` (:func:`close_after`)."""
        close_after(self.manager, exc)
        self._release()

    def _release(self) -> None:
        if self.link.stats is not None:
            self.link.stats.flush()
        if isinstance(self.state.sampler, ElasticBatchSampler):
            self.state.sampler.close()
        if self._own_events:
            self.events.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc is not None:
            self.close_after(exc)
