"""The sharded memory tier: each rank's local shards (and, with ``shard_replicas: 1``, a copy of another
node's) in shared memory after every step, with the memory tier's torn-slot guarantees.

Each rank keeps its own part of the state — local shards, shard map, data position, RNG, scheduler — in a
:class:`~elastic_train.checkpoint.memory.MemorySnapshot` (three slots, sealed with checksums after every byte
is copied, so a crash mid-copy leaves the previous step valid). The slot's skeleton says which world saved it
(round, world size) and whose shards it holds (:data:`INFO`).

With a replica, a rank also sends its freshly copied slot (the bytes and the metadata) to its *buddy*, the
rank one node further on (``(rank + local ranks) mod W``), and keeps the slot it receives from the rank one
node back in a second snapshot file: each shard is then in the memory of two nodes, and any single node may
die without a byte of the state going with it. That costs a second set of three slots in shared memory and
sending the rank's part of the state (the state size / W) over the network after every step.

Off the training thread: the own snapshot's copier thread copies the local shards of the model's parameters
and of an attached optimizer's state (the next optimizer step waits for that copy), seals the slot, and
then exchanges replicas, writing and sealing the received slot in the replica file. The next snapshot waits
for all of it. Only what the next forward may change (buffers, RNG states) is copied before ``save`` returns.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Container, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastic_train.checkpoint.codec import ALIGN, Flat, tensor_at
from elastic_train.checkpoint.copier import CopyJob
from elastic_train.checkpoint.memory import MemorySnapshot
from elastic_train.checkpoint.sharded.shardmap import ShardMap
from elastic_train.checkpoint.slots import DataCheck, Held
from elastic_train.checkpoint.specs import TensorSpec
from elastic_train.log import get_logger

log = get_logger(__name__)

#: The key of a slot's skeleton that says what the slot holds: ``{"round", "world_size", "rank", "map"}``.
INFO = "sharded"
#: What the replica snapshot file of a run is named after (``<run id><suffix>``).
REPLICA_SUFFIX = "-shard-replica"
#: Bytes read from a slot (and hashed) per read while a restore takes its data.
READ_CHUNK = 64 << 20
_HEADER_TAG = 1 << 27
#: Seconds closing after the group broke waits for a replica's exchange in flight (it may wait forever on a
#: peer that stopped, and gloo may leave it pending after its links were cut). The restore that follows
#: needs only the replicas of the failed ranks' shards, and what a failed peer sent whole is kept as soon as
#: it arrived (:meth:`ShardedMemory.exchange`). What is still in flight then comes from a peer that died or
#: stopped: only the bytes it sent before, already in this host's socket buffers (a few MB, read at memory
#: speed), can still complete a replica, and the wait is for those. The survivor's next round waits for it
#: (0.25 s cost a 100 MB hot recovery 0.2 s here; with 0.05 s the exchange was still pending at the bound in
#: every such close timed).
BROKEN_EXCHANGE_WAIT = 0.01
#: Seconds between the looks of such a close at the copier (error path only).
_POLL = 0.01


@dataclass(frozen=True, slots=True)
class Slot:
    """A valid slot of this rank's snapshots: whose shards it holds, of which world, at which step."""

    kind: str
    """``own`` or ``replica``."""
    held: Held
    round: int
    world_size: int
    rank: int
    """The rank (in the world that saved it) whose state the slot holds."""
    smap: ShardMap

    @property
    def step(self) -> int:
        return self.held.step


def slot_info(held: Held, kind: str) -> Slot | None:
    """What a valid slot holds, or None (logged) when its ``sharded`` record does not describe its tensors."""
    info = held.skeleton.get(INFO) if isinstance(held.skeleton, dict) else None
    try:
        if not isinstance(info, dict):
            raise ValueError("no sharded record (a replicated state's slot)")
        round_, world, rank = info.get("round"), info.get("world_size"), info.get("rank")
        if not (type(round_) is int and type(world) is int and type(rank) is int and 0 <= rank < world):
            raise ValueError(f"round {round_!r}, world size {world!r}, rank {rank!r}")
        smap = ShardMap.from_json(info.get("map"))
        if smap.world_size != world:
            raise ValueError(f"a map of {smap.world_size} ranks in a world of {world}")
        specs = {s.path: s for s in held.specs}
        for path, t in smap.tensors.items():
            spec = specs.get(f"/state{path}")
            rows = t.ranges[rank][1]
            if spec is None or spec.dtype != t.dtype or list(spec.shape) != [rows, *t.shape[1:]]:
                raise ValueError(f"{path}: the slot's tensor is not rank {rank}'s shard of the map")
    except ValueError as exc:
        log.warning("sharded_slot_invalid", slot=held.slot, step=held.step, kind=kind, reason=str(exc))
        return None
    return Slot(kind, held, round_, world, rank, smap)


class ShardedMemory:
    """This rank's snapshot files: its own part of the state, and the replica it keeps of its buddy's.

    Args:
        directory: the tmpfs (``checkpoint.memory_dir``).
        run_id: the run.
        local_rank: this rank on its node.
        replicas: 0 or 1 (``checkpoint.shard_replicas``).
        scope: the run's durable location (see :mod:`elastic_train.checkpoint.shmfiles`).
    """

    def __init__(self, directory: str, run_id: str, local_rank: int, replicas: int, scope: str = "") -> None:
        self.own = MemorySnapshot(directory, run_id, local_rank, scope)
        self.replica = (
            MemorySnapshot(directory, run_id + REPLICA_SUFFIX, local_rank, scope) if replicas else None
        )
        self._recv: torch.Tensor | None = None
        self.sent_bytes = 0
        #: A failure of the replica's exchange (on the copier thread), raised as it is by :meth:`raise_error`
        #: (a broken group's error: the training loop re-forms on it).
        self.error: BaseException | None = None
        #: Held while a received replica is written, and by :meth:`stop`: no write into the replica file
        #: after the manager stopped (a later manager of this process may be using the file).
        self._lock = threading.Lock()
        self._stopped = False
        #: Set while the copier thread exchanges a replica (the own slot sealed): what :meth:`stop` of a
        #: broken group need not wait for.
        self._exchanging = threading.Event()
        #: When the last replica exchange began and ended (``time.monotonic``, set on the copier thread;
        #: read once the copier is idle).
        self._exchanged = (0.0, 0.0)
        #: The thread that saves (the training thread): a small state's exchange runs on it, inline.
        self._saving: int | None = None
        #: Seconds the training thread waited for an exchange, a wait for the peers (:meth:`take_peer_wait`).
        self._peer_wait = 0.0

    def slots(self) -> list[Slot]:
        """Every valid slot of both files, newest first per file."""
        self.wait_idle()  # a snapshot in flight may still write either file
        out = []
        for kind, snap in (("own", self.own), ("replica", self.replica)):
            if snap is None:
                continue
            for held in snap.valid_slots():
                slot = slot_info(held, kind)
                if slot is not None:
                    out.append(slot)
        return out

    def save(
        self,
        step: int,
        flat: Flat,
        *,
        defer: Container[int] = (),
        unfenced: Container[int] = (),
        replica: tuple[int, int, Any] | None = None,
    ) -> int:
        """Copy this rank's part of the state into its own snapshot; returns the slot.

        The tensors in ``defer`` (the model's parameters and an attached optimizer's state) may be copied
        after this returns, on the own snapshot's copier thread, those in ``unfenced`` (frozen parameters)
        after the others (see :meth:`MemorySnapshot.save`). With ``replica`` (buddy, source, group:
        global ranks in the group), that thread then sends the sealed slot to the buddy and keeps the one the
        source sends (:meth:`exchange`): the next save waits for it.
        """
        then = None
        if replica is not None:
            buddy, source, group = replica

            def then(job: CopyJob) -> None:
                self._exchange_off_thread(job, buddy=buddy, source=source, group=group)

        # The wait for the previous snapshot (own.save waits for it first): what of it overlapped that
        # snapshot's exchange was the peers' (an exchange that ended before, or ran inline, overlaps none).
        started = time.monotonic()
        self.own.wait_idle()
        began, finished = self._exchanged
        self._peer_wait += max(0.0, min(time.monotonic(), finished) - max(started, began))
        self._saving = threading.get_ident()
        return self.own.save(step, flat, defer=defer, unfenced=unfenced, then=then)

    def take_peer_wait(self) -> float:
        """Seconds the training thread waited, since the last call, for a replica exchange to end: its
        buddy and source set the pace of an exchange (a slow peer's snapshot comes late), so that wait is
        not this rank's work (slow-node detection's busy time leaves it out)."""
        out, self._peer_wait = self._peer_wait, 0.0
        return out

    def _exchange_off_thread(self, job: CopyJob, *, buddy: int, source: int, group: Any) -> None:
        self._exchanging.set()
        began = time.monotonic()
        self._exchanged = (began, began)
        try:
            self.exchange(job.step, job.slot, job.flat, buddy=buddy, source=source, group=group)
        except BaseException as exc:  # raised in the training thread by raise_error()
            log.error("shard_replica_failed", step=job.step, error=(str(exc).splitlines() or [""])[0])
            self.error = exc
        finally:
            self._exchanged = (began, time.monotonic())
            if threading.get_ident() == self._saving:  # inline: the training thread's own wait
                self._peer_wait += self._exchanged[1] - began
            self._exchanging.clear()

    def exchange(self, step: int, slot: int, flat: Flat, *, buddy: int, source: int, group: Any) -> None:
        """Send the slot just written to ``buddy`` and keep the one ``source`` sends in the replica file
        (global ranks in ``group``). Collective in a ring: every rank calls it at the same step. Runs on the
        own snapshot's copier thread (:meth:`save`); the replica's slot is written and sealed there too.

        Raises:
            RuntimeError: a peer failed (the group is broken).
        """
        assert self.replica is not None
        meta = pickle.dumps((flat.skeleton, [s.to_json() for s in flat.specs]))
        head = torch.tensor([len(meta), flat.nbytes], dtype=torch.int64)
        theirs = torch.empty(2, dtype=torch.int64)
        sends = [dist.isend(head, dst=buddy, group=group, tag=_HEADER_TAG)]
        dist.recv(theirs, src=source, group=group, tag=_HEADER_TAG)
        meta_len, nbytes = (int(x) for x in theirs.tolist())
        their_meta = torch.empty(meta_len, dtype=torch.uint8)
        if self._recv is None or self._recv.numel() < nbytes:
            self._recv = None  # the old buffer goes first: at 1 GB a rank's part is hundreds of MB
            self._recv = torch.empty(max(nbytes, ALIGN), dtype=torch.uint8)  # not zeroed: received into
        data = self._recv[:nbytes]
        sends.append(dist.isend(torch.frombuffer(bytearray(meta), dtype=torch.uint8), buddy, group, tag=1))
        sends.append(dist.isend(self.own.data(slot, flat.nbytes), dst=buddy, group=group, tag=2))
        dist.recv(their_meta, src=source, group=group, tag=1)
        dist.recv(data, src=source, group=group, tag=2)
        # What arrived is kept before this rank's own sends are waited for: when the group breaks, the peer
        # they go to may be the one that failed (or cuts its links), while ``source``'s replica is whole.
        skeleton, spec_json = pickle.loads(their_meta.numpy().tobytes())
        specs = tuple(TensorSpec.from_json(s) for s in spec_json)
        tensors = tuple(tensor_at(data, s) for s in specs)
        with self._lock:
            if not self._stopped:
                self.replica.save(step, Flat(skeleton, specs, tensors, nbytes), background=False)
        for work in sends:
            if work is not None:
                work.wait()
        self.sent_bytes += flat.nbytes

    def land(
        self,
        slot: Slot,
        runs: Mapping[str, Sequence[tuple[int, int, torch.Tensor | None]]],
        *,
        whole: bool,
    ) -> tuple[dict[tuple[str, int], torch.Tensor], dict[str, torch.Tensor], bool]:
        """Read a slot's data once, in order, each byte hashed as it is read, straight to where it is used.

        Args:
            slot: the slot.
            runs: per sharded tensor (map path), the row runs wanted: ``(first row, rows, into)``; ``into`` a
                contiguous tensor of those rows (a new shard's rows: kept in place), or None (rows to send:
                read into a buffer of their own).
            whole: also return the slot's other (replicated) tensors.

        Returns:
            The buffers of the runs to send, by (path, first row); the replicated tensors by spec path; and
            whether the data's checksum matched (a slot that fails is marked torn: no reader takes it again).
        """
        snap = self.own if slot.kind == "own" else self.replica
        assert snap is not None
        held = slot.held
        segments: list[tuple[int, int, torch.Tensor | None]] = []  # (slot offset, bytes, into)
        staged: dict[tuple[str, int], torch.Tensor] = {}
        small: dict[str, torch.Tensor] = {}
        pos = 0
        for spec in sorted(held.specs, key=lambda x: x.offset):
            if spec.offset > pos:
                segments.append((pos, spec.offset - pos, None))
            path = spec.path.removeprefix("/state")
            t = slot.smap.tensors.get(path)
            if t is None:
                into = torch.empty(spec.nbytes, dtype=torch.uint8) if whole and spec.nbytes else None
                if into is not None:
                    small[spec.path] = into
                segments.append((spec.offset, spec.nbytes, into))
            else:
                row = t.row_bytes
                at = 0
                for first, rows, into in sorted(runs.get(path, ()), key=lambda r: r[0]):
                    if first > at:
                        segments.append((spec.offset + at * row, (first - at) * row, None))
                    if into is None:
                        into = staged[(path, first)] = torch.empty(rows * row, dtype=torch.uint8)
                    else:
                        into = into.reshape(-1).view(torch.uint8)
                    segments.append((spec.offset + first * row, rows * row, into))
                    at = first + rows
                if spec.nbytes > at * row:
                    segments.append((spec.offset + at * row, spec.nbytes - at * row, None))
            pos = spec.offset + spec.nbytes
        if held.nbytes > pos:
            segments.append((pos, held.nbytes - pos, None))
        check = DataCheck(held.data_sum, held.nbytes) if held.data_sum is not None else None
        bounce = torch.empty(min(READ_CHUNK, held.nbytes) or 1, dtype=torch.uint8)
        reader = snap.reader(held.slot)
        try:
            for offset, nbytes, into in segments:
                for start in range(0, nbytes, READ_CHUNK):
                    n = min(READ_CHUNK, nbytes - start)
                    part = bounce[:n] if into is None else into[start : start + n]
                    reader.read_into(offset + start, part)
                    if check is not None:
                        check.update(part)
        finally:
            reader.close()
        ok = check is None or check.ok()
        if not ok:
            snap.invalidate(held.slot)
        return staged, small, ok

    def files(self) -> Iterator[MemorySnapshot]:
        yield self.own
        if self.replica is not None:
            yield self.replica

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until the snapshot in flight is copied, sealed and its replica exchanged; False if it still
        is not after ``timeout`` seconds."""
        return all(snap.wait_idle(timeout) for snap in self.files())

    def stop(self, timeout: float | None, *, broken: bool = False) -> bool:
        """Wait up to ``timeout`` seconds for the snapshot in flight (its exchange may wait on a peer that
        failed), then never write the replica file again; whether it finished.

        ``broken``: the group failed. The own slot's copy and seal are still waited for (they wait on no
        peer), its replica's exchange at most :data:`BROKEN_EXCHANGE_WAIT` seconds: a send to or a receive
        from a peer that stopped instead of dying may never return, even with the group's connections cut,
        and the process must ask for the next round meanwhile. Left behind, that exchange writes nothing
        (the replica file is written only under the lock this sets, so no slot is torn either).
        """
        if broken:
            deadline = None if timeout is None else time.monotonic() + timeout
            while not (idle := self.wait_idle(_POLL)) and not self._exchanging.is_set():
                if deadline is not None and time.monotonic() >= deadline:
                    break
            if not idle and self._exchanging.is_set():
                left = BROKEN_EXCHANGE_WAIT if deadline is None else max(0.0, deadline - time.monotonic())
                idle = self.wait_idle(min(BROKEN_EXCHANGE_WAIT, left))
        else:
            idle = self.wait_idle(timeout)
        with self._lock:
            self._stopped = True
        return idle

    def raise_error(self) -> None:
        if self.error is not None:
            exc, self.error = self.error, None
            raise exc
        for snap in self.files():
            snap.raise_error()

    def release(self) -> None:
        for snap in self.files():
            snap.release()

    def detach(self) -> None:
        for snap in self.files():
            snap.detach()
