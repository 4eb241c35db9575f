"""The memory tier's background copier: a snapshot's deferred copies and its seal, off the training thread.

``save`` copies what the next forward may change and hands the rest — the parameters and optimizer state of
an attached optimizer, which only the next optimizer step changes — to one persistent thread, which copies
it and then seals the slot (the snapshot's own :meth:`Sealer.seal`). A job may also carry the slots' layout
(allocated first, when the state's layout is new: :attr:`CopyJob.prepare`) and a follow-up run after the
seal (a sharded state's replica exchange: :attr:`CopyJob.then`). The snapshot's ``fence``, called from
the optimizer's step pre-hook, waits for the copies (:attr:`Copier.copying`; a full fence also for those
of tensors no optimizer step changes, :attr:`Copier.copying_rest`); its next save waits for the whole job.
On a GPU the device-to-host copies run on a side CUDA stream into the page-locked mapping
(:class:`DeviceCopies`) and the fence orders them before the current stream's next kernels instead of
blocking the host.
"""

from __future__ import annotations

import operator
import os
import threading
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from elastic_train.checkpoint.codec import Flat
from elastic_train.log import get_logger
from elastic_train.torchcompat import foreach_copy

log = get_logger(__name__)


@dataclass(slots=True)
class CopyJob:
    """One snapshot being written: what is left to copy, then to seal."""

    slot: int
    step: int
    seq: int
    flat: Flat
    dests: list[torch.Tensor | None]
    later: list[int]
    """Indices of the CPU tensors the background copier copies (the step pre-hook's fence waits for them)."""
    event: Any
    """CUDA event recorded after the last device-to-host copy (None without GPU tensors)."""
    device: torch.device | None = None
    verify: Callable[[], bool] | None = None
    """A planned snapshot's full structure check (see :class:`~elastic_train.checkpoint.plan.Planned`),
    run by the copier before the deferred copies and the seal; None: nothing left to check."""
    previous: int | None = None
    """The newest slot before this one: the newest again if the check fails (this slot stays invalid)."""
    prepare: Callable[[CopyJob], None] | None = None
    """Run by the copier before the copies: a new layout's slots allocated, and :attr:`dests` and
    :attr:`later` set in them (None: the slot is ready)."""
    rest: list[int] = field(default_factory=list)
    """Indices of the CPU tensors the copier copies after :attr:`later`, which no optimizer step changes
    (frozen parameters, the clones of a new layout's tensors): only a full fence waits for them."""
    then: Callable[[CopyJob], None] | None = None
    """Run with the job by the copier once the slot is copied and its seal done (a sharded state's replica
    sent), before the snapshot counts as idle; not run when the copy failed or the check rejected it. It
    reports its own failures."""


class Sealer(Protocol):
    """The snapshot a copier works for."""

    def seal(self, job: CopyJob) -> None:
        """Write the slot's metadata, checksums and header (a failure goes to :attr:`Copier.error`)."""

    def rejected(self, job: CopyJob) -> None:
        """``job``'s slot stays invalid (called under :attr:`Copier.cond`)."""


class Copier:
    """The copier thread of one snapshot, started by the first hand-over (and again after a fork).

    :attr:`cond` is the snapshot's one lock: it also guards the slots a durable write pins. The snapshot waits
    on it for :attr:`copying` (its fence) and for :attr:`job` and :attr:`sealing` (idle).
    """

    def __init__(self, sealer: Sealer, path: str) -> None:
        self.cond = threading.Condition()
        self._sealer = sealer
        self._path = path
        #: The snapshot being copied or sealed, whether its deferred copies (or structure check) are still
        #: pending, and the slot being sealed: set only by the training thread, cleared by the copier.
        self.job: CopyJob | None = None
        self.copying = False
        #: The job's :attr:`CopyJob.rest` is still being copied.
        self.copying_rest = False
        self.sealing: int | None = None
        #: The job's follow-up (:attr:`CopyJob.then`, a sharded state's replica exchange) is running: the one
        #: part of a job that waits on a peer.
        self.following = False
        self.thread: threading.Thread | None = None
        self._pid = 0
        #: A failure of the copies or a seal, raised in the training thread by the snapshot's ``raise_error``.
        self.error: BaseException | None = None

    @staticmethod
    def copy(job: CopyJob) -> None:
        """The deferred CPU copies the step pre-hook waits for (GPU copies run on the side stream
        meanwhile)."""
        _copy(job, job.later)

    @staticmethod
    def copy_rest(job: CopyJob) -> None:
        """The deferred CPU copies that no optimizer step waits for."""
        _copy(job, job.rest)

    def hand_over(self, job: CopyJob, *, copying: bool, rest: bool | None = None) -> None:
        """Give ``job`` to the copier thread (started here when there is none) and wake it; ``copying``:
        deferred copies or a structure check are pending (the fence waits for them); ``rest``: copies only
        a full fence waits for are pending (default: whether the job lists any; its ``prepare`` may add
        some)."""
        with self.cond:
            self.job, self.copying, self.sealing = job, copying, job.slot
            self.copying_rest = bool(job.rest) if rest is None else rest
            # The copier never returns but by an exception (it then clears thread); a forked child has none.
            if self.thread is None or self._pid != os.getpid():
                self.thread = threading.Thread(target=self._work, name="ckpt-memory-copy", daemon=True)
                self._pid = os.getpid()
                self.thread.start()
            self.cond.notify_all()

    def _work(self) -> None:
        try:
            self._work_loop()
        finally:  # (an exception outside the per-job handlers) the next save starts another copier
            with self.cond:
                if self.thread is threading.current_thread():
                    self.thread = None

    def _work_loop(self) -> None:
        while True:
            with self.cond:
                while self.job is None:
                    self.cond.wait()
                job = self.job
            try:
                # A planned snapshot's full structure check, off the training thread: before the deferred
                # copies (nothing changes those tensors before the fence) and before the seal.
                if job.verify is not None and not job.verify():
                    self.reject(job)
                    continue
                if job.prepare is not None:
                    job.prepare(job)
                self.copy(job)
                if job.rest:
                    with self.cond:  # the optimizer step may go on: what is left, no step changes
                        self.copying = False
                        self.cond.notify_all()
                    self.copy_rest(job)
            except BaseException as exc:  # reported to the loop by the snapshot's raise_error()/fence()
                log.error("memory_snapshot_copy_failed", path=self._path, step=job.step, error=str(exc))
                self.error = exc
                with self.cond:
                    self.job, self.copying, self.copying_rest, self.sealing = None, False, False, None
                    self.cond.notify_all()
                continue
            with self.cond:
                self.copying = self.copying_rest = False
                self.cond.notify_all()
            self._sealer.seal(job)
            if job.then is not None:
                with self.cond:
                    self.following = True
                self.then(job)
            with self.cond:
                self.job, self.following = None, False
                if self.sealing == job.slot:
                    self.sealing = None
                self.cond.notify_all()

    def then(self, job: CopyJob) -> None:
        """Run ``job``'s follow-up (its own failures are its to report; anything else goes to
        :attr:`error`)."""
        assert job.then is not None
        try:
            job.then(job)
        except BaseException as exc:
            log.error("memory_snapshot_then_failed", path=self._path, step=job.step, error=str(exc))
            self.error = exc

    def reject(self, job: CopyJob) -> None:
        """Leave ``job``'s slot invalid: the state's structure is no longer the snapshot's plan, so what was
        copied may be wrong. The previous snapshot stays the newest; the state's owner re-plans the next one
        (the failed check marked it)."""
        if job.event is not None:
            job.event.synchronize()  # no copy still lands in the slot once it is handed out again
        log.info("memory_snapshot_replanned", path=self._path, step=job.step)
        with self.cond:
            self._sealer.rejected(job)
            if self.job is job:
                self.job, self.copying, self.copying_rest, self.sealing = None, False, False, None
            self.cond.notify_all()


def _copy(job: CopyJob, indices: list[int]) -> None:
    if indices:
        # C-level picks: on the copier thread, Python per tensor holds the interpreter lock the training
        # thread needs.
        take = operator.itemgetter(*indices)
        dests, srcs = take(job.dests), take(job.flat.tensors)
        if len(indices) == 1:
            dests, srcs = (dests,), (srcs,)
        foreach_copy(dests, srcs)


class DeviceCopies:
    """The device-to-host copies of a snapshot's CUDA tensors: a side stream into the page-locked mapping."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._stream: Any = None
        self._pinned_ptr: int | None = None

    def copy(
        self,
        flat: Flat,
        dests: list[torch.Tensor | None],
        on_gpu: list[int],
        defer: Container[int],
        buf: torch.Tensor | None,
    ) -> Any:
        """Queue the copies of ``flat``'s tensors ``on_gpu`` into ``dests`` (views of ``buf``); returns the
        event that marks their end.

        Tensors not in ``defer`` are copied first and the current stream waits for them right away (on the
        device: the host does not block), so a later kernel cannot change them before they are copied.
        """
        device = flat.tensors[on_gpu[0]].device
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        self._pin(buf)
        current = torch.cuda.current_stream(device)
        self._stream.wait_stream(current)  # the step's kernels that produced the state come first
        now = [i for i in on_gpu if i not in defer]
        later = [i for i in on_gpu if i in defer]
        with torch.cuda.stream(self._stream):
            for group in (now, later):
                for i in group:
                    dst, src = dests[i], flat.tensors[i]
                    assert dst is not None
                    dst.copy_(src, non_blocking=True)
                    src.record_stream(self._stream)
                if group is now and now:
                    current.wait_event(self._stream.record_event())
            return self._stream.record_event()

    def _pin(self, buf: torch.Tensor | None) -> None:
        """Page-lock the mapping so device-to-host copies run asynchronously (once per mapping)."""
        if self._pinned_ptr is not None or buf is None:
            return
        ptr, size = buf.data_ptr(), buf.numel()
        err = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
        if int(err) != 0:
            log.warning("memory_snapshot_not_pinned", path=self._path, error=str(err))
            self._pinned_ptr = 0
        else:
            self._pinned_ptr = ptr

    def unpin(self) -> None:
        """Release the page lock (before the mapping goes)."""
        if self._pinned_ptr:
            torch.cuda.cudart().cudaHostUnregister(self._pinned_ptr)
        self._pinned_ptr = None
