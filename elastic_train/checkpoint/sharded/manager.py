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

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastic_train.agentlink import CURRENT, STALE, AgentLink
from elastic_train.checkpoint import durable, transfer
from elastic_train.checkpoint.codec import (
    ALIGN,
    Flat,
    TensorSpec,
    aligned_zeros,
    copy_into,
    describe_mismatch,
    dtype_of,
    flatten,
    tensor_at,
    unflatten,
)
from elastic_train.checkpoint.config import CheckpointConfig
from elastic_train.checkpoint.errors import (
    CheckpointError,
    CheckpointSetupError,
    ModelMismatch,
    StorageError,
    WriteFailed,
)
from elastic_train.checkpoint.manager import Committed, Restored
from elastic_train.checkpoint.policy import durable_due, step_dir
from elastic_train.checkpoint.sharded import dcp, move, reshard
from elastic_train.checkpoint.sharded import manifest as smanifest
from elastic_train.checkpoint.sharded.local import join, leaves, live_shards, split
from elastic_train.checkpoint.sharded.shardmap import ShardMap, fsdp_ranges
from elastic_train.checkpoint.sharded.slots import INFO, ShardedMemory, Slot
from elastic_train.checkpoint.storage import open_storage
from elastic_train.log import get_logger

log = get_logger(__name__)

#: Attempts for the final checkpoint, whatever ``on_error`` says (it is the job's result).
FINAL_ATTEMPTS = 8
_RETRY = object()
_REPLICATED_TAG = (1 << 26) + 7


@dataclass(frozen=True, slots=True)
class _Decision:
    """What rank 0 decided, broadcast so that every rank acts on the same."""

    choice: reshard.Choice | None = None
    entry: str | None = None
    """The durable step directory the choice reads from (lost shards, or everything)."""
    storage: str | None = None
    """The URL that directory is in (the run's, or ``resume_from``'s)."""
    manifest: dict[str, Any] | None = None
    """Its manifest (a checkpoint of this project), validated by rank 0."""
    foreign: bool = False
    """A DCP checkpoint written by other code (``resume_from``): model and optimizer tensors only."""
    holder: int | None = None
    """The rank whose slot's metadata every rank takes (memory)."""
    stamp: int | None = None
    error: str | None = None
    setup_error: bool = False
    lost: tuple[int, int, tuple[int, ...]] | None = None
    """(newest step in memory, old world size, old ranks nobody holds there) when shards were lost."""

    def check(self) -> None:
        if self.error is not None:
            raise (CheckpointSetupError if self.setup_error else CheckpointError)(self.error)


@dataclass(slots=True)
class _Job:
    step: int
    flat: Flat
    slot: int | None
    started: float
    fqns: list[str]
    """The optimizer's parameter names, read on the training thread (a forward in flight re-registers
    FSDP2's unsharded parameters on the module)."""
    final: bool = False


class ShardedCheckpointManager:
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
        link: AgentLink | None = None,
    ) -> None:
        self.cfg, self.run_id = cfg, run_id
        self.rank, self.world_size, self.local_rank, self.round = rank, world_size, local_rank, round
        self.model, self.optimizer, self.current_state = model, optimizer, current_state
        self._mesh = _mesh_at(model, rank, world_size)
        self.link = link if link is not None else AgentLink.from_env()
        self.stamp: int | None = self.link.round
        self.base = 0
        self.storage = open_storage(cfg.url, cfg.storage_options, direct_io=cfg.direct_io)
        self.run_path = self.storage.join(self.storage.root, run_id)
        self._ctl = self._io = self._rep = None
        self.replicas = cfg.shard_replicas if world_size > 1 else 0
        if group is not None and world_size > 1:
            ranks = dist.get_process_group_ranks(group)
            self._ctl = dist.new_group(ranks=ranks, backend="gloo")
            self._io = dist.new_group(ranks=ranks, backend="gloo")
            if self.replicas:
                self._rep = dist.new_group(ranks=ranks, backend="gloo")
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

            from elastic_train.checkpoint.memory import sweep_stale

            if os.path.isdir(cfg.memory_dir):
                for path in sweep_stale(cfg.memory_dir):
                    log.info("memory_snapshot_swept", path=path)
                self.memory = ShardedMemory(cfg.memory_dir, run_id, local_rank, self.replicas)
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
        self._cond = threading.Condition()
        self._job: _Job | None = None
        self._busy = self._stop = self._closed = False
        self._writer: threading.Thread | None = None
        self._fqns: tuple[Any, list[str]] | None = None
        self._lineage: tuple[threading.Thread, list[BaseException]] | None = None
        #: The next snapshot is the first after a restore (its slots are allocated anew for this world).
        self._relayout = False

    @property
    def coordinated(self) -> bool:
        return self._ctl is not None

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self._ctl, rank) if self._ctl is not None else rank

    # -- save --------------------------------------------------------------------------------------------
    def save(self, step: int, state: Mapping[str, Any] | Callable[[], Mapping[str, Any]]) -> None:
        """After every optimizer step, on every rank: memory tier (and replica) and, when due, a durable
        checkpoint (DCP) written in the background.

        Raises:
            WriteFailed: an earlier durable write failed (after its retries).
            CheckpointError: the state cannot be kept (an unsupported sharding, say).
        """
        self._check_open()
        self.link.beat()
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
        if self._relayout:  # the first snapshot at a new world size allocates its slots: seconds at 1 GB
            self._relayout = False
            with self._beating():
                self._save(step, state, dur_due, exchange=exchange)
            return
        flat = self._flat(state)
        slot = None
        if self.memory is not None:
            slot = self.memory.save(step, flat)
            if exchange and self.replicas and self._rep is not None:
                self.memory.exchange(
                    step, slot, flat, buddy=self._global(self.buddy), source=self._global(self.source),
                    group=self._rep,
                )  # fmt: skip
        if dur_due:
            if self.memory is not None:
                self.memory.wait_idle()  # sealed: the writer reads what the slot holds
                self.memory.raise_error()
            self._submit(step, flat, slot)

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

    # -- the durable writer ------------------------------------------------------------------------------
    def _submit(self, step: int, flat: Flat, slot: int | None, *, final: bool = False) -> None:
        self.wait()
        self._raise_pending()
        if slot is not None and self.memory is not None:
            self.memory.own.pin(slot)
        else:
            if self._staging is None or self._staging.numel() < flat.nbytes:
                self._staging = aligned_zeros(max(flat.nbytes, ALIGN), ALIGN)
            copy_into(flat, self._staging)
        job = _Job(step, flat, slot, time.monotonic(), self._fqn_of(), final)
        self._last_durable_time = time.monotonic()
        self._last_durable_step = step
        if not self.cfg.async_write or final:
            self._run_job(job)
            self._raise_pending()
            return
        with self._cond:
            if self._writer is None:
                self._writer = threading.Thread(target=self._writer_loop, name="ckpt-dcp-writer", daemon=True)
                self._writer.start()
            self._job, self._busy = job, True
            self._cond.notify_all()

    def _writer_loop(self) -> None:
        while True:
            with self._cond:
                while self._job is None and not self._stop:
                    self._cond.wait()
                if self._job is None:
                    return
                job = self._job
            try:
                self._run_job(job)
            finally:
                with self._cond:
                    self._job, self._busy = None, False
                    self._cond.notify_all()

    def _run_job(self, job: _Job) -> None:
        """One durable checkpoint (all ranks in step), retried per ``on_error``; never raises."""
        try:
            data = (
                self.memory.own.data(job.slot, job.flat.nbytes)
                if job.slot is not None and self.memory is not None
                else self._staging[: job.flat.nbytes]  # type: ignore[index]
            )
            retrying = self.cfg.on_error == "retry" or job.final
            attempts = max(self.cfg.retries, FINAL_ATTEMPTS if job.final else 1) if retrying else 1
            error: str | None = None
            for attempt in range(1, attempts + 1):
                error = self._write_once(job, data)
                if error == "unpublished":
                    if job.final:
                        self._failure = WriteFailed(
                            f"final checkpoint of step {job.step} not published: round {self.link.round} is "
                            "no longer the run's current round"
                        )
                    return
                if error is None:
                    self._durable_ok_step = job.step
                    return
                log.warning(
                    "checkpoint_write_failed", step=job.step, attempt=attempt, attempts=attempts, error=error
                )
                if attempt < attempts:
                    time.sleep(min(10.0, 0.5 * 2 ** (attempt - 1)))
            failure = WriteFailed(f"durable checkpoint of step {job.step} failed: {error}")
        except Exception as exc:  # a bug or a broken group: reported, never lost silently
            log.error("checkpoint_writer_crashed", step=job.step, error=repr(exc))
            failure = WriteFailed(f"durable checkpoint of step {job.step} failed: {exc!r}")
        finally:
            if job.slot is not None and self.memory is not None:
                self.memory.own.unpin(job.slot)
        if self.cfg.on_error == "log" and not job.final:
            log.error("checkpoint_lost", step=job.step, error=str(failure))
        else:
            self._failure = failure

    def _fqn_of(self) -> list[str]:
        """The name of each parameter the optimizer's state dict numbers (its param groups, in order).

        Read between steps on the training thread: during a forward FSDP2 registers the unsharded
        parameters on the module, and the optimizer's (sharded) ones have no name there."""
        opt = self.optimizer
        if not isinstance(opt, torch.optim.Optimizer):
            return []
        key = [id(p) for g in opt.param_groups for p in g["params"]]
        if self._fqns is not None and self._fqns[0] == key:
            return self._fqns[1]
        names = {id(p): n for n, p in self.model.named_parameters(remove_duplicate=False)}
        seen: dict[int, str] = {}
        for pid in key:
            seen.setdefault(pid, names.get(pid, f"param{len(seen)}"))
        fqns = list(seen.values())
        if all(pid in names for pid in seen):  # else: an optimizer over tensors the model does not hold
            self._fqns = (key, fqns)
        return fqns

    def _write_once(self, job: _Job, data: torch.Tensor) -> str | None:
        """One collective attempt: DCP writes every rank's part, each rank hashes its files, rank 0 commits.
        Returns the error, ``"unpublished"`` when the gate said no, or None."""
        me = self.rank if self.coordinated else 0
        path = self.storage.join(self.run_path, step_dir(job.step, self.stamp))
        flat = job.flat
        tensors = [tensor_at(data, s) for s in flat.specs]
        payload = unflatten(flat.skeleton, tensors)
        smap = ShardMap.from_json(payload[INFO]["map"])
        fqns = job.fqns
        record: Any = None
        error = None
        try:
            state = _dcp_state(payload["state"], smap, self._mesh, fqns)
            dcp.save(state, self.storage, path, group=self._io, options=self.cfg.storage_options)
            names = self.storage.listdir(path)
            mine = dcp.written_by(names, me) + ([dcp.METADATA] if me == 0 else [])
            record = {n: (*d, me) for n, d in dcp.file_digests(self.storage, path, mine).items()}
        except Exception as exc:
            error = f"rank {self.rank}: {exc}".splitlines()[0]
        gathered = [(record, error)]
        if self.coordinated:
            gathered = [None] * self.world_size  # type: ignore[list-item]
            dist.all_gather_object(gathered, (record, error), group=self._io)
        outcome: list[Any] = [None]
        if me == 0:
            errors = [e for _, e in gathered if e]
            if not errors:
                files: dict[str, Any] = {}
                for r, _ in gathered:
                    files.update(r or {})
                try:
                    skeleton, entries = _manifest_tensors(flat, smap, fqns)
                    manifest = smanifest.build(
                        run_id=self.run_id, step=job.step, world_size=self.world_size, skeleton=skeleton,
                        tensors=entries, smap=smap, files=files, sampler=payload["state"].get("sampler"),
                        model=_fingerprint(entries), round=self.stamp, base=self.base,
                    )  # fmt: skip
                    if not self._commit(job, manifest):
                        outcome[0] = "unpublished"
                except Exception as exc:
                    errors.append(f"commit: {exc}")
            if errors:
                outcome[0] = "; ".join(errors)
        if self.coordinated:
            dist.broadcast_object_list(outcome, src=self._global_io(0), group=self._io)
        return outcome[0]

    def _global_io(self, rank: int) -> int:
        assert self._io is not None
        return dist.get_global_rank(self._io, rank)

    def _commit(self, job: _Job, manifest: dict[str, Any]) -> bool:
        if not self._may_publish(job):
            return False
        path = durable.commit(self.storage, self.run_path, manifest, lambda: self._may_publish(job))
        if path is None:
            return False
        seconds = time.monotonic() - job.started
        self.last_committed = Committed(job.step, path, int(manifest["bytes"]), seconds)
        log.info("checkpoint_committed", step=job.step, path=path, bytes=manifest["bytes"],
                 seconds=round(seconds, 3), layout="dcp")  # fmt: skip
        for gone in durable.prune(
            self.storage, self.run_path, keep_last=self.cfg.keep_last, keep_every=self.cfg.keep_every,
            current=job.step, recycle_bytes=0, round=self.stamp,
        ):  # fmt: skip
            log.info("checkpoint_removed", path=gone)
        return True

    def _may_publish(self, job: _Job) -> bool:
        answer = self.link.may_publish()
        if answer == CURRENT:
            return True
        if job.final and answer != STALE:
            log.warning("checkpoint_final_unconfirmed", step=job.step, round=self.link.round)
            return True
        log.warning("checkpoint_fenced" if answer == STALE else "checkpoint_unconfirmed", step=job.step,
                    round=self.link.round)  # fmt: skip
        return False

    # -- restore -----------------------------------------------------------------------------------------
    def restore(self, model: Mapping[str, Any] | None = None, **_: Any) -> Restored | None:
        """Collective: the newest complete sharded state, resharded to this world's FSDP2 ownership.

        Each rank takes the rows of its new shards it holds itself (its own slot, or the replica it keeps),
        receives those another rank holds and reads from durable storage only those nobody alive holds. A
        slot whose data fails its checksum is marked torn and every rank looks again.

        Args:
            model: the model's ``state_dict()`` (DTensors on the current mesh): restored model shards land
                in its parameters, and a checkpoint of another model raises :class:`ModelMismatch`.

        Returns:
            The state (DTensors on the current mesh for every sharded tensor), or None when there is none.

        Raises:
            CheckpointError: storage failure, an unreadable ``resume_from``, or a model mismatch.
        """
        self.wait()
        if model is None:
            model = self.model.state_dict()
        with self._beating():
            restored = self._restore(model)
        self._relayout = restored is not None
        return restored

    @contextlib.contextmanager
    def _beating(self) -> Iterator[None]:
        """Count progress for the agent while a long step of the restore (or the first snapshot after it)
        runs: it is work, not a worker blocked on a dead peer (a collective's failure ends it)."""
        done = threading.Event()

        def beat() -> None:
            while not done.wait(0.25):
                self.link.beat()

        thread = threading.Thread(target=beat, name="ckpt-restore-beat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def _restore(self, model: Mapping[str, Any]) -> Restored | None:
        started = time.perf_counter()
        again: int | None = None
        try:
            for _attempt in range(self.world_size * 8 + 1):
                try:
                    result = self._restore_once(model, again, started)
                finally:
                    self._lineage_written()
                if result is not _RETRY:
                    return result
                again = self.stamp
        finally:
            self._lineage = None
        raise CheckpointError("restore: every shared-memory snapshot found failed its checksum")

    def _restore_once(self, model: Mapping[str, Any], again: int | None, started: float) -> Any:
        slots = self.memory.slots() if self.memory is not None else []
        mine = [(s.step, s.round, s.world_size, s.rank) for s in slots]
        gathered: list[Any] = [mine]
        if self.coordinated:
            gathered = [None] * self.world_size
            dist.all_gather_object(gathered, mine, group=self._ctl)
        holdings = [reshard.Holding(r, *h) for r, held in enumerate(gathered) for h in held]
        decision = _Decision()
        if self.rank == 0 or not self.coordinated:
            try:
                decision = self._decide(holdings)
                decision = _replace(decision, stamp=self._record_start(decision, again))
            except CheckpointError as exc:
                decision = _Decision(error=str(exc), setup_error=isinstance(exc, CheckpointSetupError))
        if self.coordinated:
            decision = transfer.broadcast_small(decision, src=self._global(0), group=self._ctl)
        decision.check()
        self.stamp = decision.stamp
        choice = decision.choice
        if choice is None:
            self.base = 0
            log.info("restore_nothing_found", run=self.run_path)
            return None
        self.base = choice.step
        if decision.lost is not None and self.rank == 0:
            newest, world, lost = decision.lost
            log.warning(
                "sharded_state_lost", newest_memory_step=newest, world_size=world, lost_ranks=list(lost),
                restored_step=choice.step, source=choice.source, redone=max(0, newest - choice.step),
            )  # fmt: skip
        if decision.foreign:
            return self._restore_foreign(decision, model)
        return self._reshard(decision, model, slots, started)

    def _decide(self, holdings: list[reshard.Holding]) -> _Decision:
        """Rank 0: which state (memory, this run's durable checkpoints, ``resume_from``)."""
        entries = [e for e in durable.list_entries(self.storage, self.run_path) if e.valid]
        for e in durable.list_entries(self.storage, self.run_path):
            if not e.valid and e.problem != durable.NO_MANIFEST:
                log.warning("checkpoint_invalid", path=e.path, reason=e.problem)
        sharded = {
            e.step: e
            for e in entries
            if e.manifest is not None and e.manifest.get("format") == smanifest.FORMAT
        }
        skip: set[int] = set()
        lost_info = None
        newest = max((h.step for h in holdings), default=None)
        while True:
            choice = reshard.choose(holdings, sorted(sharded), skip=skip)
            if choice is None:
                break
            if lost_info is None and newest is not None and choice.source != reshard.MEMORY:
                at = [h for h in holdings if h.step == newest]
                world = max((h.round, h.world_size) for h in at)
                held = {h.old_rank for h in at if (h.round, h.world_size) == world}
                lost_info = (newest, world[1], tuple(sorted(set(range(world[1])) - held)))
            holder = min((r for r in choice.holders), default=None)
            if choice.source == reshard.MEMORY:
                return _Decision(choice=choice, holder=holder, lost=lost_info)
            entry = sharded[choice.step]
            try:
                dcp.DcpReader(self.storage, entry.path, _pieces(entry.manifest))
            except CheckpointError as exc:
                log.warning("checkpoint_skipped", path=entry.path, reason=str(exc))
                skip.add(choice.step)
                continue
            return _Decision(choice=choice, entry=entry.path, storage=self.cfg.url, manifest=entry.manifest,
                             holder=holder, lost=lost_info)  # fmt: skip
        if any(e.manifest and e.manifest.get("format") != smanifest.FORMAT for e in entries):
            raise CheckpointSetupError(
                f"{self.run_path}: holds checkpoints of a replicated (DDP) state only; this model is sharded"
            )
        if self.cfg.resume_from:
            return self._decide_resume()
        return _Decision()

    def _decide_resume(self) -> _Decision:
        url = self.cfg.resume_from
        assert url is not None
        store = open_storage(url, self.cfg.storage_options)
        what = f"resume_from {url}"
        if store.kind(store.root) is None:
            raise CheckpointSetupError(f"{what}: does not exist")
        if store.size(store.join(store.root, dcp.METADATA)) is not None and (
            store.size(store.join(store.root, durable.MANIFEST)) is None
        ):
            try:
                dcp.DcpReader(store, store.root)
            except CheckpointError as exc:
                raise CheckpointSetupError(f"{what}: {exc}") from exc
            return _Decision(
                choice=reshard.Choice(0, "resume_from", None), entry=store.root, storage=url, foreign=True
            )
        _, cands = durable.resolve(store, store.root)
        for entry in cands:
            if not entry.valid or entry.manifest is None:
                continue
            if entry.manifest.get("format") != smanifest.FORMAT:
                raise CheckpointSetupError(f"{what}: a replicated (DDP) checkpoint; this model is sharded")
            try:
                dcp.DcpReader(store, entry.path, _pieces(entry.manifest))
            except CheckpointError as exc:
                log.warning("checkpoint_skipped", path=entry.path, reason=str(exc))
                continue
            return _Decision(
                choice=reshard.Choice(entry.step, "resume_from", None), entry=entry.path, storage=url,
                manifest=entry.manifest,
            )  # fmt: skip
        raise CheckpointSetupError(f"{what}: no valid checkpoint")

    def _reshard(
        self, decision: _Decision, model: Mapping[str, Any], slots: list[Slot], started: float
    ) -> Any:
        choice = decision.choice
        assert choice is not None
        me, world = self.rank, self.world_size
        # The old world's map and the state's skeleton: from the holder's slot, or the manifest.
        meta = None
        if choice.memory_used:
            assert decision.holder is not None
            if me == decision.holder:
                held = _slot_at(slots, choice, kind="own") or _slot_at(slots, choice)
                assert held is not None
                meta = (held.held.skeleton, [s.to_json() for s in held.held.specs])
            if self.coordinated:
                meta = transfer.broadcast_small(meta, src=self._global(decision.holder), group=self._ctl)
            assert meta is not None
            skeleton = meta[0]["state"]
            specs = [TensorSpec.from_json(s) for s in meta[1]]
            smap = ShardMap.from_json(meta[0][INFO]["map"])
            refs = [(s.path.removeprefix("/state"), s.dtype, s.shape) for s in specs]
        else:
            assert decision.manifest is not None
            parsed = smanifest.ShardedManifest.model_validate(decision.manifest)
            skeleton, smap = decision.manifest["skeleton"], parsed.shard_map()
            refs = [(t.path, t.dtype, tuple(t.shape)) for t in parsed.tensors]
            specs = []
        self._check_model(model, smap, refs, choice)
        new = smap.resized(world)
        holders = {r: set(o) for r, o in choice.holders.items()}
        plan = reshard.plan(smap, holders, world)
        # Where the new shards land: the model's parameters themselves, fresh tensors for the rest.
        live = live_shards(model)
        dests: dict[str, torch.Tensor] = {}
        for path, t in new.tensors.items():
            rows = t.ranges[me][1]
            shape = (rows, *t.shape[1:])
            target = live.get(path)
            if target is not None and tuple(target.shape) == shape and str(target.dtype).endswith(t.dtype):
                dests[path] = target
            else:
                dests[path] = torch.empty(shape, dtype=dtype_of(t.dtype))
        # This rank's slots of the step, each read once, in order and hashed (a torn one fails the verdict):
        # the rows it keeps straight into its new shards, the rows it sends into buffers of their own.
        mine = [s for s in slots if s.step == choice.step and (s.round, s.world_size) == choice.world]
        wanted: dict[int, dict[str, list[tuple[int, int, torch.Tensor | None]]]] = {}
        for p in plan.pieces:
            if p.src == me:
                into = dests[p.path][p.dst_row : p.dst_row + p.rows] if p.dst == me else None
                wanted.setdefault(p.old, {}).setdefault(p.path, []).append((p.src_row, p.rows, into))
        torn = False
        staged: dict[tuple[str, int, int], torch.Tensor] = {}
        replicated_from: tuple[Slot, dict[str, torch.Tensor]] | None = None
        for slot in sorted(mine, key=lambda s: s.kind != "own"):
            whole = replicated_from is None
            if slot.rank not in wanted and not whole:
                continue
            assert self.memory is not None
            runs, small, ok = self.memory.land(slot, wanted.pop(slot.rank, {}), whole=whole)
            torn = torn or not ok
            staged.update({(path, slot.rank, first): buf for (path, first), buf in runs.items()})
            if whole:
                replicated_from = (slot, small)
        reader = None
        if decision.entry is not None and (choice.lost or not choice.memory_used):
            store = open_storage(decision.storage or self.cfg.url, self.cfg.storage_options)
            reader = dcp.DcpReader(store, decision.entry, _pieces(decision.manifest))
            keys = {t["path"]: t["key"] for t in decision.manifest["tensors"]} if decision.manifest else {}

        def fill(piece: reshard.Piece, into: torch.Tensor) -> None:
            assert reader is not None
            first = new.tensors[piece.path].ranges[me][0] + piece.dst_row
            reader.read(keys[piece.path], into, first)

        t0 = time.perf_counter()
        moved = move.execute(
            plan, me, source=lambda p: staged[(p.path, p.old, p.src_row)], dests=dests,
            to_global=self._global, lanes=(self._ctl, self._io), durable=fill if reader is not None else None,
        )  # fmt: skip
        # The rest of the state (scheduler, data position, RNG, step counts): this rank's own slot's, else
        # the holder's (sent), else the durable checkpoint's.
        tensors: list[torch.Tensor | None] = [None] * len(refs)
        for i, (path, _, _) in enumerate(refs):
            if path in smap.tensors:
                tensors[i] = dests[path]
        if choice.memory_used:
            self._replicated(decision, specs, replicated_from, tensors)
        else:
            assert reader is not None and decision.manifest is not None
            for i, listed in enumerate(decision.manifest["tensors"]):
                if tensors[i] is None:
                    full = torch.empty(tuple(listed["shape"]), dtype=dtype_of(listed["dtype"]))
                    reader.read(listed["key"], full)
                    tensors[i] = full
        moved_s = time.perf_counter() - t0
        if self._torn_anywhere(torn):
            return _RETRY
        state = join(unflatten(skeleton, tensors), new, self._mesh)  # type: ignore[arg-type]
        minimum = reshard.minimum(smap, holders, world, me)
        self.last_moved = {
            "kept": moved.kept,
            "received": moved.received,
            "sent": moved.sent,
            "durable": moved.durable,
            "minimum": minimum,
            "seconds": round(time.perf_counter() - started, 4),
            "move_s": round(moved_s, 4),
        }  # fmt: skip
        log.info(
            "resharded", step=choice.step, source=choice.source, from_world=smap.world_size, to_world=world,
            bytes=smap.nbytes, kept=moved.kept, received=moved.received, sent=moved.sent,
            from_storage=moved.durable, minimum=minimum, move_s=round(moved_s, 4),
            seconds=round(time.perf_counter() - started, 4),
        )  # fmt: skip
        source = "memory" if choice.source == reshard.MEMORY else choice.source
        return Restored(choice.step, state, source, decision.holder if choice.memory_used else None)

    def _replicated(
        self,
        decision: _Decision,
        specs: list[TensorSpec],
        own: tuple[Slot, dict[str, torch.Tensor]] | None,
        tensors: list[torch.Tensor | None],
    ) -> None:
        """The tensors of the state that are not sharded: from this rank's slot of the step, else sent by
        the holder (one message: they are small)."""
        todo = [i for i, t in enumerate(tensors) if t is None]
        sizes = [specs[i].nbytes for i in todo]
        have = torch.tensor([int(own is not None)], dtype=torch.int32)
        flags = [have]
        if self.coordinated:
            flags = [torch.empty(1, dtype=torch.int32) for _ in range(self.world_size)]
            dist.all_gather(flags, have, group=self._ctl)
        if own is not None:
            _, small = own
            for i in todo:
                spec = specs[i]
                raw = small.get(spec.path, torch.empty(0, dtype=torch.uint8))
                tensors[i] = raw.view(dtype_of(spec.dtype)).view(spec.shape)
        if not self.coordinated:
            return
        holder = decision.holder
        assert holder is not None
        lacking = [r for r, f in enumerate(flags) if not int(f.item())]
        if not lacking:
            return
        if self.rank == holder:
            blob = torch.cat([tensors[i].reshape(-1).view(torch.uint8) for i in todo]) if todo else None  # type: ignore[union-attr]
            works = [
                dist.isend(blob, dst=self._global(r), group=self._ctl, tag=_REPLICATED_TAG)
                for r in lacking
                if blob is not None and blob.numel()
            ]
            for w in works:
                if w is not None:
                    w.wait()
        elif self.rank in lacking:
            blob = torch.empty(sum(sizes), dtype=torch.uint8)
            if blob.numel():
                dist.recv(blob, src=self._global(holder), group=self._ctl, tag=_REPLICATED_TAG)
            pos = 0
            for i, n in zip(todo, sizes, strict=True):
                spec = specs[i]
                tensors[i] = blob[pos : pos + n].view(dtype_of(spec.dtype)).view(spec.shape)
                pos += n

    def _restore_foreign(self, decision: _Decision, model: Mapping[str, Any]) -> Restored:
        """A DCP checkpoint written by other code (``resume_from``): the model's tensors and the optimizer's
        per-parameter tensors, each rank reading its own rows; everything else starts as built (step 0, the
        data order from its start). Bytes entries (pickles) are never read."""
        assert decision.entry is not None
        store = open_storage(decision.storage or "", self.cfg.storage_options)
        reader = dcp.DcpReader(store, decision.entry)
        keys = reader.layout.tensors
        state = dict(self.current_state()) if self.current_state is not None else {}
        loaded, skipped = 0, []
        new_model = {}
        for name, v in model.items():
            key = next((k for k in (f"model.{name}", name) if k in keys), None)
            if key is None:
                raise ModelMismatch(
                    f"{decision.entry}: the DCP checkpoint has no tensor for {name!r} (looked for "
                    f"'model.{name}' and '{name}')"
                )
            new_model[name] = _read_like(reader, key, v, self._mesh, self.rank)
            loaded += 1
        state["model"] = new_model
        opt = self.optimizer
        if isinstance(opt, torch.optim.Optimizer):
            fqns = self._fqn_of()
            params = [p for g in opt.param_groups for p in g["params"]]
            per_param: dict[int, dict[str, Any]] = {}
            for i, fqn in enumerate(fqns):
                for prefix in (f"optim.state.{fqn}.", f"optimizer.state.{fqn}."):
                    found = {k[len(prefix) :]: k for k in keys if k.startswith(prefix)}
                    if found:
                        per_param[i] = {
                            sub: _read_like(reader, k, params[i], self._mesh, self.rank)
                            for sub, k in found.items()
                        }
                        break
            if per_param:
                optim = opt.state_dict()
                optim["state"] = per_param
                state["optimizer"] = optim
            else:
                skipped.append("optimizer")
        log.info(
            "resumed_from_foreign_dcp", path=decision.entry, tensors=loaded, skipped=skipped,
            kept_as_built=["step", "sampler", "scheduler", "rng"],
        )  # fmt: skip
        return Restored(0, state, "resume_from", None)

    def _check_model(
        self, model: Mapping[str, Any], smap: ShardMap, refs: list[tuple[str, str, Any]], choice: Any
    ) -> None:
        """Refuse a checkpoint of another model (names, global shapes, dtypes), on every rank alike."""
        saved = []
        for path, dtype, shape in refs:
            if path.startswith("/model/"):
                t = smap.tensors.get(path)
                saved.append([path[len("/model/") :], dtype, list(t.shape if t is not None else shape)])
        current = [
            [str(n), str(v.dtype).removeprefix("torch."), list(v.shape)]
            for n, v in model.items()
            if isinstance(v, torch.Tensor)
        ]
        why = describe_mismatch(sorted(saved), sorted(current))
        if why:
            raise ModelMismatch(
                f"checkpoint at step {choice.step} ({choice.source}) is from a different model: {why}"
            )

    def _torn_anywhere(self, torn: bool) -> bool:
        if not self.coordinated:
            return torn
        flag = torch.tensor([int(torn)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._ctl)
        return bool(flag.item())

    def _record_start(self, decision: _Decision, again: int | None) -> int | None:
        """Rank 0 records where this world starts (lineage, for the stale-writer rule), in a thread."""
        if self.link.round is None:
            return None
        round_ = self.link.round
        base = decision.choice.step if decision.choice is not None else 0
        try:
            stamp, record = durable.plan_start(self.storage, self.run_path, round_, base, again=again)
        except StorageError as exc:
            log.warning("lineage_not_recorded", round=round_, base=base, error=str(exc))
            return round_
        path = self.storage.join(self.run_path, durable.LINEAGE)
        failed: list[BaseException] = []

        def write() -> None:
            try:
                self.storage.write_small(path, record)
            except StorageError as exc:
                log.warning("lineage_not_recorded", round=round_, base=base, error=str(exc))
            except BaseException as exc:
                failed.append(exc)

        thread = threading.Thread(target=write, name="ckpt-lineage", daemon=True)
        thread.start()
        self._lineage = (thread, failed)
        return stamp

    def _lineage_written(self) -> None:
        pending, self._lineage = self._lineage, None
        if pending is not None:
            pending[0].join()
            if pending[1]:
                raise pending[1][0]

    # -- waiting and ending ------------------------------------------------------------------------------
    def wait(self) -> None:
        """Block until no durable write is in flight."""
        with self._cond:
            while self._busy:
                if not self._cond.wait(timeout=0.25):
                    self.link.beat()

    def _raise_pending(self) -> None:
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        if self.memory is not None:
            self.memory.raise_error()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("checkpoint manager is closed")

    def finalize(self, step: int, state: Mapping[str, Any]) -> Committed | None:
        """The final durable checkpoint (collective, retried), then the shared memory is released.

        Raises:
            WriteFailed: it could not be written.
        """
        self._check_open()
        try:
            if self.memory is not None:
                self.memory.wait_idle()
            self.wait()
            self._raise_pending()
            if step != self._durable_ok_step:
                self._submit(step, self._flat(state), None, final=True)
            self.wait()
            self._raise_pending()
        finally:
            self._shutdown(release_memory=True)
        return self.last_committed if self.rank == 0 else None

    def close(self, *, release_memory: bool = False, timeout: float = 10.0) -> None:
        """Stop the writer without a new checkpoint (error paths); the snapshots stay unless
        ``release_memory``."""
        if not self._closed:
            self._shutdown(release_memory=release_memory, timeout=timeout)

    def _shutdown(self, *, release_memory: bool, timeout: float | None = None) -> None:
        self._closed = True
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._writer is not None:
            self._writer.join(timeout)
        done = self._writer is None or not self._writer.is_alive()
        if self.memory is not None:
            if release_memory:
                self.memory.release()
            else:
                self.memory.detach()
        if done:
            for g in (self._ctl, self._io, self._rep):
                if g is not None:
                    try:
                        dist.destroy_process_group(g)
                    except Exception as exc:
                        log.debug("checkpoint_group_destroy_failed", error=str(exc))
            self._ctl = self._io = self._rep = None


# -- helpers ------------------------------------------------------------------------------------------------


def _replace(decision: _Decision, **changes: Any) -> _Decision:
    import dataclasses

    return dataclasses.replace(decision, **changes)


def _pieces(manifest: Mapping[str, Any] | None) -> dict[str, list[str]] | None:
    if manifest is None:
        return None
    return {f["name"]: list(f["pieces"]) for f in manifest["files"]}


def _slot_at(slots: list[Slot], choice: reshard.Choice, kind: str | None = None) -> Slot | None:
    for s in slots:
        if s.step == choice.step and (s.round, s.world_size) == choice.world and kind in (None, s.kind):
            return s
    return None


def dcp_key(path: str, fqns: list[str]) -> str:
    """The key of a state's tensor in the DCP directory: ``model.<name>``, ``optim.state.<param>.<key>``
    (the layout of ``get_state_dict``'s ``{"model": ..., "optim": ...}``), ``elastic_train.<path>`` for the
    rest (RNG states and the like)."""
    if path.startswith("/model/"):
        return "model." + path[len("/model/") :]
    parts = path.strip("/").split("/")
    if (
        len(parts) == 4
        and parts[:2] == ["optimizer", "state"]
        and parts[2].isdigit()
        and int(parts[2]) < len(fqns)
    ):
        return f"optim.state.{fqns[int(parts[2])]}.{parts[3]}"
    return "elastic_train." + path.strip("/")


def _dcp_state(local: Mapping[str, Any], smap: ShardMap, mesh: Any, fqns: list[str]) -> dict[str, Any]:
    """DCP's nested state of a rank's part: ``{"model", "optim", "elastic_train"}`` with DTensors for the
    sharded tensors (views of the slot: DCP copies what it writes)."""
    model: dict[str, Any] = {}
    per_param: dict[str, dict[str, Any]] = {}
    rest: dict[str, Any] = {}
    for path, t in leaves(join(local, smap, mesh)):
        if not isinstance(t, torch.Tensor):
            continue
        key = dcp_key(path, fqns)
        if key.startswith("model."):
            model[key[len("model.") :]] = t
        elif key.startswith("optim.state."):
            param, sub = key[len("optim.state.") :].rsplit(".", 1)
            per_param.setdefault(param, {})[sub] = t
        else:
            rest[key[len("elastic_train.") :]] = t
    out: dict[str, Any] = {"model": model}
    optimizer = local.get("optimizer")
    if isinstance(optimizer, Mapping):
        groups = optimizer.get("param_groups") or []
        out["optim"] = {
            "state": per_param,
            "param_groups": [
                {
                    **g,
                    "params": [
                        fqns[i] if type(i) is int and i < len(fqns) else i for i in g.get("params", [])
                    ],
                }
                for g in groups
                if isinstance(g, Mapping)
            ],
        }
    if rest:
        out["elastic_train"] = rest
    return out


def _manifest_tensors(flat: Flat, smap: ShardMap, fqns: list[str]) -> tuple[Any, list[dict[str, Any]]]:
    """The state's skeleton (tensor indices into the manifest's list) and that list: each tensor's global
    shape, dtype and DCP key."""
    entries = []
    for spec in flat.specs:
        path = spec.path.removeprefix("/state")
        t = smap.tensors.get(path)
        shape = list(t.shape) if t is not None else list(spec.shape)
        nbytes = t.nbytes if t is not None else spec.nbytes
        entries.append(
            {"path": path, "dtype": spec.dtype, "shape": shape, "nbytes": nbytes, "key": dcp_key(path, fqns)}
        )
    return flat.skeleton["state"], entries


def _fingerprint(entries: list[dict[str, Any]]) -> list[list[Any]]:
    return sorted(
        [e["path"][len("/model/") :], e["dtype"], e["shape"]]
        for e in entries
        if e["path"].startswith("/model/")
    )


def _read_like(reader: dcp.DcpReader, key: str, like: Any, mesh: Any, rank: int) -> Any:
    """The tensor at ``key``, as ``like`` is sharded: this rank's rows (FSDP2's even chunk) as a DTensor on
    ``mesh`` when ``like`` is a sharded DTensor of that shape, whole otherwise (a step count, a buffer)."""
    from torch.distributed.tensor import DTensor, Shard

    stored = reader.layout.tensors[key]
    if (
        isinstance(like, DTensor)
        and tuple(like.placements) == (Shard(0),)
        and stored.shape == tuple(like.shape)
    ):
        first, rows = fsdp_ranges(stored.shape[0], mesh.size())[rank]
        into = torch.empty((rows, *stored.shape[1:]), dtype=stored.dtype)
        reader.read(key, into, first)
        return DTensor.from_local(
            into, mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
        )
    into = torch.empty(stored.shape, dtype=stored.dtype)
    reader.read(key, into)
    return into


def _mesh_at(model: torch.nn.Module, rank: int, world_size: int) -> Any:
    """The device mesh of ``model``'s sharded parameters, checked to place this process at ``rank``; a
    fresh 1-D mesh of the group when it does not (a mesh of an earlier group whose DTensors torch kept)."""
    from torch.distributed.tensor import DTensor

    mesh = next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), None)
    if mesh is None or mesh.get_coordinate() == (rank,):
        return mesh
    from torch.distributed.device_mesh import init_device_mesh

    log.warning("device_mesh_stale", coordinate=mesh.get_coordinate(), rank=rank)
    return init_device_mesh(mesh.device_type, (world_size,))
