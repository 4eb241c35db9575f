"""The sharded manager's restore: gather what every rank holds, decide, reshard, load (collective).

A mix-in of :class:`~elastic_train.checkpoint.sharded.manager.ShardedCheckpointManager` (its state is the
manager's): :meth:`Restoring.restore` gathers every rank's valid slots, rank 0 decides
(:func:`~elastic_train.checkpoint.sharded.reshard.choose`) and records where this world starts (lineage),
every rank plans the new world's ownership (:func:`~elastic_train.checkpoint.sharded.reshard.plan`), reads
its slots once straight into its new shards, moves the rows others lack point to point
(:mod:`~elastic_train.checkpoint.sharded.move`), reads the rows nobody alive holds from durable storage, and
agrees on the verdict of the slots' checksums.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastic_train.checkpoint import durable, transfer
from elastic_train.checkpoint.codec import dtype_of, unflatten
from elastic_train.checkpoint.errors import (
    CheckpointError,
    CheckpointSetupError,
    ModelMismatch,
)
from elastic_train.checkpoint.restore import Restored
from elastic_train.checkpoint.sharded import dcp, move, reshard
from elastic_train.checkpoint.sharded import manifest as smanifest
from elastic_train.checkpoint.sharded.base import ManagerBase
from elastic_train.checkpoint.sharded.layout import pieces as _pieces
from elastic_train.checkpoint.sharded.layout import read_like as _read_like
from elastic_train.checkpoint.sharded.local import join, live_shards
from elastic_train.checkpoint.sharded.shardmap import ShardMap
from elastic_train.checkpoint.sharded.slots import INFO, Slot
from elastic_train.checkpoint.slots import SLOTS
from elastic_train.checkpoint.specs import TensorSpec, describe_mismatch
from elastic_train.checkpoint.storage import open_storage
from elastic_train.log import get_logger

log = get_logger(__name__)

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


class Restoring(ManagerBase):
    """The restore of :class:`~elastic_train.checkpoint.sharded.manager.ShardedCheckpointManager`."""

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
                self.agent.beat()

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
                # A failed attempt's own error is the one raised, not the lineage write's.
                try:
                    result = self._restore_once(model, again, started)
                except BaseException:
                    self._lineage_written(quiet=True)
                    raise
                self._lineage_written()
                if result is not _RETRY:
                    return result
                again = self.stamp
        finally:
            self._lineage = None
        raise CheckpointError("restore: every shared-memory snapshot found failed its checksum")

    def _restore_once(self, model: Mapping[str, Any], again: int | None, started: float) -> Any:
        # The decider lists the durable checkpoints first (once per attempt: on remote storage each entry
        # costs requests), while the others look up their slots.
        decider = self.rank == 0 or not self.coordinated
        listed = durable.listing(self.storage, self.run_path) if decider else None
        slots = self.memory.slots() if self.memory is not None else []
        holdings = self._gather_holdings(slots)
        decision = _Decision()
        if decider:
            try:
                assert listed is not None
                decision = self._decide(holdings, listed)
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

    def _gather_holdings(self, slots: list[Slot]) -> list[reshard.Holding]:
        """What every rank's valid slots hold (:class:`~.reshard.Holding`, by rank of this world): one
        all-gather of a small integer tensor (an object all-gather takes two collectives and pickling)."""
        mine = [
            h
            for h in ((s.step, s.round, s.world_size, s.rank) for s in slots)
            if all(0 <= v < 1 << 62 for v in h)
        ]
        if not self.coordinated:
            return [reshard.Holding(self.rank, *h) for h in mine]
        most = 2 * SLOTS  # an own and a replica file of SLOTS slots each (newest first in each)
        mine = mine[:most]
        table = torch.full((most, 4), -1, dtype=torch.int64)
        if mine:
            table[: len(mine)] = torch.tensor(mine, dtype=torch.int64)
        out = [torch.empty_like(table) for _ in range(self.world_size)]
        dist.all_gather(out, table, group=self._ctl)
        return [
            reshard.Holding(r, step, round_, world, old)
            for r, rows in enumerate(out)
            for step, round_, world, old in rows.tolist()
            if old >= 0
        ]

    def _decide(
        self, holdings: list[reshard.Holding], listed: list[durable.Entry] | CheckpointError
    ) -> _Decision:
        """Rank 0: which state (memory, this run's durable checkpoints, ``resume_from``)."""
        if isinstance(listed, CheckpointError):
            raise listed
        entries = [e for e in listed if e.valid]
        for e in listed:
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
        # On a GPU (NCCL) the slots are read on the host and the rows move between devices over NCCL.
        device = torch.device(self._mesh.device_type) if self._mesh is not None else torch.device("cpu")
        on_gpu = device.type != "cpu"
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
                dests[path] = torch.empty(shape, dtype=dtype_of(t.dtype), device=device)
        # This rank's slots of the step, each read once, in order and hashed (a torn one fails the verdict):
        # the rows it keeps straight into its new shards, the rows it sends into buffers of their own.
        mine = [s for s in slots if s.step == choice.step and (s.round, s.world_size) == choice.world]
        wanted: dict[int, dict[str, list[tuple[int, int, torch.Tensor | None]]]] = {}
        for p in plan.pieces:
            if p.src == me:
                into = dests[p.path][p.dst_row : p.dst_row + p.rows] if p.dst == me and not on_gpu else None
                wanted.setdefault(p.old, {}).setdefault(p.path, []).append((p.src_row, p.rows, into))
        torn = False
        landing = time.perf_counter()
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
        land_s = t0 - landing
        lanes: Any = (self._ctl, self._io)
        if on_gpu:  # the rows kept were read on the host: to the device; the rows sent go from the device
            for p in plan.pieces:
                if p.src == me and p.dst == me:
                    host = staged.pop((p.path, p.old, p.src_row))
                    dests[p.path][p.dst_row : p.dst_row + p.rows].reshape(-1).view(torch.uint8).copy_(host)
            staged = {key: buf.to(device, non_blocking=True) for key, buf in staged.items()}
            lanes = (dist.group.WORLD,)  # NCCL's point-to-point between devices
        moved = move.execute(
            plan, me, source=lambda p: staged[(p.path, p.old, p.src_row)], dests=dests,
            to_global=self._global, lanes=lanes, durable=fill if reader is not None else None,
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
            from_storage=moved.durable, minimum=minimum, land_s=round(land_s, 4), move_s=round(moved_s, 4),
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
        """Rank 0 records where this world starts (lineage, for the stale-writer rule), in a thread
        (:class:`durable.LineageWrite`); the round its checkpoints are stamped with."""
        if self.agent.round is None:
            return None
        base = decision.choice.step if decision.choice is not None else 0
        self._lineage = durable.LineageWrite(self.storage, self.run_path, self.agent.round, base, again=again)
        return self._lineage.stamp

    def _lineage_written(self, *, quiet: bool = False) -> None:
        pending, self._lineage = self._lineage, None
        if pending is not None:
            pending.wait(quiet=quiet)


def _replace(decision: _Decision, **changes: Any) -> _Decision:
    return dataclasses.replace(decision, **changes)


def _slot_at(slots: list[Slot], choice: reshard.Choice, kind: str | None = None) -> Slot | None:
    for s in slots:
        if s.step == choice.step and (s.round, s.world_size) == choice.world and kind in (None, s.kind):
            return s
    return None
