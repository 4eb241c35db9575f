"""CheckpointManager: the one object the training loop talks to.

``save`` after each optimizer step snapshots the state into the shared-memory tier (:mod:`.memory`) and,
when a durable checkpoint is due, hands it to the background writer (:mod:`.writer`). With an optimizer
:meth:`~CheckpointManager.attach`-ed, the copy of the parameters and optimizer state into shared memory runs
while the next step's forward and backward do, and its step pre-hook waits for it before the optimizer
changes them. ``restore`` is collective and returns the newest valid state held anywhere (:mod:`.restore`);
``finalize`` commits a last checkpoint; ``close`` stops on error paths. The agent's heartbeat and publish
gate are :mod:`.agent`'s.

Concurrency: the writer uses its own gloo process group and the loop-side collectives another
(:mod:`.groups`). At most one durable write is in flight; a save that is due while the previous write still
runs waits for it (every rank does the same, so ranks stay in step — skipping would need a collective vote).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from elastic_train.checkpoint import durable
from elastic_train.checkpoint.agent import Agent
from elastic_train.checkpoint.attach import Attachments
from elastic_train.checkpoint.codec import Flat, flatten
from elastic_train.checkpoint.config import CheckpointConfig
from elastic_train.checkpoint.errors import CheckpointError
from elastic_train.checkpoint.groups import Groups
from elastic_train.checkpoint.memory import MemorySnapshot
from elastic_train.checkpoint.plan import Planned
from elastic_train.checkpoint.policy import durable_due
from elastic_train.checkpoint.restore import Origin, Restored, Restorer
from elastic_train.checkpoint.shmfiles import release_siblings, sweep_stale
from elastic_train.checkpoint.specs import TensorSpec
from elastic_train.checkpoint.storage import Storage, open_storage
from elastic_train.checkpoint.writer import Committed, DurableWriter
from elastic_train.log import get_logger
from elastic_train.node.gate import Link

log = get_logger(__name__)

#: A state as :meth:`CheckpointManager.save` takes it: the state, or a function returning it (or a
#: :class:`Flat` of it).
StateArg = Mapping[str, Any] | Callable[[], Mapping[str, Any] | Flat]


class CheckpointManager:
    """Both checkpoint tiers of one worker.

    Args:
        cfg: the ``checkpoint:`` section of the job.
        run_id: run id; durable checkpoints go to ``cfg.url/run_id``.
        rank: global rank of this worker.
        world_size: number of workers.
        local_rank: rank on this node (names the shared-memory snapshot).
        group: process group of all workers (None: no coordination; rank 0 writes everything).
        device: the training device (restored tensors are returned on the CPU either way).
        link: the worker's link to its agent (default: from the environment): durable checkpoints go to
            round-stamped directories and are published only after the agent confirms the round is still
            current (docs/checkpoints.md, "Stale writers").

    Raises:
        StorageError: the URL's filesystem cannot be opened (e.g. ``s3://`` without ``elastic-train[s3]``).
    """

    #: :meth:`save` takes a function returning a :class:`Flat` (``TrainState.snapshot``, a planned state,
    #: also one taken with ``verify=False``: its structure check runs before anything copied is published)
    #: and :meth:`restore` the live tensors to restore into (``into=``) and the step they hold (``live=``).
    planned_snapshots = True

    def __init__(
        self,
        cfg: CheckpointConfig,
        run_id: str,
        *,
        rank: int,
        world_size: int,
        local_rank: int,
        group: Any = None,
        device: torch.device | None = None,
        link: Link | None = None,
    ) -> None:
        self.cfg = cfg
        self.agent = Agent(link)
        self.run_id = run_id
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.device = device or torch.device("cpu")
        storage = open_storage(cfg.url, cfg.storage_options, direct_io=cfg.direct_io)
        self.run_path = storage.join(storage.root, run_id)
        self._groups = Groups(group, rank=rank, world_size=world_size)
        self.memory: MemorySnapshot | None = None
        if cfg.memory:
            if os.path.isdir(cfg.memory_dir):
                for path in sweep_stale(cfg.memory_dir):
                    log.info("memory_snapshot_swept", path=path)
                self.memory = MemorySnapshot(cfg.memory_dir, run_id, local_rank, self.run_path)
                self.memory.progress = self.agent.beat
            else:
                log.warning("memory_tier_disabled", reason=f"{cfg.memory_dir} does not exist")
        self._origin = Origin(stamp=self.agent.round)
        groups, memory, agent, origin = self._groups, self.memory, self.agent, self._origin
        self._writer = DurableWriter(
            cfg, storage, self.run_path, run_id, groups=groups, memory=memory, agent=agent, origin=origin
        )
        self._restorer = Restorer(
            cfg,
            storage,
            self.run_path,
            groups=groups,
            memory=memory,
            agent=agent,
            origin=origin,
            local_rank=local_rank,
        )
        self._closed = False
        self._attached = Attachments(self.fence, self._idle)

    @property
    def coordinated(self) -> bool:
        return self._groups.coordinated

    @property
    def storage(self) -> Storage:
        """The checkpoint root's storage (the writer's and the restore's)."""
        return self._writer.storage

    @storage.setter
    def storage(self, storage: Storage) -> None:
        self._writer.storage = self._restorer.storage = storage

    @property
    def base(self) -> int:
        """The step this world started from (what :meth:`restore` found; 0 when fresh)."""
        return self._origin.base

    @property
    def stamp(self) -> int | None:
        """The round this world's checkpoints carry (its rendezvous round, or above the run's earlier ones);
        set by :meth:`restore`, None outside a rendezvous round."""
        return self._origin.stamp

    @property
    def last_committed(self) -> Committed | None:
        """The newest durable checkpoint committed (rank 0)."""
        return self._writer.last_committed

    # -- restore -----------------------------------------------------------------------------------------
    def restore(
        self,
        model: Mapping[str, Any] | None = None,
        *,
        into: Callable[[Sequence[TensorSpec]], Sequence[torch.Tensor | None]] | None = None,
        live: int | None = None,
    ) -> Restored | None:
        """Collective: find the newest valid state (memory on any rank, durable, then ``cfg.resume_from``).

        A rank that holds the chosen step in its shared-memory snapshot lands its own; the holder sends it
        to the ranks without it. A slot's data is verified as it is read — each chunk hashed right before
        it is sent or landed — and the ranks agree on the verdict afterwards: when a slot turns out torn,
        its rank marks it so and every rank looks again (the next-newest snapshot, or a durable one), so no
        rank ever keeps bytes that failed their checksum and all end on the same step.

        Args:
            model: the current model's ``state_dict()``; when given, a checkpoint of a different model raises
                :class:`ModelMismatch` (on every rank) instead of failing later in ``load_state_dict``.
            into: given the restored state's tensor specs, the live tensors the state will be loaded into
                (None where there is none), e.g. :meth:`elastic_train.TrainState.restore_targets`. A tensor
                of the spec's dtype and shape (contiguous, on the CPU, not requiring grad) receives the
                restored bytes directly and is the one the returned state holds; it is overwritten as the
                bytes arrive, so after an error (or a torn slot found on the way) it may hold other bytes
                until the restore returns.
            live: the step whose snapshot this process took from the ``into`` tensors, when they have not
                changed since (a worker that re-forms its group in-process). When that step is the one
                restored from this rank's own snapshot, those tensors are hashed where they are instead of
                read from the slot (and sent from there): the slot's checksum then also proves they hold its
                bytes. When they turn out not to, the restore reads the slot after all.

        Returns:
            The state, the same on every rank, or None when there is none anywhere.

        Raises:
            CheckpointError: storage failure, an unreadable ``resume_from`` or a model mismatch.
        """
        # The restored bytes stream over both groups of the manager (transfer.lane): its writer must be idle.
        self.wait()
        restored = self._restorer.restore(model, into, live)
        if restored is not None:
            self._writer.submitted_at = time.monotonic()
            if restored.source == "durable":
                self._writer.ok_step = restored.step
        return restored

    # -- save --------------------------------------------------------------------------------------------
    def save(self, step: int, state: StateArg) -> None:
        """Call after every optimizer step (on every rank): memory tier and, when due, a durable checkpoint.

        ``state`` may be a function returning it: it is then called only when a snapshot or a checkpoint
        is due at this step. The function may return the state already flattened (a :class:`Flat`, e.g.
        :meth:`elastic_train.TrainState.snapshot`, planned once and reused while its structure holds).

        Raises:
            WriteFailed: a previous durable write failed (``on_error`` retry after its retries, or fatal).
            CheckpointError: the state holds something that cannot be checkpointed.
        """
        self._check_open()
        self._raise_pending()
        mem_due = self.memory is not None and step % self.cfg.memory_every_steps == 0
        dur_due = self._durable_due(step)
        if mem_due or dur_due:
            self._save(step, state, dur_due)

    def save_before_leaving(self, step: int, state: StateArg) -> bool:
        """This rank leaves its group after ``step`` (the group re-forms in-process): take the step's memory
        snapshot, as :meth:`save` would, without a collective (the others may have left already); whether
        one was taken.

        None is taken when a durable checkpoint may be due at this step: the step is then redone in the
        next group, which writes it (a durable write is collective and would wait for ranks that left).
        """
        self._check_open()
        if self.memory is None or step % self.cfg.memory_every_steps != 0:
            return False
        if self._due_here(step):
            return False
        self._save(step, state, False)
        return True

    def _save(self, step: int, state: StateArg, dur_due: bool) -> None:
        timed = self.memory is not None and self.memory.stats.record
        started, cpu = (time.perf_counter(), time.thread_time()) if timed else (0.0, 0.0)
        if self.memory is not None:
            # The previous snapshot's structure check (on the copier) has answered: a failed one makes this
            # snapshot a new plan instead of another copy of a stale one.
            self.memory.wait_idle()
        got = state() if callable(state) else state
        flat = got if isinstance(got, Flat) else flatten(got)
        if dur_due and isinstance(flat, Planned) and flat.verify is not None and not flat.verify():
            # A durable write reads what was copied: its structure is checked here (the check marked the
            # stale part: this snapshot is planned anew and fully checked).
            flat = self._replanned(state)
        slot = None
        if self.memory is not None:
            # Which tensors the copier may copy later is decided once per plan (a planned snapshot hands over
            # the same specs while its tensors are the same); a small state is copied whole in save anyway.
            slot = self.memory.save(step, flat, defer=self._attached.deferrable(flat))
            if timed:
                self.memory.stats.add_save(time.perf_counter() - started, time.thread_time() - cpu)
            if dur_due:  # the writer reads the slot: its copy must be complete
                self.memory.wait_idle()
                self.memory.raise_error()
                if self.memory.rejected_step == step:
                    raise CheckpointError(
                        f"step {step}: the state's structure changed while it was being saved (another "
                        "thread changed the model or optimizer during the save)"
                    )
        if dur_due:
            self._submit(step, flat, slot)

    @staticmethod
    def _replanned(state: StateArg) -> Flat:
        """The state taken again after a planned snapshot failed its structure check, fully checked."""
        got = state() if callable(state) else state
        flat = got if isinstance(got, Flat) else flatten(got)
        if isinstance(flat, Planned) and flat.verify is not None and not flat.verify():
            raise CheckpointError("the state's structure changes while it is being saved")
        return flat

    # -- the snapshot fence ------------------------------------------------------------------------------
    def attach(self, optimizer: torch.optim.Optimizer) -> Any:
        """Let snapshots copy ``optimizer``'s parameters and state while the next step computes.

        Registers an optimizer step pre-hook that waits for the snapshot's copy (:meth:`fence`) before the
        optimizer changes what is being copied; the forward and backward passes in between read the
        parameters only. Works with any training loop that steps ``optimizer`` (``GradScaler.step``
        included). A loop that changes parameters in place outside ``optimizer.step()`` (weight clipping,
        EMA swaps, ``load_state_dict``) calls :meth:`fence` first.

        Returns:
            A handle whose ``remove()`` detaches the optimizer again (later snapshots then copy everything
            before :meth:`save` returns).
        """
        return self._attached.add(optimizer)

    def _idle(self) -> None:
        if self.memory is not None:
            self.memory.wait_idle()

    def fence(self) -> None:
        """Wait until the last snapshot no longer reads the parameters and optimizer state.

        Raises:
            CheckpointError: the background copy into shared memory failed.
        """
        if self.memory is not None:
            self.memory.fence()

    # -- the durable cadence -----------------------------------------------------------------------------
    def _due_here(self, step: int) -> bool:
        """Whether a durable checkpoint is due after ``step`` by this rank's own count and clock."""
        since = time.monotonic() - self._writer.submitted_at
        return durable_due(
            step, every_steps=self.cfg.every_steps, every_seconds=self.cfg.every_seconds, since_last=since
        )

    def _durable_due(self, step: int) -> bool:
        due = self._due_here(step)
        if self.cfg.every_seconds and self.coordinated:
            due = self._groups.any_rank(due)
        return due and step != self._writer.submitted_step

    def _submit(self, step: int, flat: Flat, slot: int | None, *, final: bool = False) -> None:
        self.wait()
        self._raise_pending()
        self._writer.submit(step, flat, slot, final=final)
        if not self.cfg.async_write:
            self._raise_pending()

    # -- waiting and ending ------------------------------------------------------------------------------
    def wait(self) -> None:
        """Block until no durable write is in flight (does not raise its failure; see save/finalize).

        While it waits the worker still counts as making progress for its agent: it waits for its own
        writer (held up, say, by the publish gate during an etcd outage), not for peers that left.
        """
        self._writer.wait()

    def _raise_pending(self) -> None:
        if self._writer.failure is not None:
            self._writer.raise_failure()
        if self.memory is not None:
            self.memory.raise_error()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("checkpoint manager is closed")

    def finalize(self, step: int, state: Mapping[str, Any]) -> Committed | None:
        """Commit a final durable checkpoint (collective), wait for it, release shared memory.

        The shared-memory snapshot is released only once the final checkpoint is committed: when it could not
        be written, the snapshot stays the newest copy of the state, and a restarted worker restores from it
        and writes the final checkpoint again.

        Returns:
            The final checkpoint as committed by this rank's view (None on ranks other than 0).

        Raises:
            WriteFailed: the final (or an earlier) durable write failed and ``on_error`` is not ``log``.
        """
        self._check_open()
        committed = False
        try:
            if self.memory is not None:
                self.memory.wait_idle()
            self.wait()  # a regular checkpoint of this very step, still in flight, is the final one
            self._raise_pending()
            if step != self._writer.ok_step:  # also when the regular checkpoint of this step failed
                self._submit(step, flatten(state), None, final=True)
            self.wait()
            self._raise_pending()
            if self.rank == 0 and self.storage.recycles:  # no later save reuses retired files
                durable.trim_pool(self.storage, durable.pool_path(self.storage, self.run_path), 0)
            committed = True
        finally:
            self._shutdown(release_memory=committed)
        return self.last_committed if self.rank == 0 else None

    def close(self, *, release_memory: bool = False, timeout: float = 10.0) -> None:
        """Stop the background writer without a new checkpoint (error paths); idempotent.

        The shared-memory snapshot is kept by default: a restarted worker group resumes from it (that is
        its purpose); the file is scoped to the owner (torchrun agent) and swept when that is gone.

        Args:
            release_memory: also delete the shared-memory snapshot (the job is over for good).
            timeout: seconds to wait for an in-flight write (its peers may be dead).
        """
        if self._closed:
            return
        self._shutdown(release_memory=release_memory, timeout=timeout)

    def _shutdown(self, *, release_memory: bool, timeout: float | None = None) -> None:
        self._closed = True
        self._attached.remove_all()
        writer_done = self._writer.stop(timeout)
        if self.memory is not None:
            if release_memory:
                self.memory.release()
                if self.local_rank == 0:  # the owner's other local ranks of the run (the world shrank)
                    release_siblings(self.cfg.memory_dir, self.run_id, self.memory.path)
            else:
                self.memory.detach()
        if writer_done:
            self._groups.destroy()
