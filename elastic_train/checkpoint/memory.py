"""The in-memory tier: a three-slot snapshot of one worker's state in node shared memory.

One file per (run, owner, local rank) in a tmpfs (``/dev/shm``; names and owners: :mod:`.shmfiles`), allocated
whole when the first state is saved (once the node's room for every local rank's file is checked:
:mod:`.capacity`), with three slots (layout: :mod:`.slots`). A save invalidates the header of the oldest slot
that is neither the newest nor pinned (by a durable write reading it) and copies the tensors into it; the
background copier (:mod:`.copier`) finishes the copies the caller deferred (parameters and optimizer state,
which nothing changes before the next optimizer step — see :meth:`MemorySnapshot.fence`), writes the metadata
(:mod:`.slotmeta`), computes xxh3-64 over data and metadata and only then publishes step + checksums in the
slot header (a CPU state under :data:`SEAL_INLINE_BYTES` is copied and sealed by the caller: handing it over
costs more). A crash at any point leaves the previous snapshot intact, and a torn slot fails its header or
checksum.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import os
import time
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from elastic_train.checkpoint import drain, schema
from elastic_train.checkpoint.capacity import check_node_room
from elastic_train.checkpoint.codec import Flat, destinations
from elastic_train.checkpoint.copier import Copier, CopyJob, DeviceCopies
from elastic_train.checkpoint.errors import CheckpointError
from elastic_train.checkpoint.plan import Planned
from elastic_train.checkpoint.shmfiles import snapshot_path
from elastic_train.checkpoint.slotmeta import SlotMeta
from elastic_train.checkpoint.slots import SLOTS, Held, SlotFile, SlotReader, checksum, sizes
from elastic_train.checkpoint.specs import TensorSpec
from elastic_train.log import get_logger
from elastic_train.torchcompat import foreach_copy_op

log = get_logger(__name__)
#: ``torch._foreach_copy_``, bound once: the copy of a save (torch's private name, behind its one door).
_foreach_copy = foreach_copy_op()

#: CPU states up to this size are copied in ``save`` itself (about 0.5 ms at memory bandwidth).
INLINE_BYTES = 4 << 20
#: CPU states up to this size are also sealed in ``save`` (about 0.1 ms of checksum per MiB): handing the seal
#: to the copier thread costs the training thread more than that (docs/training.md, measured at 1.3 MB).
SEAL_INLINE_BYTES = 2 << 20
#: Seconds between two counts of progress (:attr:`MemorySnapshot.progress`) while the training thread waits
#: for the snapshot's own work.
PROGRESS_EVERY = 0.25


@dataclass(slots=True)
class SaveStats:
    """What each snapshot costs the training thread, recorded only when ``record`` is set (a benchmark).

    Per save: the time inside :meth:`CheckpointManager.save` (reading the state included) other than the
    snapshot's floor (the tensor copies into the slot, and the data's checksum where save computes it) and
    other than waking the copier thread, as the thread's CPU time (the work itself, which waiting for a core
    on a busy machine does not inflate) and as wall time (waits for a core, the interpreter lock or the
    previous seal included). The wake is kept apart (``wake_cpu_s``): it is one system call, not Python,
    and its cost is the platform's: waking a thread whose core is idle takes a few microseconds on bare
    metal and 40-55 µs of the waker's CPU time on a virtual machine whose idle vCPUs halt (measured).
    """

    record: bool = False
    python_cpu_s: list[float] = field(default_factory=list)
    python_wall_s: list[float] = field(default_factory=list)
    wake_cpu_s: list[float] = field(default_factory=list)
    """Per save, the training thread's CPU seconds in handing the job to the copier thread (the wake)."""
    copy_s: float = 0.0
    """Wall seconds of the current save's copies and data checksum (while recording)."""
    copy_cpu_s: float = 0.0
    wake_s: float = 0.0
    """Wall seconds of the current save's hand-over to the copier (while recording)."""
    wake_cpu: float = 0.0

    def add_save(self, wall_s: float, cpu_s: float) -> None:
        self.python_wall_s.append(wall_s - self.copy_s - self.wake_s)
        self.python_cpu_s.append(cpu_s - self.copy_cpu_s - self.wake_cpu)
        self.wake_cpu_s.append(self.wake_cpu)
        self.copy_s = self.copy_cpu_s = self.wake_s = self.wake_cpu = 0.0


class MemorySnapshot:
    """Shared-memory snapshot of one worker in three slots (one being written, the newest sealed one, and one
    a durable write may pin).

    Not thread-safe: one training loop uses it (the durable writer only pins, reads and unpins a slot).
    """

    def __init__(self, directory: str, run_id: str, local_rank: int, scope: str = "") -> None:
        self.path = snapshot_path(directory, run_id, local_rank, scope)
        self._file = SlotFile(self.path)
        self._newest: int | None = None
        self._seq = 0
        self._slot_seq = [0] * SLOTS
        #: Typed views of each slot's tensors in the current mapping (dropped by :meth:`_unmap`).
        self._dests: dict[int, list[torch.Tensor | None]] = {}
        self.copier = Copier(self, self.path)
        self._cond = self.copier.cond
        self._device = DeviceCopies(self.path)
        self._meta = SlotMeta()
        self._meta_need = 0
        self._specs: tuple[TensorSpec, ...] | None = None
        self._pinned: set[int] = set()
        self.sealed_step: int | None = None
        #: The last step whose planned snapshot failed its structure check (its slot was left invalid).
        self.rejected_step: int | None = None
        #: Per slot: the copy lists of the current layout (specs object, deferred set, copy lists).
        self._copy_lists: dict[int, tuple[Any, Any, Any]] = {}
        self._gpu: tuple[Any, list[int]] | None = None
        #: Called every :data:`PROGRESS_EVERY` seconds while the training thread waits for this snapshot's
        #: own work (copies, a new layout's allocation, the seal; never a follow-up such as a replica
        #: exchange, which waits on a peer), so that the node's agent counts the wait as progress and not as
        #: a worker blocked on a stopped peer: copying a gigabyte into memory the process had not touched
        #: before can take seconds on a machine short of free memory.
        self.progress: Callable[[], None] | None = None
        #: Per slot: the layout whose tensor specs are written at the start of its metadata.
        self._meta_prefix: dict[int, str] = {}
        self.stats = SaveStats()
        if os.environ.get("TORCHELASTIC_RUN_ID"):  # a worker torchrun started (and stops with SIGTERM)
            drain.register(self)

    # -- lifecycle -------------------------------------------------------------------------------------
    def _allocate(self, flat: Flat, meta_len: int) -> None:
        self._unmap()
        # the node's whole need (every local rank's file) against its tmpfs, before a byte is allocated
        check_node_room(self.path, sizes(flat.nbytes, meta_len)[3], flat.nbytes)
        self._file.allocate(flat.nbytes, meta_len, flat.layout_key)
        self._specs = flat.specs

    def _unmap(self) -> None:
        self._specs = None
        self._copy_lists = {}
        self._meta_prefix = {}
        self._device.unpin()
        self._dests = {}
        self._file.unmap()

    def release(self) -> None:
        """Wait for the sealer, unmap and delete the file (the snapshot is gone)."""
        self.wait_idle()
        self._unmap()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
            log.info("memory_snapshot_released", path=self.path)

    def detach(self) -> None:
        """Wait for the sealer and unmap, keeping the file for a restarted worker."""
        self.wait_idle()
        self._unmap()

    # -- reading -----------------------------------------------------------------------------------------
    def newest_valid(self, *, verify_data: bool = True) -> Held | None:
        """The newest slot whose header and checksums verify (maps the file if it exists).

        Args:
            verify_data: hash the data here. Without it only the header and the metadata are verified and
                the returned :attr:`Held.data_sum` is checked by whoever reads the data (a restore hashes
                each bucket as it sends or lands it, :class:`~.slots.DataCheck`, and on a mismatch
                :meth:`invalidate`-s the slot and looks again).
        """
        for held in self._valid(verify_data=verify_data):
            return held
        return None

    def valid_slots(self) -> list[Held]:
        """Every slot whose header and metadata verify, newest first (data checksums are left to the reader,
        as :meth:`newest_valid` with ``verify_data=False``). A sharded restore may need an older step than a
        rank's newest: the step that every shard of the state was sealed at."""
        return list(self._valid(verify_data=False))

    def _valid(self, *, verify_data: bool) -> Iterator[Held]:
        self.wait_idle()  # (a save in flight may be laying the file out anew)
        file = self._file
        if file.mm is None and not file.open_existing():
            return
        headers = []
        for slot in range(SLOTS):
            fields = file.header(slot)
            if fields is not None:
                headers.append((slot, fields))
                self._seq = max(self._seq, fields[2])
                self._slot_seq[slot] = fields[2]
        # Newest first, and only until one verifies: hashing every slot would triple a large restore's reads.
        first = True
        for slot, fields in sorted(headers, key=lambda h: h[1][1], reverse=True):
            _, step, _, sum_data, sum_meta, meta_len, data_len = fields
            if meta_len > file.meta_cap or data_len > file.data_cap:
                continue
            meta = file.meta_bytes(slot, meta_len)
            ok = checksum(meta) == sum_meta and (
                not verify_data or file.data_checksum(slot, data_len) == sum_data
            )
            if not ok:
                log.warning("memory_snapshot_torn", path=self.path, slot=slot, step=step)
                self._slot_seq[slot] = 0  # rewritten first
                continue
            try:  # checksums catch torn writes, not a bad writer: validate before anything is used
                skeleton, specs = schema.snapshot_meta(bytes(meta), data_len, self._meta.known)
            except ValueError as exc:
                log.warning("memory_snapshot_invalid", path=self.path, slot=slot, step=step, reason=str(exc))
                continue
            if first:  # the slot the next save must not overwrite
                self._newest, first = slot, False
            yield Held(slot, step, skeleton, specs, data_len, None if verify_data else sum_data)

    def invalidate(self, slot: int) -> None:
        """Mark ``slot`` torn (its data failed :class:`~.slots.DataCheck`): no reader takes it again, and it
        is the first one rewritten."""
        self._file.clear_header(slot)
        self._slot_seq[slot] = 0
        if self._newest == slot:
            self._newest = None
        log.warning("memory_snapshot_torn", path=self.path, slot=slot)

    def reader(self, slot: int) -> SlotReader:
        """A reader of ``slot``'s data through the file (see :class:`~.slots.SlotReader`); close it after
        use."""
        return SlotReader(self.path, self._file.data_start(slot))

    def data(self, slot: int, nbytes: int) -> torch.Tensor:
        """The data region of ``slot`` as a uint8 tensor view (valid until that slot is rewritten)."""
        return self._file.data(slot, nbytes)

    # -- writing -----------------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        flat: Flat,
        *,
        defer: Container[int] = (),
        background: bool = True,
        unfenced: Container[int] = (),
        then: Callable[[CopyJob], None] | None = None,
    ) -> int:
        """Copy ``flat`` into the oldest free slot and seal it; returns the slot.

        The tensors whose index is in ``defer`` may still be copied after this returns (by the background
        copier, or on a side CUDA stream): the caller must not modify them before :meth:`fence` — the
        optimizer step pre-hook of :meth:`CheckpointManager.attach` does that. Every other tensor is copied
        (or, on a GPU, ordered before any later kernel of the current stream) before this returns, so state
        that changes outside the optimizer step (BatchNorm buffers, RNG states) is taken at this step.
        The slot is sealed (checksums, then the header) only once every byte of it is written.

        A CPU state of a new layout (the first save, or a sharded rank's part at another world size) with
        deferred tensors is laid out on the copier thread too: the slots are allocated (or grown) there, and
        the tensors not deferred are cloned here first (what the next forward may change, usually small).

        The tensors of ``defer`` also in ``unfenced`` (frozen parameters: no optimizer step changes them) are
        copied last, and only a full :meth:`fence` waits for them, not ``fence(step=True)``.

        ``then`` runs with the copy job once the slot is copied and sealed, on the copier thread when the
        seal runs there (a sharded state's replica send); the next save and :meth:`wait_idle` wait for it.

        Raises:
            CheckpointError: the shared memory cannot hold the state (needed and free sizes in the message),
                or a previous background copy or seal failed.
        """
        copier, file = self.copier, self._file
        if copier.error is not None:
            self.raise_error()
        self.wait_idle()  # the previous snapshot is sealed (normally long before the next step ends)
        if file.mm is None:
            file.open_existing()
        if flat.specs is not self._specs or file.mm is None:
            # Comparing the specs is cheaper than their digest (a restarted worker's snapshot has only that);
            # a planned snapshot hands over the very same specs object while its layout holds.
            same = file.mm is not None and (
                flat.specs == self._specs if self._specs is not None else flat.layout_key == file.layout
            )
            if not same:
                if background and defer and flat.nbytes > INLINE_BYTES and not self._any_cuda(flat):
                    return self._save_laid_out_later(step, flat, defer, unfenced, then)
                self._allocate(flat, max(self._meta_need, len(self._meta.encode(flat, flat.layout_key))))
                self._slot_seq, self._newest = [0] * SLOTS, None
                self._meta_need = 0
            self._specs = flat.specs
            self._copy_lists = {}
        if self._meta_need > file.meta_cap:
            self._allocate(flat, self._meta_need)
            self._slot_seq, self._newest = [0] * SLOTS, None
            self._meta_need = 0
        # The oldest slot that is neither the newest snapshot nor pinned by a durable write: with one slot
        # pinned, the other two still alternate, so a crash mid-copy always leaves the previous step valid.
        # Nothing else changes these while the copier is idle but a durable writer unpinning; only this
        # thread pins, so a slot is only waited for (under the lock) when one is pinned.
        slot = self._oldest_free() if not self._pinned else None
        if slot is None:
            with self._cond:
                while (slot := self._oldest_free()) is None:
                    self._wait()
        file.clear_header(slot)
        dests = self._dests.get(slot)
        if dests is None:
            dests = self._dests[slot] = destinations(flat.specs, file.data(slot, flat.nbytes))
        event = None
        rest: list[int] = []  # deferred, but no optimizer step changes them (CPU only)
        gpu = self._gpu  # decided once per specs object (see _on_gpu)
        on_gpu = gpu[1] if gpu is not None and gpu[0] is flat.specs else self._on_gpu(flat, dests)
        if on_gpu:
            event = self._device.copy(flat, dests, on_gpu, defer, file.buf)
            later: list[int] = []
            for i, (dst, src) in enumerate(zip(dests, flat.tensors, strict=True)):
                if dst is None or src.is_cuda:
                    continue
                if i in defer and background:
                    later.append(i)
                else:
                    dst.copy_(src)
        else:
            # A small state is copied here whole: waking the copier thread for its copies (and, on a
            # machine whose cores all train, waiting for it to be scheduled) costs more than the copies.
            # Up to SEAL_INLINE_BYTES it is sealed here too (below); above, the seal (JSON, checksums)
            # runs on the copier thread.
            small = flat.nbytes <= INLINE_BYTES  # (no CUDA tensor here)
            deferred = defer if background and not small else ()
            lists = self._copy_lists.get(slot)
            if (
                lists is None
                or lists[0] is not flat.specs
                or not (lists[1] is deferred or lists[1] == deferred)
            ):
                lists = self._split(slot, flat, deferred)
            now, later, now_dests, take = lists[2]
            if unfenced and later:
                rest = [i for i in later if i in unfenced]
                later = [i for i in later if i not in unfenced]
            if now:
                if take is True:
                    sources = flat.tensors
                elif take is not None:
                    sources = take(flat.tensors)
                else:
                    sources = (flat.tensors[now[0]],)
                if self.stats.record:
                    t0, c0 = time.perf_counter(), time.thread_time()
                    _foreach_copy(now_dests, sources)
                    self.stats.copy_s += time.perf_counter() - t0
                    self.stats.copy_cpu_s += time.thread_time() - c0
                else:
                    _foreach_copy(now_dests, sources)
        self._seq += 1
        self._slot_seq[slot] = self._seq
        device = flat.tensors[on_gpu[0]].device if on_gpu else None
        verify = flat.verify if isinstance(flat, Planned) else None
        job = CopyJob(
            slot,
            step,
            self._seq,
            flat,
            dests,
            later,
            event,
            device,
            verify,
            self._newest,
            rest=rest,
            then=then,
        )
        self._newest = slot
        if not background or (not on_gpu and flat.nbytes <= SEAL_INLINE_BYTES):
            if verify is not None and not verify():
                copier.reject(job)
                return slot
            copier.copy(job)
            copier.copy_rest(job)
            self.seal(job, timed=self.stats.record)
            if then is not None:
                copier.then(job)
            self.raise_error()
            return slot
        # A larger state's seal (metadata, checksums, header) runs on the copier thread, and the slot is not
        # valid before it is done. The fence also waits for a pending structure check: the state may change
        # once it returns.
        copying = bool(later) or bool(rest) or verify is not None
        if self.stats.record:
            t0, c0 = time.perf_counter(), time.thread_time()
            copier.hand_over(job, copying=copying)
            self.stats.wake_s += time.perf_counter() - t0
            self.stats.wake_cpu += time.thread_time() - c0
        else:
            copier.hand_over(job, copying=copying)
        return slot

    def _save_laid_out_later(
        self,
        step: int,
        flat: Flat,
        defer: Container[int],
        unfenced: Container[int],
        then: Callable[[CopyJob], None] | None,
    ) -> int:
        """:meth:`save` of a CPU state whose slots the copier allocates: seconds at a gigabyte (the tmpfs
        pages of a grown file are allocated, then faulted in by the copy), which the next forward and
        backward overlap. The fence waits for it as for the deferred copies.

        The tensors not in ``defer`` are cloned here (taken at this step); every slot of the old layout is
        invalid from the allocation on, as when :meth:`save` allocates itself.
        """
        staged = tuple(t if i in defer else t.detach().clone() for i, t in enumerate(flat.tensors))
        pinned = self._pinned
        slot = next(s for s in range(SLOTS) if s not in pinned)  # the new file's slots are all invalid
        self._slot_seq, self._newest = [0] * SLOTS, None
        self._seq += 1
        self._slot_seq[slot] = self._seq
        self._newest = slot
        need = self._meta_need
        self._meta_need = 0

        def lay_out(job: CopyJob) -> None:
            self._allocate(job.flat, max(need, len(self._meta.encode(job.flat, job.flat.layout_key))))
            self._copy_lists = {}
            dests = self._dests[job.slot] = destinations(
                job.flat.specs, self._file.data(job.slot, job.flat.nbytes)
            )
            copied = [i for i, d in enumerate(dests) if d is not None]
            job.dests = dests
            job.later = [i for i in copied if i in defer and i not in unfenced]
            job.rest = [i for i in copied if i not in defer or i in unfenced]  # clones: no step changes them

        verify = flat.verify if isinstance(flat, Planned) else None
        job = CopyJob(
            slot, step, self._seq, dataclasses.replace(flat, tensors=staged), [], [], None, None, verify,
            None, prepare=lay_out, then=then,
        )  # fmt: skip
        self.copier.hand_over(job, copying=True, rest=True)  # lay_out lists the copies
        return slot

    @staticmethod
    def _any_cuda(flat: Flat) -> bool:
        return any(t.is_cuda for t in flat.tensors)

    def _oldest_free(self) -> int | None:
        """The slot with the lowest sequence that is neither the newest nor pinned (the first such in
        order), or None."""
        newest, pinned, seq = self._newest, self._pinned, self._slot_seq
        slot = None
        for s in range(SLOTS):
            if s != newest and s not in pinned and (slot is None or seq[s] < seq[slot]):
                slot = s
        return slot

    def _split(self, slot: int, flat: Flat, defer: Container[int]) -> tuple[Any, Any, Any]:
        """The tensors copied now and those the copier copies, kept per slot and layout: (specs, ``defer``,
        (indices now, indices later, destinations now, how to take the sources now from the tensors))."""
        dests = self._dests[slot]
        now = [i for i, d in enumerate(dests) if d is not None and i not in defer]
        later = [i for i, d in enumerate(dests) if d is not None and i in defer]
        # The sources now: every tensor (the tensors as they are: True), an itemgetter of several, or one.
        take: Any = True if len(now) == len(dests) else operator.itemgetter(*now) if len(now) > 1 else None
        lists = (flat.specs, defer, (now, later, [dests[i] for i in now], take))
        self._copy_lists[slot] = lists
        return lists

    def _on_gpu(self, flat: Flat, dests: list[torch.Tensor | None]) -> list[int]:
        """Indices of the CUDA tensors of ``flat`` (decided once per specs object: a planned snapshot's
        tensors keep their device while its plan holds)."""
        cached = self._gpu
        if cached is not None and cached[0] is flat.specs:
            return cached[1]
        on_gpu = [i for i, t in enumerate(flat.tensors) if t.is_cuda and dests[i] is not None]
        self._gpu = (flat.specs, on_gpu)
        return on_gpu

    def seal(self, job: CopyJob, *, timed: bool = False) -> None:
        """Write the metadata, checksum data and metadata, then publish the header (the slot is valid).

        ``timed``: on the training thread, while :attr:`stats` records (the data's checksum counts with the
        copy: both are the snapshot's floor, not its Python).
        """
        file = self._file
        try:
            assert file.mm is not None
            if job.event is not None:
                job.event.synchronize()
            prefix, rest = self._meta.parts(job.flat, file.layout)  # save re-allocates for another layout
            meta_len = len(prefix) + len(rest)
            if meta_len > file.meta_cap:
                # Left unsealed (the previous snapshot stays the valid one); the next save makes room.
                log.warning("memory_snapshot_meta_grew", path=self.path, step=job.step, bytes=meta_len)
                self._meta_need = 2 * meta_len
                return
            fresh = self._meta_prefix.get(job.slot) != file.layout  # else only the skeleton changed
            self._meta_prefix[job.slot] = file.layout
            meta = (prefix if fresh else None, len(prefix), rest)
            took = file.seal(job.slot, meta, job.step, job.seq, job.flat.nbytes, timed=timed)
            if timed:
                self.stats.copy_s += took[0]
                self.stats.copy_cpu_s += took[1]
            self.sealed_step = job.step
        except BaseException as exc:  # reported to the loop by raise_error()
            log.error("memory_snapshot_seal_failed", path=self.path, step=job.step, error=str(exc))
            self.copier.error = exc

    def rejected(self, job: CopyJob) -> None:
        """``job``'s slot stays invalid, the previous snapshot the newest (under the copier's lock)."""
        if self._newest == job.slot:
            self._newest = job.previous
        self._slot_seq[job.slot] = 0  # rewritten first
        self.rejected_step = job.step

    def fence(self, *, step: bool = False) -> None:
        """Return once the last snapshot's tensors are copied (and a planned snapshot's structure checked):
        they may be modified from now on.

        On a GPU the copies are ordered before the current stream's later kernels instead (the host does
        not wait). The seal (checksums) may still be running. ``step``: only what an optimizer step changes
        (the step pre-hook's fence; see ``unfenced`` in :meth:`save`).

        Raises:
            CheckpointError: the background copy failed.
        """
        job = self.wait_copied(rest=not step)
        if job is not None and job.event is not None:
            torch.cuda.current_stream(job.device).wait_event(job.event)
        self.raise_error()

    def wait_copied(self, *, rest: bool = True) -> CopyJob | None:
        """Block until the last snapshot's CPU copies (and a planned snapshot's structure check) are done,
        those of tensors no optimizer step changes too unless ``rest`` is False; returns the job still being
        sealed, if any (its GPU copies may still run)."""
        copier = self.copier
        with self._cond:
            while copier.copying or (rest and copier.copying_rest):
                self._wait()
            return copier.job

    def raise_error(self) -> None:
        """Raise a failure of the background copier or a seal in the caller's thread."""
        copier = self.copier
        if copier.error is not None:
            exc, copier.error = copier.error, None
            if isinstance(exc, CheckpointError):  # one line already (the slots could not be allocated)
                raise exc
            raise CheckpointError(f"sealing the shared-memory snapshot failed: {exc}") from exc

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until the last snapshot is copied and sealed (or failed); False if it still is not after
        ``timeout`` seconds."""
        copier = self.copier
        if copier.job is None and copier.sealing is None:
            # Only save() (the training thread) sets them, and the copier clears them once done (the job
            # first): both None is idle, and stays so until the next save.
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while copier.sealing is not None or copier.job is not None:
                if deadline is None:
                    self._wait()
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _wait(self) -> None:
        """One wait on the copier's condition (held), counting :attr:`progress` while the copier works on
        its own."""
        if self.progress is None:
            self._cond.wait()
        elif not self._cond.wait(PROGRESS_EVERY) and not self.copier.following:
            self.progress()

    def pin(self, slot: int) -> None:
        """Keep ``slot`` from being rewritten (while a background copy reads it)."""
        with self._cond:
            self._pinned.add(slot)

    def unpin(self, slot: int) -> None:
        with self._cond:
            self._pinned.discard(slot)
            self._cond.notify_all()
