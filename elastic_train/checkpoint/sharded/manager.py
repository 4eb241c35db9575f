"""ShardedCheckpointManager: both state tiers of a sharded (FSDP2) training state, behind the manager seam.

The same seam as :class:`elastic_train.checkpoint.CheckpointManager` (``restore`` / ``save`` / ``finalize``
/ ``close`` / ``last_committed``), which :class:`elastic_train.train.checkpointer.Checkpointer` picks when
the model's parameters are DTensors:

- ``save`` splits the state into this rank's local shards and the shard map (:mod:`.local`) and copies them
  into its shared-memory snapshot every step (:mod:`.slots`; with ``shard_replicas: 1`` also into the memory
  of the next node); every ``every_steps`` the writer thread writes a DCP directory from the sealed slot,
  then the manifest beside it (:mod:`.manifest`), published through the same gate, lineage and retention as
  a replicated checkpoint.
- ``restore`` (collective) gathers which steps every rank holds, decides (:func:`.reshard.choose`), plans
  FSDP2's ownership for the new world size (:func:`.reshard.plan`) and moves only the rows each rank lacks,
  point to point (:mod:`.move`); rows nobody alive holds come from the durable checkpoint of that step, or
  the whole state from the newest durable one. The state comes back with DTensors on the new mesh, for
  ``TrainState.load_state_dict``.

Concurrency as in the replicated manager: the writer's collectives run on a gloo group of its own (``io``),
the restore's on another (``ctl``), and replicas travel on a third (``rep``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from elastic_train import net
from elastic_train.checkpoint import durable
from elastic_train.checkpoint.agent import Agent
from elastic_train.checkpoint.attach import Attachments
from elastic_train.checkpoint.background import OneJob
from elastic_train.checkpoint.codec import Flat, flatten
from elastic_train.checkpoint.config import CheckpointConfig
from elastic_train.checkpoint.errors import CheckpointError
from elastic_train.checkpoint.policy import durable_due
from elastic_train.checkpoint.sharded.layout import mesh_at as _mesh_at
from elastic_train.checkpoint.sharded.local import split
from elastic_train.checkpoint.sharded.restore import Restoring
from elastic_train.checkpoint.sharded.slots import INFO, ShardedMemory
from elastic_train.checkpoint.sharded.writer import DurableWriting, _Job
from elastic_train.checkpoint.storage import open_storage
from elastic_train.checkpoint.writer import Committed
from elastic_train.log import get_logger
from elastic_train.node.gate import Link

log = get_logger(__name__)


class ShardedCheckpointManager(DurableWriting, Restoring):
    """Both checkpoint tiers of one rank of a sharded (FSDP2) job.

    Args:
        cfg: the ``checkpoint:`` section of the job.
        run_id: durable checkpoints go to ``cfg.url/run_id``.
        rank: global rank.
        world_size: ranks in the group.
        local_rank: rank on this node (names the snapshot files).
        local_world_size: ranks per node (a replica goes to the rank that many ranks on: another node).
        round: the group's rendezvous round (identifies the world that saved a slot).
        model: the sharded model (its parameters' mesh; names of the optimizer's parameters in DCP keys).
        optimizer: its optimizer, or None.
        current_state: the state as built (``TrainState.state_dict``): what a checkpoint written by other
            code, which holds only model and optimizer tensors, leaves as it is.
        group: the process group of all ranks (None: a world of one).
        link: the worker's link to its agent (default: from the environment).

    Raises:
        StorageError: the URL's filesystem cannot be opened.
    """

    planned_snapshots = False

    def __init__(
        self,
        cfg: CheckpointConfig,
        run_id: str,
        *,
        rank: int,
        world_size: int,
        local_rank: int,
        local_world_size: int = 1,
        round: int = 0,
        model: torch.nn.Module,
        optimizer: Any = None,
        current_state: Callable[[], Mapping[str, Any]] | None = None,
        group: Any = None,
        link: Link | None = None,
    ) -> None:
        self.cfg, self.run_id = cfg, run_id
        self.rank, self.world_size, self.local_rank, self.round = rank, world_size, local_rank, round
        self.model, self.optimizer, self.current_state = model, optimizer, current_state
        self._mesh = _mesh_at(model, rank, world_size)
        self._cpu_mesh = None
        self.agent = Agent(link)
        self.stamp: int | None = self.agent.round
        self.base = 0
        self.storage = open_storage(cfg.url, cfg.storage_options, direct_io=cfg.direct_io)
        self.run_path = self.storage.join(self.storage.root, run_id)
        self._ctl = self._io = self._rep = None
        self._rep_links: dict[int, int] = {}
        self.replicas = cfg.shard_replicas if world_size > 1 else 0
        if group is not None and world_size > 1:
            ranks = dist.get_process_group_ranks(group)
            self._ctl = dist.new_group(ranks=ranks, backend="gloo")
            self._io = dist.new_group(ranks=ranks, backend="gloo")
            if self.replicas:
                # the replica exchange runs on the memory tier's copier thread: its connections are
                # recorded, so that a group that broke (or a cut of one blocked on a stopped peer) fails an
                # exchange waiting on the failed peer instead of leaving it blocked
                rep = net.opened_by(lambda: dist.new_group(ranks=ranks, backend="gloo"))
                self._rep, self._rep_links = rep
                net.add_extra_links(self, self._rep_links)
        step_ranks = max(1, min(local_world_size, world_size - 1)) if world_size > 1 else 0
        self.buddy = (rank + step_ranks) % world_size if world_size > 1 else rank
        self.source = (rank - step_ranks) % world_size if world_size > 1 else rank
        if self.replicas and local_world_size >= world_size:
            log.warning(
                "shard_replica_same_node",
                reason="every rank is on this node: a replica survives a worker's death, not the node's",
            )
        self.memory: ShardedMemory | None = None
        if cfg.memory:
            import os

            from elastic_train.checkpoint.shmfiles import sweep_stale

            if os.path.isdir(cfg.memory_dir):
                for path in sweep_stale(cfg.memory_dir):
                    log.info("memory_snapshot_swept", path=path)
                self.memory = ShardedMemory(cfg.memory_dir, run_id, local_rank, self.replicas, self.run_path)
                for snap in self.memory.files():
                    snap.progress = self.agent.beat
            else:
                log.warning("memory_tier_disabled", reason=f"{cfg.memory_dir} does not exist")
        self.last_committed: Committed | None = None
        #: What the last restore moved: kept, received, sent, from storage, minimum (bytes, this rank).
        self.last_moved: dict[str, Any] = {}
        self._staging: torch.Tensor | None = None
        self._last_durable_time = time.monotonic()
        self._last_durable_step: int | None = None
        self._durable_ok_step: int | None = None
        self._failure: CheckpointError | None = None
        self._jobs: OneJob[_Job] = OneJob(self._run_job, "ckpt-dcp-writer")
        self._closed = False
        self._fqns: tuple[Any, list[str]] | None = None
        self._lineage: durable.LineageWrite | None = None
        #: The next snapshot is the first after a restore (its slots are allocated anew for this world).
        self._relayout = False
        #: The snapshots (and the fence) that may wait long for a relayout in flight count as progress.
        self._slow = 0
        self._attached = Attachments(self._step_fence, self._idle, model.parameters)

    def save(self, step: int, state: Mapping[str, Any] | Callable[[], Mapping[str, Any]]) -> None:
        """After every optimizer step, on every rank: memory tier (and replica) and, when due, a durable
        checkpoint (DCP) written in the background.

        Raises:
            WriteFailed: an earlier durable write failed (after its retries).
            CheckpointError: the state cannot be kept (an unsupported sharding, say).
        """
        self._check_open()
        self._raise_pending()
        mem_due = self.memory is not None and step % self.cfg.memory_every_steps == 0
        dur_due = self._durable_due(step)
        if mem_due or dur_due:
            self._save(step, state, dur_due, exchange=True)

    def save_before_leaving(
        self, step: int, state: Mapping[str, Any] | Callable[[], Mapping[str, Any]]
    ) -> bool:
        """This rank leaves its group after ``step`` (it re-forms in-process): keep the step's own slot (no
        replica: that is collective, and the others may have left). None is taken when a durable checkpoint
        may be due: the next group redoes the step and writes it."""
        self._check_open()
        if self.memory is None or step % self.cfg.memory_every_steps != 0 or self._due_here(step):
            return False
        self._save(step, state, False, exchange=False)
        return True

    def _flat(self, state: Mapping[str, Any] | Callable[[], Mapping[str, Any]]) -> Flat:
        got = state() if callable(state) else state
        local, smap = split(got, rank=self.rank, world_size=self.world_size)
        info = {"round": self.round, "world_size": self.world_size, "rank": self.rank, "map": smap.to_json()}
        return flatten({INFO: info, "state": local})

    def _save(self, step: int, state: Any, dur_due: bool, *, exchange: bool) -> None:
        if self._relayout:
            # The first snapshot at a new world size grows its slots (seconds at 1 GB, on the copier thread
            # with an attached optimizer): it, the fence after it and the next snapshot, which waits for its
            # replica's growth at the buddy, count as progress for the agent.
            self._relayout, self._slow = False, 3
        if self._slow:
            self._slow -= 1
            with self._beating():
                self._save_now(step, state, dur_due, exchange=exchange)
        else:
            self._save_now(step, state, dur_due, exchange=exchange)

    def _save_now(self, step: int, state: Any, dur_due: bool, *, exchange: bool) -> None:
        flat = self._flat(state)
        slot = None
        if self.memory is not None:
            replica = None
            if exchange and self.replicas and self._rep is not None:
                replica = (self._global(self.buddy), self._global(self.source), self._rep)
            defer, unfenced = self._attached.split(flat)
            slot = self.memory.save(step, flat, defer=defer, unfenced=unfenced, replica=replica)
        if dur_due:
            if self.memory is not None:
                self.memory.wait_idle()  # sealed: the writer reads what the slot holds
                self.memory.raise_error()
            self._submit(step, flat, slot)

    # -- the snapshot fence -----------------------------------------------------------------------------
    def attach(self, optimizer: torch.optim.Optimizer) -> Any:
        """Let snapshots copy the local shards of the model's parameters (frozen ones too) and of
        ``optimizer``'s state on the memory tier's copier thread while the next step computes; its step
        pre-hook waits for that copy (:meth:`fence`). As :meth:`elastic_train.checkpoint.CheckpointManager.
        attach`: code that changes parameters in place outside ``optimizer.step()`` calls :meth:`fence` first.

        Returns:
            A handle whose ``remove()`` detaches the optimizer again.
        """
        return self._attached.add(optimizer)

    def fence(self) -> None:
        """Wait until the last snapshot no longer reads the parameters and optimizer state (their copy; the
        seal and the replica's exchange go on).

        Raises:
            CheckpointError: the background copy failed.
            RuntimeError: the replica's exchange failed (a peer is gone: the group is broken).
        """
        self._fence(step=False)

    def _step_fence(self) -> None:
        """The optimizer step pre-hook's fence: only the copy of what an optimizer step changes (the
        attached optimizers' parameters and state; frozen parameters may still be copied)."""
        self._fence(step=True)

    def _fence(self, *, step: bool) -> None:
        if self.memory is None:
            return
        if self._slow:
            with self._beating():
                self.memory.own.fence(step=step)
        else:
            self.memory.own.fence(step=step)
        self.memory.raise_error()

    def take_peer_wait(self) -> float:
        """Seconds the training thread waited for the peers in snapshots since the last call (the replica
        exchange: :meth:`ShardedMemory.take_peer_wait`)."""
        return self.memory.take_peer_wait() if self.memory is not None else 0.0

    def _idle(self) -> None:
        if self.memory is not None:
            self.memory.own.wait_copied()

    def _due_here(self, step: int) -> bool:
        since = time.monotonic() - self._last_durable_time
        return durable_due(
            step, every_steps=self.cfg.every_steps, every_seconds=self.cfg.every_seconds, since_last=since
        )

    def _durable_due(self, step: int) -> bool:
        due = self._due_here(step)
        if self.cfg.every_seconds and self.coordinated:
            flag = torch.tensor([int(due)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._ctl)
            due = bool(flag.item())
        return due and step != self._last_durable_step

    # -- the end --------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("checkpoint manager is closed")

    def finalize(self, step: int, state: Mapping[str, Any]) -> Committed | None:
        """The final durable checkpoint (collective, retried), then the shared memory is released; kept
        when the checkpoint could not be written (the newest copy of the state, for a restarted worker).

        Raises:
            WriteFailed: it could not be written.
        """
        self._check_open()
        committed = False
        try:
            if self.memory is not None:
                self.memory.wait_idle()
            self.wait()
            self._raise_pending()
            if step != self._durable_ok_step:
                self._submit(step, self._flat(state), None, final=True)
            self.wait()
            self._raise_pending()
            committed = True
        finally:
            self._shutdown(release_memory=committed)
        return self.last_committed if self.rank == 0 else None

    def abort(self, *, timeout: float = 10.0) -> None:
        """:meth:`close` after the group broke: a replica's exchange in flight on the copier thread may wait
        on the failed peer, which never answers when it stopped instead of dying. The replica group's
        connections are cut first (the exchange fails at once), and the exchange is waited for only briefly
        (:data:`~elastic_train.checkpoint.sharded.slots.BROKEN_EXCHANGE_WAIT`): this process asks for the
        next round meanwhile. The received replica is written only after the whole of it arrived, and never
        once closed, so a cut or abandoned exchange leaves no slot torn."""
        if not self._closed:
            cut = net.shut_down(self._rep_links)
            log.debug("shard_replica_links_cut", links=cut)
            self._shutdown(release_memory=False, timeout=timeout, broken=True)

    def close(self, *, release_memory: bool = False, timeout: float = 10.0) -> None:
        """Stop the writer without a new checkpoint (error paths); the snapshots stay unless
        ``release_memory``."""
        if not self._closed:
            self._shutdown(release_memory=release_memory, timeout=timeout)

    def _shutdown(self, *, release_memory: bool, timeout: float | None = None, broken: bool = False) -> None:
        self._closed = True
        self._attached.remove_all()
        done = self._jobs.stop(timeout)
        if self.memory is not None:
            # A replica's exchange in flight may wait on a peer that failed: bounded, like the writer.
            if self.memory.stop(timeout, broken=broken):
                if release_memory:
                    self.memory.release()
                else:
                    self.memory.detach()
            else:
                # broken: a replica's exchange left waiting on a failed peer (it writes nothing now)
                log.warning("memory_snapshot_busy_at_close", seconds=timeout, broken=broken)
                done = False  # its exchange still uses the replica group
        if done:
            doomed = [self._ctl, self._io, self._rep]
            self._ctl = self._io = self._rep = None
            for error in net.destroy_groups(doomed):
                log.debug("checkpoint_group_destroy_failed", error=error)
            self._rep_links = {}
        net.drop_extra_links(self)  # no cut of a later group reaches this manager's any more
