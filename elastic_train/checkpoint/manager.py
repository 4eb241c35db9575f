"""CheckpointManager: the one object the training loop talks to.

``save`` after each optimizer step snapshots the state into the shared-memory tier and, when a durable
checkpoint is due, hands it to a background writer. With an optimizer :meth:`~CheckpointManager.attach`-ed,
the copy of the parameters and optimizer state into shared memory runs while the next step's forward and
backward do, and its step pre-hook waits for it before the optimizer changes them. ``restore`` is
collective and returns the newest valid state held anywhere; ``finalize`` commits a last checkpoint;
``close`` stops on error paths.

Concurrency: the writer uses its own gloo process group (``io``) and the loop-side collectives another
(``ctl``), so background collectives never interleave with the training group's. At most one durable write
is in flight; a save that is due while the previous write still runs waits for it (every rank does the same,
so ranks stay in step — skipping would need a collective vote).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastic_train.agentlink import CURRENT, STALE, AgentLink
from elastic_train.checkpoint import durable, transfer
from elastic_train.checkpoint.codec import (
    Flat,
    TensorSpec,
    aligned_zeros,
    copy_into,
    describe_mismatch,
    fingerprint_from_specs,
    flatten,
    layout_key,
    model_fingerprint,
    tensor_at,
    unflatten,
)
from elastic_train.checkpoint.config import CheckpointConfig
from elastic_train.checkpoint.errors import (
    CheckpointError,
    CheckpointNotFound,
    CheckpointSetupError,
    ModelMismatch,
    StorageError,
    WriteFailed,
)
from elastic_train.checkpoint.memory import (
    SLOTS,
    DataCheck,
    Held,
    MemorySnapshot,
    snapshot_files,
    sweep_stale,
)
from elastic_train.checkpoint.plan import Planned
from elastic_train.checkpoint.policy import (
    SHARE_ALIGN,
    Candidate,
    durable_due,
    restore_plan,
    share_ranges,
    step_dir,
)
from elastic_train.checkpoint.preflight import check_resume_source
from elastic_train.checkpoint.probe import SharedStorageCheck
from elastic_train.checkpoint.storage import open_storage
from elastic_train.log import get_logger

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Restored:
    """State found by :meth:`CheckpointManager.restore` (identical on every rank)."""

    step: int
    state: dict[str, Any]
    source: str
    """"memory", "durable" or "resume_from"."""
    holder_rank: int | None
    """Rank whose shared-memory snapshot was broadcast; None when the state came from storage."""


@dataclass(frozen=True, slots=True)
class Committed:
    """A durable checkpoint this manager committed (``seconds``: from the save call to the commit)."""

    step: int
    path: str
    bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class RestoreDecision:
    """What rank 0 found to restore, broadcast so that every rank acts on the same."""

    chosen: Candidate | None = None
    """Where the state comes from and its step; None when there is none anywhere (or on an error)."""
    error: str | None = None
    """Why nothing can be restored: every rank raises it."""
    setup_error: bool = False
    """The error is a :class:`CheckpointSetupError` (the same at every attempt, not worth a restart)."""
    stamp: int | None = None
    """The round this world's checkpoints are stamped with (:func:`durable.plan_start`)."""
    meta: tuple[Any, list[Any], int] | None = None
    """The chosen state's (skeleton, specs as JSON, bytes) when rank 0 sends it (it holds the step or read
    it from storage) and some rank does not hold it: the receivers take it from here instead of from a
    message of its own."""

    def check(self) -> None:
        """Raise the decided error, if any (the same type and line on every rank)."""
        if self.error is not None:
            raise (CheckpointSetupError if self.setup_error else CheckpointError)(self.error)


#: What an attempt of :meth:`CheckpointManager.restore` returns when a slot turned out torn on some rank.
_RETRY = object()
#: Attempts for the final checkpoint (whatever ``on_error`` says): it is the job's result.
FINAL_ATTEMPTS = 8


def retry_delay(attempt: int) -> float:
    """Seconds to wait after failed attempt ``attempt`` (1-based): 0.5, 1, 2, 4, 8, then 10."""
    return float(min(10.0, 0.5 * 2 ** (attempt - 1)))


#: Seconds between progress beats while :meth:`CheckpointManager.wait` waits for the durable writer.
_BEAT_WHILE_WAITING = 0.25
#: A durable write's outcome when the publish gate kept it from being published (not an error).
_UNPUBLISHED = "(not published: the publish gate said no)"


@dataclass(slots=True)
class _Job:
    step: int
    flat: Flat
    slot: int | None
    started: float
    final: bool = False


class _Attachment:
    """An optimizer attached to a manager (see :meth:`CheckpointManager.attach`)."""

    def __init__(self, manager: CheckpointManager, optimizer: torch.optim.Optimizer, hook: Any) -> None:
        self.manager, self.optimizer, self._hook = manager, optimizer, hook

    def remove(self) -> None:
        """Detach: wait for a copy in flight, drop the step pre-hook."""
        if self in self.manager._attached:
            if self.manager.memory is not None:
                self.manager.memory.wait_idle()
            self.manager._attached.remove(self)
            self._hook.remove()


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
        link: the worker's link to its agent (default: from the environment): every :meth:`save` counts a
            step there, durable checkpoints go to round-stamped directories and are published only after
            the agent confirms the round is still current (docs/checkpoints.md, "Stale writers").

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
        link: AgentLink | None = None,
    ) -> None:
        self.cfg = cfg
        self.link = link if link is not None else AgentLink.from_env()
        #: The step this world started from (what :meth:`restore` found; 0 when fresh).
        self.base = 0
        #: The round this world's checkpoints carry (its rendezvous round, or above the run's earlier ones);
        #: set by :meth:`restore`, None outside a rendezvous round.
        self.stamp: int | None = self.link.round
        self.run_id = run_id
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.device = device or torch.device("cpu")
        self.storage = open_storage(cfg.url, cfg.storage_options, direct_io=cfg.direct_io)
        self.run_path = self.storage.join(self.storage.root, run_id)
        self._ctl: Any = None
        self._io: Any = None
        #: Whether every node reads what the others write under the URL (checked by the first restore).
        self._shared_check: SharedStorageCheck | None = None
        if group is not None and world_size > 1:
            ranks = dist.get_process_group_ranks(group)
            self._ctl = dist.new_group(ranks=ranks, backend="gloo")
            self._io = dist.new_group(ranks=ranks, backend="gloo")
            self._shared_check = SharedStorageCheck(
                self.storage,
                self.run_path,
                cfg.url,
                rank=dist.get_rank(self._ctl),
                local_rank=local_rank,
                gather=self._all_gather,
            )
        self.memory: MemorySnapshot | None = None
        if cfg.memory:
            import os

            if os.path.isdir(cfg.memory_dir):
                for path in sweep_stale(cfg.memory_dir):
                    log.info("memory_snapshot_swept", path=path)
                self.memory = MemorySnapshot(cfg.memory_dir, run_id, local_rank)
            else:
                log.warning("memory_tier_disabled", reason=f"{cfg.memory_dir} does not exist")
        self._staging: torch.Tensor | None = None
        self._last_durable_time = time.monotonic()
        self._last_durable_step: int | None = None
        self._durable_ok_step: int | None = None
        self.last_committed: Committed | None = None
        self._failure: CheckpointError | None = None
        self._cond = threading.Condition()
        self._job: _Job | None = None
        self._busy = False
        self._stop = False
        self._closed = False
        self._writer: threading.Thread | None = None
        self._attached: list[_Attachment] = []
        self._defer_cache: tuple[Any, int, frozenset[int]] | None = None
        self._live: int | None = None
        #: The lineage record's write in flight during a restore (rank 0), and what it raised.
        self._lineage: tuple[threading.Thread, list[BaseException]] | None = None

    @property
    def coordinated(self) -> bool:
        return self._io is not None

    @property
    def _lanes(self) -> tuple[Any, ...]:
        """The groups a restored state streams over (:func:`transfer.lane`): two connections per link."""
        return (self._ctl, self._io)

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
        started = time.perf_counter()
        again: int | None = None
        self._live = live
        # The restored bytes stream over both groups of the manager (transfer.lane): its writer must be idle.
        self.wait()
        if self._shared_check is not None:  # a node new to the run: is the URL the same storage for all?
            self._shared_check.run()
        # Each failed attempt marks one torn slot at least, or stops one rank from trusting its live tensors:
        # a bounded number of them, the same on every rank.
        for _ in range(self.world_size * (SLOTS + 1) + 1):
            # The lineage record is written before the world trains a step (and before an attempt records
            # again); a failed attempt's own error is the one raised.
            try:
                result = self._restore_once(model, into, started, again)
            except BaseException:
                self._lineage_written(quiet=True)
                raise
            self._lineage_written()
            if result is not _RETRY:
                return result  # type: ignore[return-value]
            again = self.stamp
        raise CheckpointError("restore: every shared-memory snapshot found failed its checksum")

    def _restore_once(
        self, model: Mapping[str, Any] | None, into: Any, started: float, again: int | None
    ) -> Restored | object | None:
        """One attempt of :meth:`restore`; :data:`_RETRY` when a slot read on some rank was torn."""
        # The decider lists the durable checkpoints first: while the others look up their snapshots.
        decider = self.rank == 0 or not self.coordinated
        listed = self._list_durable() if decider else None
        # Header and metadata verified here; the data as it is read below (DataCheck).
        held = self.memory.newest_valid(verify_data=False) if self.memory is not None else None
        mine = held.step if held is not None else None
        mem_steps: list[int | None]
        if self.coordinated:
            mem_steps = self._gather_steps(mine)
        else:  # this rank decides alone
            mem_steps = [None for _ in range(self.rank)]
            mem_steps.append(mine)
        loaded: tuple[Any, list[TensorSpec], torch.Tensor] | None = None
        decision = RestoreDecision()
        if decider:
            try:
                decision, loaded = self._decide(mem_steps, listed)
                # A second attempt (a torn slot) records its base again under the same round.
                decision = dataclasses.replace(decision, stamp=self._record_start(decision, again))
                decision = self._with_meta(decision, mem_steps, held, loaded)
            except CheckpointError as exc:  # every rank raises it, of the same kind
                decision = RestoreDecision(error=str(exc), setup_error=isinstance(exc, CheckpointSetupError))
        if self.coordinated:
            decision = transfer.broadcast_small(decision, src=self._global(0), group=self._ctl)
        decision.check()
        self.base = decision.chosen.step if decision.chosen is not None else 0
        self.stamp = decision.stamp
        if decision.chosen is None:
            log.info("restore_nothing_found", run=self.run_path)
            return None
        source, step = decision.chosen.source, decision.chosen.step
        me = self.rank
        holders, src, receivers = self._routes(decision, mem_steps)
        chain = [self._global(r) for r in [src, *receivers]] if receivers else []
        check: DataCheck | None = None
        # This rank's live tensors hold the step already: hashed where they are, not read from the slot.
        in_place = self._live is not None and self._live == step and me in holders and source == "memory"
        if me in holders and source == "memory":
            assert held is not None and self.memory is not None and held.step == step
            skeleton, specs, nbytes = held.skeleton, list(held.specs), held.nbytes
            if held.data_sum is not None:
                check = DataCheck(held.data_sum, held.nbytes)
        elif me in holders:
            assert loaded is not None
            skeleton, specs, buf = loaded[0], list(loaded[1]), loaded[2]
            nbytes = int(buf.numel())
        if decision.meta is not None:  # rank 0 sends: the metadata came with the decision
            if me not in holders:
                skeleton, spec_json, nbytes = decision.meta
                specs = [TensorSpec.from_json(s) for s in spec_json]
        elif me == src and receivers:
            transfer.send_meta(
                (skeleton, [s.to_json() for s in specs], nbytes), dsts=chain[1:], group=self._ctl
            )
        elif me not in holders:
            skeleton, spec_json, nbytes = transfer.recv_meta(src=chain[0], group=self._ctl)
            specs = [TensorSpec.from_json(s) for s in spec_json]
        found = time.perf_counter()
        if model is not None:  # before a byte lands anywhere (every rank sees the same specs)
            why = describe_mismatch(fingerprint_from_specs(specs), model_fingerprint({"model": model}) or [])
            if why:
                raise ModelMismatch(f"checkpoint at step {step} ({source}) is from a different model: {why}")
        chunks = transfer.plan(specs, nbytes)
        prepared = 0.0
        if me in holders and source != "memory":
            # A checkpoint read from storage is this rank's own buffer: its tensors are views into it.
            if receivers:
                transfer.send(buf, chunks, chain=chain, group=self._lanes)
            tensors, live = [tensor_at(buf, s) for s in specs], 0
        else:
            landing = transfer.Landing(specs, into(specs) if into is not None else None)
            prepared = time.perf_counter()
            if me in holders:  # read from the slot into the live tensors, hashed, sent on from there
                assert held is not None and self.memory is not None
                reader = self.memory.reader(held.slot)
                try:
                    if me == src and receivers:
                        transfer.send(
                            reader, chunks, chain=chain, group=self._lanes, check=check, landing=landing,
                            live=in_place,
                        )  # fmt: skip
                    else:
                        transfer.land_own(reader, chunks, landing, check, live=in_place)
                finally:
                    reader.close()
            else:
                transfer.receive(chunks, landing, chain=chain, rank=self._global(me), group=self._lanes)
            tensors, live = landing.tensors, landing.live
        moved = time.perf_counter()
        if source == "memory" and self._torn_anywhere(check, held, live=in_place):
            return _RETRY
        sent = time.perf_counter()
        state = unflatten(skeleton, tensors)
        self._last_durable_time = time.monotonic()
        if source == "durable":
            self._durable_ok_step = step
        log.info(
            "restored",
            source=source,
            step=step,
            holder=src if source == "memory" else None,
            bytes=nbytes,
            live_bytes=live,  # landed straight in the tensors the state is loaded into
            own=me in holders and source == "memory",  # this rank held the step: nothing was sent to it
            in_place=in_place,  # its live tensors held the step: hashed in place, not read from the slot
            receivers=len(receivers),
            find_s=round(found - started, 4),  # newest snapshot found (header, metadata), decision agreed
            broadcast_s=round(sent - found, 4) if receivers else 0.0,  # sent, received, landed, verified
            # of which: the landing prepared (the live tensors looked up), then the bytes moved (read, hashed,
            # sent or received, landed); the rest is the verdict agreed on
            prepare_s=round(prepared - found, 4) if prepared else 0.0,
            move_s=round(moved - prepared, 4) if prepared else 0.0,
            seconds=round(time.perf_counter() - started, 4),
        )
        return Restored(
            step=step, state=state, source=source, holder_rank=src if source == "memory" else None
        )

    def _routes(
        self, decision: RestoreDecision, mem_steps: list[int | None]
    ) -> tuple[list[int], int, list[int]]:
        """Who takes part in moving the decided state: (the ranks that hold it, the one that sends it, the
        ranks it is sent to), the same on every rank."""
        assert decision.chosen is not None
        me = self.rank
        if not self.coordinated:  # this rank decided alone, on what it found itself
            return [me], me, []
        if decision.chosen.source == "memory":
            # Every rank that holds the step lands its own (nothing is sent to it); the lowest one sends.
            holders = [r for r, s in enumerate(mem_steps) if s == decision.chosen.step]
            src = holders[0] if decision.chosen.holder is None else decision.chosen.holder
        else:  # a checkpoint rank 0 read from storage (and verified)
            holders, src = [0], 0
        return holders, src, [r for r in range(self.world_size) if r not in holders]

    def _with_meta(
        self,
        decision: RestoreDecision,
        mem_steps: list[int | None],
        held: Held | None,
        loaded: tuple[Any, list[TensorSpec], torch.Tensor] | None,
    ) -> RestoreDecision:
        """Rank 0's decision with the state's metadata in it when rank 0 is the one to send the state."""
        if not self.coordinated or decision.chosen is None:
            return decision
        _, src, receivers = self._routes(decision, mem_steps)
        if src != self.rank or not receivers:
            return decision
        if decision.chosen.source == "memory":
            assert held is not None and held.step == decision.chosen.step
            meta = (held.skeleton, [s.to_json() for s in held.specs], held.nbytes)
        else:
            assert loaded is not None
            meta = (loaded[0], [s.to_json() for s in loaded[1]], int(loaded[2].numel()))
        return dataclasses.replace(decision, meta=meta)

    def _torn_anywhere(self, check: DataCheck | None, held: Held | None, *, live: bool = False) -> bool:
        """The verdict (collective): whether any rank's slot failed its checksum while it was read; that
        rank marks its slot torn, so the next attempt finds an older one (or none). A rank that hashed its
        live tensors (``live``) instead reads the slot next time: it is they that may differ."""
        torn = check is not None and not check.ok()
        if torn and live:
            log.warning("restore_live_state_differs", step=self._live)
            self._live = None
        elif torn:
            assert self.memory is not None and held is not None
            self.memory.invalidate(held.slot)
        if not self.coordinated:
            return torn
        flag = torch.tensor([int(torn)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._ctl)
        return bool(flag.item())

    def _record_start(self, decision: RestoreDecision, again: int | None = None) -> int | None:
        """Rank 0 of a world in a rendezvous round records where it starts (the stale-writer rule reads it);
        the round its checkpoints are stamped with (``again``: the one an earlier attempt recorded).

        The record is written by a thread while the state moves (on remote storage a write costs a round
        trip or more); :meth:`restore` waits for it before it returns (:meth:`_lineage_written`).
        """
        if self.link.round is None:
            return None
        round_, base = self.link.round, decision.chosen.step if decision.chosen is not None else 0
        try:
            stamp, record = durable.plan_start(self.storage, self.run_path, round_, base, again=again)
        except StorageError as exc:  # the manifests' own records still fence later; not worth a restart
            log.warning("lineage_not_recorded", round=round_, base=base, error=str(exc))
            return round_
        path = self.storage.join(self.run_path, durable.LINEAGE)
        failed: list[BaseException] = []

        def write() -> None:
            try:
                self.storage.write_small(path, record)
            except StorageError as exc:  # as above: not worth a restart
                log.warning("lineage_not_recorded", round=round_, base=base, error=str(exc))
            except BaseException as exc:  # raised by the restore, as if written there
                failed.append(exc)

        thread = threading.Thread(target=write, name="ckpt-lineage", daemon=True)
        thread.start()
        self._lineage = (thread, failed)
        return stamp

    def _lineage_written(self, *, quiet: bool = False) -> None:
        """Wait for the lineage record of :meth:`_record_start`; raise what its write raised (other than a
        storage error, which is logged) unless ``quiet``."""
        pending, self._lineage = self._lineage, None
        if pending is None:
            return
        thread, failed = pending
        thread.join()
        if failed and not quiet:
            raise failed[0]

    def _list_durable(self) -> list[durable.Entry] | CheckpointError:
        """The run's durable checkpoints (:func:`durable.list_entries`), or the error listing them raised
        (:meth:`_decide` raises it, after the collective that waits for this rank)."""
        try:
            return durable.list_entries(self.storage, self.run_path)
        except CheckpointError as exc:
            return exc

    def _decide(
        self, mem_steps: list[int | None], listed: list[durable.Entry] | CheckpointError | None = None
    ) -> tuple[RestoreDecision, Any]:
        if listed is None:
            listed = self._list_durable()
        if isinstance(listed, CheckpointError):
            raise listed
        entries = listed
        for e in entries:
            if not e.valid:
                log.warning("checkpoint_invalid", path=e.path, reason=e.problem)
        by_step = {e.step: e for e in entries if e.valid}
        for cand in restore_plan(mem_steps, sorted(by_step)):
            if cand.source == "memory":
                return RestoreDecision(cand), None
            try:
                entry, _ = by_step[cand.step], None
                buf, specs = durable.load(self.storage, entry)
            except CheckpointError as exc:
                log.warning("checkpoint_skipped", path=by_step[cand.step].path, reason=str(exc))
                continue
            assert entry.manifest is not None
            return RestoreDecision(cand), (entry.manifest["skeleton"], specs, buf)
        if self.cfg.resume_from:
            check_resume_source(self.cfg.resume_from, self.cfg.storage_options)  # one precise line
            store = open_storage(self.cfg.resume_from, self.cfg.storage_options)
            _, cands = durable.resolve(store, store.root)
            try:
                entry, buf, specs = durable.load_newest(
                    store, cands, what=f"checkpoint in {self.cfg.resume_from}"
                )
            except CheckpointNotFound as exc:  # the same at every attempt: not worth a restart
                raise CheckpointSetupError(f"resume_from {self.cfg.resume_from}: {exc}") from exc
            assert entry.manifest is not None
            decision = RestoreDecision(Candidate("resume_from", entry.step))
            return decision, (entry.manifest["skeleton"], specs, buf)
        return RestoreDecision(), None

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self._ctl, group_rank)

    def _gather_steps(self, step: int | None) -> list[int | None]:
        """Every rank's newest snapshot step (None: it holds none), in rank order: one all-gather of an
        integer each, where an object all-gather takes two collectives and pickling (about 5 ms inside a
        busy job against 1-2 ms)."""
        mine = torch.tensor([-1 if step is None else step], dtype=torch.int64)
        out = [torch.empty(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=self._ctl)
        return [None if int(t.item()) < 0 else int(t.item()) for t in out]

    def _all_gather(self, obj: Any, group: Any = None) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=group or self._ctl)
        return out

    # -- save --------------------------------------------------------------------------------------------
    def save(self, step: int, state: Mapping[str, Any] | Callable[[], Mapping[str, Any] | Flat]) -> None:
        """Call after every optimizer step (on every rank): memory tier and, when due, a durable checkpoint.

        ``state`` may be a function returning it: it is then called only when a snapshot or a checkpoint
        is due at this step. The function may return the state already flattened (a :class:`Flat`, e.g.
        :meth:`elastic_train.TrainState.snapshot`, planned once and reused while its structure holds).

        Raises:
            WriteFailed: a previous durable write failed (``on_error`` retry after its retries, or fatal).
            CheckpointError: the state holds something that cannot be checkpointed.
        """
        self._check_open()
        self.link.beat()
        self._raise_pending()
        mem_due = self.memory is not None and step % self.cfg.memory_every_steps == 0
        dur_due = self._durable_due(step)
        if mem_due or dur_due:
            self._save(step, state, dur_due)

    def save_before_leaving(
        self, step: int, state: Mapping[str, Any] | Callable[[], Mapping[str, Any] | Flat]
    ) -> bool:
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

    def _save(
        self, step: int, state: Mapping[str, Any] | Callable[[], Mapping[str, Any] | Flat], dur_due: bool
    ) -> None:
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
            # Which tensors the copier may copy later is decided once per plan; a small state is copied
            # whole inside the memory tier's save anyway.
            cached = self._defer_cache
            if cached is not None and cached[0] is flat.specs and cached[1] == len(self._attached):
                defer = cached[2]
            else:
                defer = self._deferrable(flat)
            slot = self.memory.save(step, flat, defer=defer)
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
    def _replanned(state: Mapping[str, Any] | Callable[[], Mapping[str, Any] | Flat]) -> Flat:
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
        attachment = _Attachment(self, optimizer, optimizer.register_step_pre_hook(self._fence_hook))
        self._attached.append(attachment)
        return attachment

    def _fence_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.fence()

    def fence(self) -> None:
        """Wait until the last snapshot no longer reads the parameters and optimizer state.

        Raises:
            CheckpointError: the background copy into shared memory failed.
        """
        if self.memory is not None:
            self.memory.fence()

    def _deferrable(self, flat: Flat) -> frozenset[int]:
        """Indices of the tensors of ``flat`` that only an attached optimizer's step changes."""
        if not self._attached:
            return frozenset()
        # A planned snapshot hands over the same specs while its tensors are the same: decided once per plan.
        cached = self._defer_cache
        if cached is not None and cached[0] is flat.specs and cached[1] == len(self._attached):
            return cached[2]
        defer = self._owned_by_optimizers(flat)
        self._defer_cache = (flat.specs, len(self._attached), defer)
        return defer

    def _owned_by_optimizers(self, flat: Flat) -> frozenset[int]:
        owned: set[int] = set()
        for opt in (a.optimizer for a in self._attached):
            for group in opt.param_groups:
                owned.update(p.data_ptr() for p in group["params"])
            for per_param in opt.state.values():
                owned.update(v.data_ptr() for v in per_param.values() if isinstance(v, torch.Tensor))
        return frozenset(i for i, t in enumerate(flat.tensors) if t.data_ptr() in owned)

    def _due_here(self, step: int) -> bool:
        """Whether a durable checkpoint is due after ``step`` by this rank's own count and clock."""
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

    def _submit(self, step: int, flat: Flat, slot: int | None, *, final: bool = False) -> None:
        self.wait()
        self._raise_pending()
        if slot is not None and self.memory is not None:
            # The writer reads the step straight from its shared-memory slot (pinned until the write ends).
            self.memory.pin(slot)
        else:
            if self._staging is None or self._staging.numel() < flat.nbytes:
                # Page-aligned (shares can be written with O_DIRECT) and zeroed (the padding between tensors
                # is written too, and must not carry stale process memory).
                self._staging = aligned_zeros(flat.nbytes, SHARE_ALIGN)
            copy_into(flat, self._staging)
        job = _Job(step, flat, slot, time.monotonic(), final)
        self._last_durable_time = time.monotonic()
        self._last_durable_step = step
        if not self.cfg.async_write:
            self._run_job(job)
            self._raise_pending()
            return
        with self._cond:
            if self._writer is None:
                self._writer = threading.Thread(target=self._writer_loop, name="ckpt-writer", daemon=True)
                self._writer.start()
            self._job = job
            self._busy = True
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
                    self._job = None
                    self._busy = False
                    self._cond.notify_all()

    def _run_job(self, job: _Job) -> None:
        """Write one durable checkpoint (all ranks in step), retrying per ``on_error``; never raises."""
        try:
            self._write_job(job)
        finally:
            if job.slot is not None and self.memory is not None:
                self.memory.unpin(job.slot)

    def _write_job(self, job: _Job) -> None:
        try:
            n = job.flat.nbytes
            if job.slot is not None and self.memory is not None:
                source = self.memory.data(job.slot, n)
            else:
                assert self._staging is not None
                source = self._staging[:n]
            # The final checkpoint is the result of the job: it is always retried, and never lost silently.
            retrying = self.cfg.on_error == "retry" or job.final
            attempts = max(self.cfg.retries, FINAL_ATTEMPTS if job.final else 1) if retrying else 1
            error = None
            for attempt in range(1, attempts + 1):
                error = self._write_once(job, source)
                if error == _UNPUBLISHED:  # the gate said no (logged by rank 0): nothing to retry
                    if job.final:  # a stale world: its result is not the job's
                        self._failure = WriteFailed(
                            f"final checkpoint of step {job.step} not published: round {self.link.round} is "
                            "no longer the run's current round"
                        )
                    return
                if error is None:  # the outcome is broadcast: every rank records the same step
                    self._durable_ok_step = job.step
                    return
                log.warning(
                    "checkpoint_write_failed", step=job.step, attempt=attempt, attempts=attempts, error=error
                )
                if attempt < attempts:  # storage outages are usually short: back off (same on every rank)
                    time.sleep(retry_delay(attempt))
            failure = WriteFailed(f"durable checkpoint of step {job.step} failed: {error}")
        except Exception as exc:  # a bug or a broken process group: report it, never die silently
            log.error("checkpoint_writer_crashed", step=job.step, error=repr(exc))
            failure = WriteFailed(f"durable checkpoint of step {job.step} failed: {exc!r}")
        if self.cfg.on_error == "log" and not job.final:
            log.error("checkpoint_lost", step=job.step, error=str(failure))
        else:
            self._failure = failure

    def _write_once(self, job: _Job, source: torch.Tensor) -> str | None:
        """One collective attempt: every rank writes its share, rank 0 commits. Returns the error or None."""
        specs = job.flat.specs
        world = self.world_size if self.coordinated else 1
        me = self.rank if self.coordinated else 0
        if not self.coordinated and self.rank != 0:
            return None
        start, end = share_ranges(job.flat.nbytes, world)[me]
        path = self.storage.join(self.run_path, step_dir(job.step, self.stamp))
        record, error = None, None
        if end > start:
            try:
                pool = durable.pool_path(self.storage, self.run_path) if self.cfg.recycle else None
                record = durable.write_share(self.storage, path, me, source, start, end, pool=pool)
            except Exception as exc:
                error = f"rank {self.rank}: {exc}"
        key = layout_key(specs)
        mine = (record, error, key)
        gathered = self._all_gather(mine, self._io) if self.coordinated else [mine]
        outcome: list[Any] = [None]
        if me == 0:
            errors = [e for _, e, _ in gathered if e]
            if any(k != key for _, _, k in gathered):
                errors.append("ranks hold states of different layouts (is the state replicated?)")
            if not errors:
                try:
                    if not self._commit(job, [r for r, _, _ in gathered if r is not None]):
                        outcome[0] = _UNPUBLISHED
                except Exception as exc:
                    errors.append(f"commit: {exc}")
            if errors:
                outcome[0] = "; ".join(errors)
        if self.coordinated:
            dist.broadcast_object_list(outcome, src=dist.get_global_rank(self._io, 0), group=self._io)
        return outcome[0]

    def _commit(self, job: _Job, records: list[Any]) -> bool:
        flat = job.flat
        sampler = flat.skeleton.get("sampler") if isinstance(flat.skeleton, dict) else None
        manifest = durable.build_manifest(
            run_id=self.run_id,
            step=job.step,
            world_size=self.world_size,
            skeleton=flat.skeleton,
            specs=flat.specs,
            shares=records,
            sampler=sampler,
            nbytes=flat.nbytes,
            round=self.stamp,
            base=self.base,
        )
        if not self._may_publish(job):
            return False
        path = durable.commit(self.storage, self.run_path, manifest, lambda: self._may_publish(job))
        if path is None:
            return False
        seconds = time.monotonic() - job.started
        self.last_committed = Committed(job.step, path, int(manifest["bytes"]), seconds)
        log.info(
            "checkpoint_committed",
            step=job.step,
            path=path,
            bytes=manifest["bytes"],
            seconds=round(seconds, 3),
        )
        for gone in durable.prune(
            self.storage,
            self.run_path,
            keep_last=self.cfg.keep_last,
            keep_every=self.cfg.keep_every,
            current=job.step,
            # The final checkpoint empties the pool of retired files: no later save will reuse them.
            recycle_bytes=0 if job.final or not self.cfg.recycle else int(manifest["bytes"]),
            round=self.stamp,
        ):
            log.info("checkpoint_removed", path=gone)
        return True

    def _may_publish(self, job: _Job) -> bool:
        """The publish gate: whether this world's round is still current (always, outside an agent).

        Raises:
            CheckpointError: the final checkpoint could not be confirmed (its write is retried).
        """
        answer = self.link.may_publish()
        if answer == CURRENT:
            return True
        if job.final and answer != STALE:
            # The result of the job is not held back by an etcd that does not answer: if this world were
            # stale, the later world's lineage record still keeps this checkpoint from being the newest.
            log.warning("checkpoint_final_unconfirmed", step=job.step, round=self.link.round)
            return True
        log.warning(
            "checkpoint_fenced" if answer == STALE else "checkpoint_unconfirmed",
            step=job.step,
            round=self.link.round,
            reason="a newer round formed without this world"
            if answer == STALE
            else "etcd did not confirm this round in time; the memory tier goes on, a later save retries",
        )
        return False

    # -- waiting and ending ------------------------------------------------------------------------------
    def wait(self) -> None:
        """Block until no durable write is in flight (does not raise its failure; see save/finalize).

        While it waits the worker still counts as making progress for its agent's fence: it waits for its
        own writer (held up, say, by the publish gate during an etcd outage), not for peers that left.
        """
        with self._cond:
            while self._busy:
                if not self._cond.wait(timeout=_BEAT_WHILE_WAITING):
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
        """Commit a final durable checkpoint (collective), wait for it, release shared memory.

        Returns:
            The final checkpoint as committed by this rank's view (None on ranks other than 0).

        Raises:
            WriteFailed: the final (or an earlier) durable write failed and ``on_error`` is not ``log``.
        """
        self._check_open()
        try:
            if self.memory is not None:
                self.memory.wait_idle()
            self.wait()  # a regular checkpoint of this very step, still in flight, is the final one
            self._raise_pending()
            if step != self._durable_ok_step:  # also when the regular checkpoint of this step failed
                self._submit(step, flatten(state), None, final=True)
            self.wait()
            self._raise_pending()
            if self.rank == 0 and self.storage.recycles:  # no later save reuses retired files
                durable.trim_pool(self.storage, durable.pool_path(self.storage, self.run_path), 0)
        finally:
            self._shutdown(release_memory=True)
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
        for attachment in list(self._attached):
            attachment.remove()
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._writer is not None:
            self._writer.join(timeout)
        writer_done = self._writer is None or not self._writer.is_alive()
        if self.memory is not None:
            if release_memory:
                self.memory.release()
                if self.local_rank == 0:
                    self._release_siblings()
            else:
                self.memory.detach()
        if writer_done:
            for g in (self._ctl, self._io):
                if g is not None:
                    try:
                        dist.destroy_process_group(g)
                    except Exception as exc:  # the default group may already be gone
                        log.debug("checkpoint_group_destroy_failed", error=str(exc))
            self._ctl = self._io = None

    def _release_siblings(self) -> None:
        """Delete this owner's snapshots of other local ranks of the run (the world shrank meanwhile)."""
        import os

        assert self.memory is not None
        prefix = self.memory.path.rsplit(".", 1)[0] + "."
        for path in snapshot_files(self.cfg.memory_dir, self.run_id):
            if path.startswith(prefix) and path != self.memory.path:
                try:
                    os.unlink(path)
                    log.info("memory_snapshot_released", path=path)
                except FileNotFoundError:
                    pass
