"""The collective restore: which state every rank resumes from, and moving it to the ranks without it.

First, when the world has a node new to the run, every node checks that the checkpoint URL is one storage for
all of them (:mod:`elastic_train.checkpoint.probe`). Then one attempt: every rank looks up its newest
shared-memory snapshot (header and metadata verified), rank 0 lists the durable checkpoints meanwhile, one
all-gather of the steps, and rank 0 decides (:func:`~elastic_train.checkpoint.policy.restore_order`, then
loading a durable candidate or ``resume_from``) and broadcasts the :class:`RestoreDecision`. The ranks that
hold the chosen step land their own; the lowest of them sends it to the others along a chain
(:mod:`elastic_train.checkpoint.transfer`). A slot's data is verified as it is read, and the ranks agree on
the verdict afterwards: a torn slot is marked so and every rank looks again. Rank 0 of a world in a rendezvous
round records where the world starts (the run's lineage) while the state moves.

What the state *is* (its flat layout and specs) is :mod:`elastic_train.checkpoint.codec`'s; this module
decides where it comes from and moves it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastic_train.checkpoint import durable, transfer
from elastic_train.checkpoint.agent import Agent
from elastic_train.checkpoint.codec import model_fingerprint, tensor_at, unflatten
from elastic_train.checkpoint.config import CheckpointConfig
from elastic_train.checkpoint.errors import (
    CheckpointError,
    CheckpointNotFound,
    CheckpointSetupError,
    ModelMismatch,
)
from elastic_train.checkpoint.groups import Groups
from elastic_train.checkpoint.memory import MemorySnapshot
from elastic_train.checkpoint.policy import Candidate, restore_order
from elastic_train.checkpoint.preflight import check_resume_source
from elastic_train.checkpoint.probe import SharedStorageCheck
from elastic_train.checkpoint.slots import SLOTS, DataCheck, Held
from elastic_train.checkpoint.specs import TensorSpec, describe_mismatch, fingerprint_from_specs
from elastic_train.checkpoint.storage import Storage, open_storage
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


@dataclass(slots=True)
class Origin:
    """Where this world starts in the run's lineage: what its durable checkpoints carry."""

    stamp: int | None
    """The round this world's checkpoints carry (its rendezvous round, or above the run's earlier ones);
    None outside a rendezvous round."""
    base: int = 0
    """The step this world started from (what the restore found; 0 when fresh)."""


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
    """The round this world's checkpoints are stamped with (:func:`durable.lineage_start`)."""
    meta: tuple[Any, list[Any], int] | None = None
    """The chosen state's (skeleton, specs as JSON, bytes) when rank 0 sends it (it holds the step or read
    it from storage) and some rank does not hold it: the receivers take it from here instead of from a
    message of its own."""

    def check(self) -> None:
        """Raise the decided error, if any (the same type and line on every rank)."""
        if self.error is not None:
            raise (CheckpointSetupError if self.setup_error else CheckpointError)(self.error)


#: What an attempt returns when a slot turned out torn on some rank.
_RETRY = object()

#: A state read from storage: (skeleton, specs, its flat buffer).
Loaded = tuple[Any, list[TensorSpec], torch.Tensor]


class Restorer:
    """The restore of one manager (see the module docstring); :meth:`restore` is its one entry."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        storage: Storage,
        run_path: str,
        *,
        groups: Groups,
        memory: MemorySnapshot | None,
        agent: Agent,
        origin: Origin,
        local_rank: int = 0,
    ) -> None:
        self.cfg = cfg
        self.storage = storage
        self.run_path = run_path
        self.groups = groups
        self.memory = memory
        self.agent = agent
        self.origin = origin
        self.rank = groups.rank
        self.local_rank = local_rank
        self.world_size = groups.world_size
        #: The step this process's live tensors hold (see :meth:`restore`'s ``live``), until they differ.
        self._live: int | None = None
        #: The lineage record's write in flight (rank 0), and what it raised.
        self._lineage: durable.LineageWrite | None = None

    def restore(
        self,
        model: Mapping[str, Any] | None,
        into: Callable[[Sequence[TensorSpec]], Sequence[torch.Tensor | None]] | None,
        live: int | None,
    ) -> Restored | None:
        """Collective: :meth:`CheckpointManager.restore` (its arguments and result); updates :attr:`origin`.

        Raises:
            CheckpointError: storage failure, an unreadable ``resume_from`` or a model mismatch.
            CheckpointSetupError: the nodes do not share the checkpoint URL (every rank raises it).
        """
        started = time.perf_counter()
        again: int | None = None
        self._live = live
        if self.groups.coordinated:  # a node new to the run: is the URL one storage for every node?
            SharedStorageCheck(
                self.storage,
                self.run_path,
                self.cfg.url,
                rank=self.rank,
                local_rank=self.local_rank,
                gather=self.groups.gather_object,
            ).run()
        # Each failed attempt marks one torn slot at least, or stops one rank from trusting its live tensors:
        # a bounded number of them, the same on every rank.
        for _ in range(self.world_size * (SLOTS + 1) + 1):
            # The lineage record is written before the world trains a step (and before an attempt records
            # again); a failed attempt's own error is the one raised.
            try:
                result = self._attempt(model, into, started, again)
            except BaseException:
                self._lineage_written(quiet=True)
                raise
            self._lineage_written()
            if result is not _RETRY:
                return result  # type: ignore[return-value]
            again = self.origin.stamp
        raise CheckpointError("restore: every shared-memory snapshot found failed its checksum")

    def _attempt(
        self, model: Mapping[str, Any] | None, into: Any, started: float, again: int | None
    ) -> Restored | object | None:
        """One attempt of :meth:`restore`; :data:`_RETRY` when a slot read on some rank was torn."""
        coordinated = self.groups.coordinated
        # The decider lists the durable checkpoints first: while the others look up their snapshots.
        decider = self.rank == 0 or not coordinated
        listed = durable.listing(self.storage, self.run_path) if decider else None
        # Header and metadata verified here; the data as it is read below (DataCheck).
        held = self.memory.newest_valid(verify_data=False) if self.memory is not None else None
        mine = held.step if held is not None else None
        mem_steps: list[int | None]
        if coordinated:
            mem_steps = self._gather_steps(mine)
        else:  # this rank decides alone
            mem_steps = [None for _ in range(self.rank)]
            mem_steps.append(mine)
        loaded: Loaded | None = None
        decision = RestoreDecision()
        if decider:
            try:
                decision, loaded = self._decide(mem_steps, listed)
                # A second attempt (a torn slot) records its base again under the same round.
                decision = dataclasses.replace(decision, stamp=self._record_start(decision, again))
                decision = self._with_meta(decision, mem_steps, held, loaded)
            except CheckpointError as exc:  # every rank raises it, of the same kind
                decision = RestoreDecision(error=str(exc), setup_error=isinstance(exc, CheckpointSetupError))
        if coordinated:
            decision = transfer.broadcast_small(
                decision, src=self.groups.global_rank(0), group=self.groups.ctl
            )
        decision.check()
        self.origin.base = decision.chosen.step if decision.chosen is not None else 0
        self.origin.stamp = decision.stamp
        if decision.chosen is None:
            log.info("restore_nothing_found", run=self.run_path)
            return None
        source, step = decision.chosen.source, decision.chosen.step
        me = self.rank
        holders, src, receivers = self._roles(decision, mem_steps)
        chain = [self.groups.global_rank(r) for r in [src, *receivers]] if receivers else []
        ctl, lanes = self.groups.ctl, self.groups.lanes
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
            transfer.send_meta((skeleton, [s.to_json() for s in specs], nbytes), dsts=chain[1:], group=ctl)
        elif me not in holders:
            skeleton, spec_json, nbytes = transfer.recv_meta(src=chain[0], group=ctl)
            specs = [TensorSpec.from_json(s) for s in spec_json]
        found = time.perf_counter()
        if model is not None:  # before a byte lands anywhere (every rank sees the same specs)
            why = describe_mismatch(fingerprint_from_specs(specs), model_fingerprint({"model": model}) or [])
            if why:
                raise ModelMismatch(f"checkpoint at step {step} ({source}) is from a different model: {why}")
        chunks = transfer.chunks_of(specs, nbytes)
        prepared = 0.0
        if me in holders and source != "memory":
            # A checkpoint read from storage is this rank's own buffer: its tensors are views into it.
            if receivers:
                transfer.send(buf, chunks, chain=chain, group=lanes)
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
                            reader, chunks, chain=chain, group=lanes, check=check, landing=landing,
                            live=in_place,
                        )  # fmt: skip
                    else:
                        transfer.land_own(reader, chunks, landing, check, live=in_place)
                finally:
                    reader.close()
            else:
                transfer.receive(chunks, landing, chain=chain, rank=self.groups.global_rank(me), group=lanes)
            tensors, live = landing.tensors, landing.live
        moved = time.perf_counter()
        if source == "memory" and self._torn_anywhere(check, held, live=in_place):
            return _RETRY
        sent = time.perf_counter()
        state = unflatten(skeleton, tensors)
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

    def _roles(
        self, decision: RestoreDecision, mem_steps: list[int | None]
    ) -> tuple[list[int], int, list[int]]:
        """Who takes part in moving the decided state: (the ranks that hold it, the one that sends it, the
        ranks it is sent to), the same on every rank."""
        assert decision.chosen is not None
        me = self.rank
        if not self.groups.coordinated:  # this rank decided alone, on what it found itself
            return [me], me, []
        if decision.chosen.source == "memory":
            # Every rank that holds the step lands its own (nothing is sent to it); the lowest one sends.
            holders = [r for r, s in enumerate(mem_steps) if s == decision.chosen.step]
            src = holders[0] if decision.chosen.holder is None else decision.chosen.holder
        else:  # a checkpoint rank 0 read from storage (and verified)
            holders, src = [0], 0
        return holders, src, [r for r in range(self.world_size) if r not in holders]

    def _with_meta(
        self, decision: RestoreDecision, mem_steps: list[int | None], held: Held | None, loaded: Loaded | None
    ) -> RestoreDecision:
        """Rank 0's decision with the state's metadata in it when rank 0 is the one to send the state."""
        if not self.groups.coordinated or decision.chosen is None:
            return decision
        _, src, receivers = self._roles(decision, mem_steps)
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
        if not self.groups.coordinated:
            return torn
        return self.groups.any_rank(torn)

    def _record_start(self, decision: RestoreDecision, again: int | None = None) -> int | None:
        """Rank 0 of a world in a rendezvous round records where it starts (the stale-writer rule reads it);
        the round its checkpoints are stamped with (``again``: the one an earlier attempt recorded).

        The record is written by a thread while the state moves (on remote storage a write costs a round
        trip or more); :meth:`restore` waits for it before it returns (:meth:`_lineage_written`).
        """
        if self.agent.round is None:
            return None
        base = decision.chosen.step if decision.chosen is not None else 0
        self._lineage = durable.LineageWrite(self.storage, self.run_path, self.agent.round, base, again=again)
        return self._lineage.stamp

    def _lineage_written(self, *, quiet: bool = False) -> None:
        """Wait for the lineage record of :meth:`_record_start`; raise what its write raised (other than a
        storage error, which is logged) unless ``quiet``."""
        pending, self._lineage = self._lineage, None
        if pending is not None:
            pending.wait(quiet=quiet)

    def _decide(
        self, mem_steps: list[int | None], listed: list[durable.Entry] | CheckpointError | None = None
    ) -> tuple[RestoreDecision, Loaded | None]:
        if listed is None:
            listed = durable.listing(self.storage, self.run_path)
        if isinstance(listed, CheckpointError):
            raise listed
        entries = listed
        for e in entries:
            if not e.valid:
                log.warning("checkpoint_invalid", path=e.path, reason=e.problem)
        by_step = {e.step: e for e in entries if e.valid}
        for cand in restore_order(mem_steps, sorted(by_step)):
            if cand.source == "memory":
                return RestoreDecision(cand), None
            try:
                entry = by_step[cand.step]
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

    def _gather_steps(self, step: int | None) -> list[int | None]:
        """Every rank's newest snapshot step (None: it holds none), in rank order: one all-gather of an
        integer each, where an object all-gather takes two collectives and pickling (about 5 ms inside a
        busy job against 1-2 ms)."""
        mine = torch.tensor([-1 if step is None else step], dtype=torch.int64)
        out = [torch.empty(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=self.groups.ctl)
        return [None if int(t.item()) < 0 else int(t.item()) for t in out]
