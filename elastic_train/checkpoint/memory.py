"""The in-memory tier: a double-buffered snapshot of one worker's state in node shared memory.

One file per (run, owner, local rank) in a tmpfs (``/dev/shm``), fully allocated when the first state is
saved (``posix_fallocate``: a full tmpfs fails here, not with SIGBUS later). Layout::

    [header 4 KiB][slot 0: header 4 KiB | meta (JSON skeleton) | data][slot 1: …][slot 2: …]

A save invalidates the header of the oldest slot that is neither the newest nor pinned (by a durable write
reading it) and copies the tensors into it; a persistent background copier finishes the copies the caller
deferred (parameters and optimizer state, which nothing changes before the next optimizer step — see
:meth:`MemorySnapshot.fence`), writes the skeleton, computes xxh3-64 over data and skeleton and only then
publishes step + checksums in the slot header (a CPU state under :data:`SEAL_INLINE_BYTES` is copied and
sealed by the caller: handing it over costs more). A crash at any point leaves the previous snapshot
intact, and a torn slot fails its header or checksum. On a GPU the slot is page-locked and the device-to-host
copies run on a side stream.

The *owner* is the process whose lifetime scopes the snapshot: the torchrun agent (the worker's parent),
which survives worker restarts. Files of owners that no longer exist are swept at start-up, and
:meth:`MemorySnapshot.release` deletes the file when the job is done.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import operator
import os
import re
import struct
import threading
import time
import zlib
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch
import xxhash

from elastic_train.checkpoint import drain, schema
from elastic_train.checkpoint.codec import Flat, TensorSpec, destinations
from elastic_train.checkpoint.errors import CheckpointError
from elastic_train.checkpoint.plan import Planned
from elastic_train.envvars import ENV_SHM_OWNER
from elastic_train.log import get_logger
from elastic_train.procs import owner_alive, start_ms

log = get_logger(__name__)

PREFIX = "elastic_train."
PAGE = 4096
MAGIC = b"ETSNAP01"
_HDR = struct.Struct("<8sQQQ64s")  # magic, slot_bytes, meta_cap, data_cap, layout key
_SLOT = struct.Struct("<IqQQQQQ")  # state, step, seq, sum_data, sum_meta, meta_len, data_len
_SLOT_CRC = struct.Struct("<I")
#: What a slot header reads while the slot is being written: all zero (no valid state, no CRC).
_INVALID_LEN = _SLOT.size + _SLOT_CRC.size
_INVALID = bytes(_INVALID_LEN)
#: Slots per snapshot file: two alternate every step; the third lets a durable write read its step straight
#: from shared memory (pinned) while the two others keep alternating. The writer needs no private copy of
#: the state, so the memory used is the same as two slots plus a staging buffer.
SLOTS = 3
VALID = 0x5A5A5A5A
#: CPU states up to this size are copied in ``save`` itself (about 0.5 ms at memory bandwidth).
INLINE_BYTES = 4 << 20
#: CPU states up to this size are also sealed in ``save`` (about 0.1 ms of checksum per MiB): handing the seal
#: to the copier thread costs the training thread more than that (docs/training.md, measured at 1.3 MB).
SEAL_INLINE_BYTES = 2 << 20
_NAME_RE = re.compile(r"^elastic_train\.(?P<run>[^/]+)\.(?P<pid>\d+)-(?P<ctime>\d+)\.(?P<lr>\d+)$")


def checksum(view: memoryview) -> int:
    """xxh3-64 of ``view``.

    About 25 GB/s per core here against 4 GB/s for zlib's crc32, and it releases the GIL: sealing a
    snapshot every step takes little CPU from the training loop and from a durable write running beside it.
    """
    return int(xxhash.xxh3_64_intdigest(view))


def owner_identity() -> tuple[int, int]:
    """(pid, start time in ms) of the owner process, which scopes the snapshot's lifetime."""
    pid = int(os.environ.get(ENV_SHM_OWNER) or os.getppid())
    try:
        return pid, start_ms(pid)
    except psutil.NoSuchProcess:
        return pid, 0


def free_bytes(directory: str) -> int:
    """Bytes an unprivileged process may still allocate in ``directory``'s filesystem."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def memory_tier_refusal_check(directory: str, path: str, file_bytes: int, state_bytes: int) -> None:
    """Refuse a memory tier the node's tmpfs cannot hold for all its local ranks (:mod:`.capacity`).

    The room is the free space plus the snapshot files of this run and owner already there (this rank's old
    one, which is replaced, and its siblings', which count in the need).

    Raises:
        CheckpointSetupError: the node's snapshots do not fit.
    """
    from elastic_train.checkpoint.capacity import check_memory_tier

    raw = os.environ.get("LOCAL_WORLD_SIZE", "")
    local_ranks = int(raw) if raw.isdigit() and int(raw) > 0 else 1
    mine = os.path.basename(path).rpartition(".")[0] + "."
    held = 0
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if name.startswith(mine):
                with contextlib.suppress(OSError):
                    held += os.stat(os.path.join(directory, name)).st_blocks * 512
    check_memory_tier(
        directory=directory,
        local_ranks=local_ranks,
        slots=SLOTS,
        file_bytes=file_bytes,
        state_bytes=state_bytes,
        room=free_bytes(directory) + held,
    )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f}"


def _safe(run_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", run_id)


def sweep_stale(directory: str) -> list[str]:
    """Delete snapshot files whose owner process is gone; returns their paths."""
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            m = _NAME_RE.match(name)
            if not m:
                continue
            pid, ctime = int(m["pid"]), int(m["ctime"])
            if not owner_alive(pid, ctime):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(directory, name))
                    removed.append(os.path.join(directory, name))
    return removed


def _snapshots(directory: str, keep: Callable[[re.Match[str]], bool]) -> list[str]:
    """Paths of the snapshot files in ``directory`` whose parsed name ``keep`` accepts."""
    with contextlib.suppress(OSError):
        return sorted(
            os.path.join(directory, n) for n in os.listdir(directory) if (m := _NAME_RE.match(n)) and keep(m)
        )
    return []


def owned_by(directory: str, pid: int) -> list[str]:
    """Paths of every snapshot file in ``directory`` whose owner is process ``pid``."""
    return _snapshots(directory, lambda m: int(m["pid"]) == pid)


def snapshot_files(directory: str, run_id: str) -> list[str]:
    """Paths of every snapshot file of ``run_id`` in ``directory`` (any owner, any local rank)."""
    run = _safe(run_id)
    return _snapshots(directory, lambda m: m["run"] == run)


@dataclass(frozen=True, slots=True)
class Held:
    """A valid snapshot found in shared memory."""

    slot: int
    step: int
    skeleton: Any
    specs: tuple[TensorSpec, ...]
    nbytes: int
    data_sum: int | None = None
    """The data's checksum still to be verified as it is read (:class:`DataCheck`); None: verified."""


class DataCheck:
    """A slot's data checksum computed piece by piece, in order, as a restore reads (sends or lands) it.

    The restore then reads the slot once: hashing a bucket right before it goes out also brings its pages
    in, so the check costs no pass of its own. Only :meth:`ok` says whether what was read may be used.
    """

    def __init__(self, expected: int, nbytes: int) -> None:
        self._hash = xxhash.xxh3_64()
        self._expected = expected
        self._nbytes = nbytes
        self._read = 0

    def update(self, data: torch.Tensor) -> None:
        """Hash the next bytes of the slot's data (a contiguous uint8 tensor)."""
        self._hash.update(data.numpy())  # type: ignore[arg-type]  # a numpy array is a buffer
        self._read += int(data.numel())

    def ok(self) -> bool:
        """Whether every byte was hashed and the checksum is the one the slot was sealed with."""
        return self._read == self._nbytes and self._hash.intdigest() == self._expected


class SlotReader:
    """Reads a slot's data with ``pread`` straight into the tensors it lands in.

    A restarted worker has the snapshot file mapped but none of its pages in its page table: reading the
    mapping faults every 4 KiB page in (measured here: the faults cost about twice the copy itself, about
    0.3 s per GB). ``pread`` copies from the tmpfs pages into the destination in the kernel, with no fault.

    Args:
        path: the snapshot file.
        offset: where the slot's data starts in it.
    """

    def __init__(self, path: str, offset: int) -> None:
        self._fd = os.open(path, os.O_RDONLY)
        self._offset = offset

    def read_into(self, start: int, dest: torch.Tensor) -> None:
        """Fill ``dest`` (a contiguous uint8 tensor) with the data's bytes from ``start`` on.

        Raises:
            CheckpointError: the file ended first (it was truncated under the reader).
        """
        view = memoryview(dest.numpy()).cast("B")  # type: ignore[arg-type]  # a numpy array is a buffer
        done = 0
        while done < view.nbytes:
            n = os.preadv(self._fd, [view[done:]], self._offset + start + done)
            if n <= 0:
                raise CheckpointError(f"shared-memory snapshot ended while a restore read it ({n})")
            done += n

    def close(self) -> None:
        os.close(self._fd)


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


#: One encoder for every step's skeleton pieces: ``json.dumps`` with non-default settings builds a new
#: encoder per call, which costs more than encoding the small values of a step.
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=True)
_quote = json.encoder.encode_basestring_ascii  # what the encoder does to a str (ensure_ascii)
_CONSTANTS = {None: b"null", True: b"true", False: b"false"}
_SCALARS = frozenset({int, float, str, bool, type(None)})


def _dumps(v: Any) -> bytes:
    """``v``'s compact JSON (as ``json.dumps``), with the scalars of a step's skeleton short-cut."""
    kind = type(v)
    if kind is str:
        return _quote(v).encode()
    if kind is int:
        return b"%d" % v
    if v is None or kind is bool:
        return _CONSTANTS[v]
    return _ENCODER.encode(v).encode()


class _SkeletonJson:
    """The JSON of skeletons whose big parts are the same objects step after step (a planned snapshot's
    model and optimizer state, param groups, Python RNG state): the text of a dict or list seen at the
    previous step is reused, the rest encoded. Skeletons are never changed in place once handed to a save."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[Any, bytes]] = {}
        self._now: dict[int, tuple[Any, bytes]] = {}

    def dumps(self, skeleton: Any) -> bytes:
        self._now = {}
        text = self._enc(skeleton, 0)
        self._last = self._now
        return text

    def _enc(self, v: Any, depth: int) -> bytes:
        kind = type(v)
        if kind is not dict and kind is not list:
            return _dumps(v)
        hit = self._last.get(id(v))
        if hit is not None and hit[0] is v:
            self._now[id(v)] = hit
            return hit[1]
        if depth < 2 and kind is dict and not _SCALARS.issuperset(map(type, v.values())):
            # the top level and the parts (optimizer → state, rng → python): where cached pieces are
            text = b"{" + b",".join(_dumps(k) + b":" + self._enc(x, depth + 1) for k, x in v.items()) + b"}"
        else:
            text = _dumps(v)
        self._now[id(v)] = (v, text)
        return text


@dataclass(slots=True)
class _CopyJob:
    """One snapshot being written: what is left to copy, then to seal."""

    slot: int
    step: int
    seq: int
    flat: Flat
    dests: list[torch.Tensor | None]
    later: list[int]
    """Indices of the CPU tensors the background copier copies."""
    event: Any
    """CUDA event recorded after the last device-to-host copy (None without GPU tensors)."""
    device: torch.device | None = None
    verify: Callable[[], bool] | None = None
    """A planned snapshot's full structure check (see :class:`~elastic_train.checkpoint.plan.Planned`),
    run by the copier before the deferred copies and the seal; None: nothing left to check."""
    previous: int | None = None
    """The newest slot before this one: the newest again if the check fails (this slot stays invalid)."""


class MemorySnapshot:
    """Double-buffered shared-memory snapshot of one worker, plus a slot a durable write may pin.

    Not thread-safe: one training loop uses it (the durable writer only pins, reads and unpins a slot).
    """

    def __init__(self, directory: str, run_id: str, local_rank: int) -> None:
        pid, ctime = owner_identity()
        self.path = os.path.join(directory, f"{PREFIX}{_safe(run_id)}.{pid}-{ctime}.{local_rank}")
        self._mm: mmap.mmap | None = None
        self._buf: torch.Tensor | None = None
        self._layout = ""
        self._meta_cap = 0
        self._data_cap = 0
        self._slot_bytes = 0
        self._newest: int | None = None
        self._seq = 0
        self._slot_seq = [0] * SLOTS
        #: Typed views of each slot's tensors in the current mapping (dropped by :meth:`_unmap`).
        self._dests: dict[int, list[torch.Tensor | None]] = {}
        self._cond = threading.Condition()
        self._sealing: int | None = None
        self._job: _CopyJob | None = None
        self._copying = False
        self._worker: threading.Thread | None = None
        self._worker_pid = 0
        self._stream: Any = None
        self._pinned_ptr: int | None = None
        #: The layout key, the start of the slots' metadata (the specs' JSON) and the specs it encodes.
        self._specs_json: tuple[str, bytes, tuple[TensorSpec, ...]] = ("", b"", ())
        self._meta_need = 0
        self._specs: tuple[TensorSpec, ...] | None = None
        self._pinned: set[int] = set()
        self.sealed_step: int | None = None
        #: The last step whose planned snapshot failed its structure check (its slot was left invalid).
        self.rejected_step: int | None = None
        self._error: BaseException | None = None
        #: Per slot: the copy lists of the current layout (specs object, deferred set, route).
        self._routes: dict[int, tuple[Any, Any, Any]] = {}
        self._gpu: tuple[Any, list[int]] | None = None
        #: Per slot: the layout whose tensor specs are written at the start of its metadata.
        self._meta_prefix: dict[int, str] = {}
        self.stats = SaveStats()
        self._skeleton_json = _SkeletonJson()
        if os.environ.get("TORCHELASTIC_RUN_ID"):  # a worker torchrun started (and stops with SIGTERM)
            drain.register(self)

    # -- lifecycle -------------------------------------------------------------------------------------
    def _allocate(self, flat: Flat, meta_len: int) -> None:
        self._unmap()
        data_cap = (flat.nbytes + PAGE - 1) // PAGE * PAGE
        meta_cap = max(64 << 10, (2 * meta_len + PAGE - 1) // PAGE * PAGE)
        slot_bytes = PAGE + meta_cap + data_cap
        total = PAGE + SLOTS * slot_bytes
        directory = os.path.dirname(self.path)
        memory_tier_refusal_check(directory, self.path, total, flat.nbytes)  # the node's whole need
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, total)
            except OSError as exc:
                os.unlink(self.path)
                raise CheckpointError(
                    f"the shared-memory snapshot needs {_mib(total)} MiB in {directory} ({SLOTS} copies of a "
                    f"{_mib(flat.nbytes)} MiB state) but {_mib(free_bytes(directory))} MiB are free "
                    f"({exc.strerror}); enlarge it (docker --shm-size, a k8s emptyDir medium: Memory) or set "
                    "checkpoint.memory: false"
                ) from exc
            self._mm = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        self._buf = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._meta_cap, self._data_cap, self._slot_bytes = meta_cap, data_cap, slot_bytes
        self._layout = flat.layout_key
        self._specs = flat.specs
        self._slot_seq = [0] * SLOTS
        self._mm[:PAGE] = bytes(PAGE)
        _HDR.pack_into(self._mm, 0, MAGIC, slot_bytes, meta_cap, data_cap, self._layout.encode())
        self._newest = None
        log.info("memory_snapshot_allocated", path=self.path, bytes=total)

    def _open_existing(self) -> bool:
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            return False
        try:
            size = os.fstat(fd).st_size
            if size < PAGE:
                return False
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        magic, slot_bytes, meta_cap, data_cap, key = _HDR.unpack_from(mm, 0)
        if magic != MAGIC or PAGE + SLOTS * slot_bytes != size or slot_bytes != PAGE + meta_cap + data_cap:
            mm.close()
            return False
        self._mm = mm
        self._buf = torch.frombuffer(mm, dtype=torch.uint8)
        self._slot_bytes, self._meta_cap, self._data_cap = slot_bytes, meta_cap, data_cap
        self._layout = key.rstrip(b"\0").decode("ascii", "replace")
        return True

    def _unmap(self) -> None:
        self._specs = None
        self._routes = {}
        self._meta_prefix = {}
        self._unpin_host_memory()
        self._buf = None
        self._dests = {}
        if self._mm is not None:
            with contextlib.suppress(BufferError):
                self._mm.close()
            self._mm = None

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
    def _slot_base(self, slot: int) -> int:
        return PAGE + slot * self._slot_bytes

    def _read_slot(self, slot: int) -> tuple[int, int, int, int, int, int, int] | None:
        assert self._mm is not None
        base = self._slot_base(slot)
        fields = _SLOT.unpack_from(self._mm, base)
        (crc,) = _SLOT_CRC.unpack_from(self._mm, base + _SLOT.size)
        if fields[0] != VALID or zlib.crc32(self._mm[base : base + _SLOT.size]) != crc:
            return None
        return fields

    def newest_valid(self, *, verify_data: bool = True) -> Held | None:
        """The newest slot whose header and checksums verify (maps the file if it exists).

        Args:
            verify_data: hash the data here. Without it only the header and the metadata are verified and
                the returned :attr:`Held.data_sum` is checked by whoever reads the data (a restore hashes
                each bucket as it sends or lands it, :class:`DataCheck`, and on a mismatch
                :meth:`invalidate`-s the slot and looks again).
        """
        if self._mm is None and not self._open_existing():
            return None
        self.wait_idle()
        assert self._mm is not None
        headers = []
        for slot in range(SLOTS):
            fields = self._read_slot(slot)
            if fields is not None:
                headers.append((slot, fields))
                self._seq = max(self._seq, fields[2])
                self._slot_seq[slot] = fields[2]
        # Newest first, and only until one verifies: hashing every slot would triple a large restore's reads.
        for slot, fields in sorted(headers, key=lambda h: h[1][1], reverse=True):
            _, step, _, sum_data, sum_meta, meta_len, data_len = fields
            base = self._slot_base(slot)
            if meta_len > self._meta_cap or data_len > self._data_cap:
                continue
            meta = memoryview(self._mm)[base + PAGE : base + PAGE + meta_len]
            data = memoryview(self._mm)[
                base + PAGE + self._meta_cap : base + PAGE + self._meta_cap + data_len
            ]
            ok = checksum(meta) == sum_meta and (not verify_data or checksum(data) == sum_data)
            if not ok:
                log.warning("memory_snapshot_torn", path=self.path, slot=slot, step=step)
                self._slot_seq[slot] = 0  # rewritten first
                continue
            try:  # checksums catch torn writes, not a bad writer: validate before anything is used
                skeleton, specs = schema.snapshot_meta(bytes(meta), data_len, self._known_meta)
            except ValueError as exc:
                log.warning("memory_snapshot_invalid", path=self.path, slot=slot, step=step, reason=str(exc))
                continue
            self._newest = slot
            return Held(slot, step, skeleton, specs, data_len, None if verify_data else sum_data)
        return None

    def invalidate(self, slot: int) -> None:
        """Mark ``slot`` torn (its data failed :class:`DataCheck`): no reader takes it again, and it is the
        first one rewritten."""
        assert self._mm is not None
        base = self._slot_base(slot)
        self._mm[base : base + _SLOT.size + _SLOT_CRC.size] = bytes(_SLOT.size + _SLOT_CRC.size)
        self._slot_seq[slot] = 0
        if self._newest == slot:
            self._newest = None
        log.warning("memory_snapshot_torn", path=self.path, slot=slot)

    def reader(self, slot: int) -> SlotReader:
        """A reader of ``slot``'s data through the file (see :class:`SlotReader`); close it after use."""
        return SlotReader(self.path, self._slot_base(slot) + PAGE + self._meta_cap)

    def data(self, slot: int, nbytes: int) -> torch.Tensor:
        """The data region of ``slot`` as a uint8 tensor view (valid until that slot is rewritten)."""
        assert self._buf is not None
        start = self._slot_base(slot) + PAGE + self._meta_cap
        return self._buf[start : start + nbytes]

    # -- writing -----------------------------------------------------------------------------------------
    def save(self, step: int, flat: Flat, *, defer: Container[int] = (), background: bool = True) -> int:
        """Copy ``flat`` into the oldest free slot and seal it; returns the slot.

        The tensors whose index is in ``defer`` may still be copied after this returns (by the background
        copier, or on a side CUDA stream): the caller must not modify them before :meth:`fence` — the
        optimizer step pre-hook of :meth:`CheckpointManager.attach` does that. Every other tensor is copied
        (or, on a GPU, ordered before any later kernel of the current stream) before this returns, so state
        that changes outside the optimizer step (BatchNorm buffers, RNG states) is taken at this step.
        The slot is sealed (checksums, then the header) only once every byte of it is written.

        Raises:
            CheckpointError: the shared memory cannot hold the state (needed and free sizes in the message),
                or a previous background copy or seal failed.
        """
        if self._error is not None:
            self.raise_error()
        self.wait_idle()  # the previous snapshot is sealed (normally long before the next step ends)
        if self._mm is None:
            self._open_existing()
        if flat.specs is not self._specs or self._mm is None:
            # Comparing the specs is cheaper than their digest (a restarted worker's snapshot has only that);
            # a planned snapshot hands over the very same specs object while its layout holds.
            same = self._mm is not None and (
                flat.specs == self._specs if self._specs is not None else flat.layout_key == self._layout
            )
            if not same:
                self._allocate(flat, max(self._meta_need, len(self._meta(flat, flat.layout_key))))
                self._meta_need = 0
            self._specs = flat.specs
            self._routes = {}
        if self._meta_need > self._meta_cap:
            self._allocate(flat, self._meta_need)
            self._meta_need = 0
        # The oldest slot that is neither the newest snapshot nor pinned by a durable write: with one slot
        # pinned, the other two still alternate, so a crash mid-copy always leaves the previous step valid.
        # Nothing else changes these while the copier is idle but a durable writer unpinning; only this
        # thread pins, so a slot is only waited for (under the lock) when one is pinned.
        slot = self._oldest_free() if not self._pinned else None
        if slot is None:
            with self._cond:
                while (slot := self._oldest_free()) is None:
                    self._cond.wait()
        assert self._mm is not None and self._buf is not None
        base = PAGE + slot * self._slot_bytes
        self._mm[base : base + _INVALID_LEN] = _INVALID
        dests = self._dests.get(slot)
        if dests is None:
            dests = self._dests[slot] = destinations(flat.specs, self.data(slot, flat.nbytes))
        event = None
        gpu = self._gpu  # decided once per specs object (see _on_gpu)
        on_gpu = gpu[1] if gpu is not None and gpu[0] is flat.specs else self._on_gpu(flat, dests)
        if on_gpu:
            event = self._copy_from_gpu(flat, dests, on_gpu, defer)
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
            route = self._routes.get(slot)
            if (
                route is None
                or route[0] is not flat.specs
                or not (route[1] is deferred or route[1] == deferred)
            ):
                route = self._route(slot, flat, deferred)
            now, later, now_dests, take = route[2]
            if now:
                if take is True:
                    sources = flat.tensors
                elif take is not None:
                    sources = take(flat.tensors)
                else:
                    sources = (flat.tensors[now[0]],)
                if self.stats.record:
                    t0, c0 = time.perf_counter(), time.thread_time()
                    torch._foreach_copy_(now_dests, sources)
                    self.stats.copy_s += time.perf_counter() - t0
                    self.stats.copy_cpu_s += time.thread_time() - c0
                else:
                    torch._foreach_copy_(now_dests, sources)
        self._seq += 1
        self._slot_seq[slot] = self._seq
        device = flat.tensors[on_gpu[0]].device if on_gpu else None
        verify = flat.verify if isinstance(flat, Planned) else None
        job = _CopyJob(slot, step, self._seq, flat, dests, later, event, device, verify, self._newest)
        self._newest = slot
        if not background or (not on_gpu and flat.nbytes <= SEAL_INLINE_BYTES):
            if verify is not None and not verify():
                self._reject(job)
                return slot
            self._copy(job)
            self._seal(job, timed=self.stats.record)
            self.raise_error()
            return slot
        # A larger state's seal (metadata, checksums, header) runs on the copier thread, and the slot is not
        # valid before it is done.
        if self.stats.record:
            t0, c0 = time.perf_counter(), time.thread_time()
            self._hand_over(job, later, verify, slot)
            self.stats.wake_s += time.perf_counter() - t0
            self.stats.wake_cpu += time.thread_time() - c0
        else:
            self._hand_over(job, later, verify, slot)
        return slot

    def _hand_over(self, job: _CopyJob, later: list[int], verify: Any, slot: int) -> None:
        """Give ``job`` to the copier thread (started here when there is none) and wake it."""
        with self._cond:
            # The fence also waits for a pending structure check: the state may change once it returns.
            self._job, self._copying, self._sealing = job, bool(later) or verify is not None, slot
            # The copier never returns but by an exception (it then clears _worker); a forked child has none.
            if self._worker is None or self._worker_pid != os.getpid():
                self._worker = threading.Thread(target=self._work, name="ckpt-memory-copy", daemon=True)
                self._worker_pid = os.getpid()
                self._worker.start()
            self._cond.notify_all()

    def _oldest_free(self) -> int | None:
        """The slot with the lowest sequence that is neither the newest nor pinned (the first such in
        order), or None."""
        newest, pinned, seq = self._newest, self._pinned, self._slot_seq
        slot = None
        for s in range(SLOTS):
            if s != newest and s not in pinned and (slot is None or seq[s] < seq[slot]):
                slot = s
        return slot

    def _route(self, slot: int, flat: Flat, defer: Container[int]) -> tuple[Any, Any, Any]:
        """The tensors copied now and those the copier copies, kept per slot and layout: (specs, ``defer``,
        (indices now, indices later, destinations now, how to take the sources now from the tensors))."""
        dests = self._dests[slot]
        now = [i for i, d in enumerate(dests) if d is not None and i not in defer]
        later = [i for i, d in enumerate(dests) if d is not None and i in defer]
        # The sources now: every tensor (the tensors as they are: True), an itemgetter of several, or one.
        take: Any = True if len(now) == len(dests) else operator.itemgetter(*now) if len(now) > 1 else None
        route = (flat.specs, defer, (now, later, [dests[i] for i in now], take))
        self._routes[slot] = route
        return route

    def _on_gpu(self, flat: Flat, dests: list[torch.Tensor | None]) -> list[int]:
        """Indices of the CUDA tensors of ``flat`` (decided once per specs object: a planned snapshot's
        tensors keep their device while its plan holds)."""
        cached = self._gpu
        if cached is not None and cached[0] is flat.specs:
            return cached[1]
        on_gpu = [i for i, t in enumerate(flat.tensors) if t.is_cuda and dests[i] is not None]
        self._gpu = (flat.specs, on_gpu)
        return on_gpu

    @staticmethod
    def inline(flat: Flat) -> bool:
        """Whether :meth:`save` copies all of ``flat`` itself (a small state, with no CUDA tensor).

        Waking the copier thread for the copies (and, on a machine whose cores are all busy training,
        waiting for it to be scheduled) costs more than copying a few MiB. Up to :data:`SEAL_INLINE_BYTES`
        :meth:`save` also seals the slot itself; above, the copier thread does.
        """
        return flat.nbytes <= INLINE_BYTES and not any(t.is_cuda for t in flat.tensors)

    def _meta_parts(self, flat: Flat, key: str) -> tuple[bytes, bytes]:
        """The slot's metadata as (prefix, rest): ``{"specs":[…],"skeleton":…}``, cut after the specs.

        The specs only change with the layout: their JSON is built once per layout (and written once per
        slot), the skeleton's per step.
        """
        if self._specs_json[0] != key:
            specs = json.dumps([s.to_json() for s in flat.specs], separators=(",", ":"))
            self._specs_json = (key, b'{"specs":' + specs.encode() + b',"skeleton":', tuple(flat.specs))
        return self._specs_json[1], self._skeleton_json.dumps(flat.skeleton) + b"}"

    @property
    def _known_meta(self) -> tuple[bytes, tuple[TensorSpec, ...]] | None:
        """The start of the last metadata encoded here (the specs' JSON) and those specs, or None: a lookup
        parses only the skeleton of a slot whose metadata starts with these bytes."""
        _, prefix, specs = self._specs_json
        return (prefix, specs) if prefix else None

    def _meta(self, flat: Flat, key: str) -> bytes:
        prefix, rest = self._meta_parts(flat, key)
        return prefix + rest

    def _copy_from_gpu(
        self, flat: Flat, dests: list[torch.Tensor | None], on_gpu: list[int], defer: Container[int]
    ) -> Any:
        """Queue the device-to-host copies on a side stream; returns the event that marks their end.

        Tensors not in ``defer`` are copied first and the current stream waits for them right away (on the
        device: the host does not block), so a later kernel cannot change them before they are copied.
        """
        device = flat.tensors[on_gpu[0]].device
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        self._pin_host_memory()
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

    def _pin_host_memory(self) -> None:
        """Page-lock the mapping so device-to-host copies run asynchronously (once per mapping)."""
        if self._pinned_ptr is not None or self._buf is None:
            return
        ptr, size = self._buf.data_ptr(), self._buf.numel()
        err = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
        if int(err) != 0:
            log.warning("memory_snapshot_not_pinned", path=self.path, error=str(err))
            self._pinned_ptr = 0
        else:
            self._pinned_ptr = ptr

    def _unpin_host_memory(self) -> None:
        if self._pinned_ptr:
            torch.cuda.cudart().cudaHostUnregister(self._pinned_ptr)
        self._pinned_ptr = None

    def _work(self) -> None:
        """The background copier: finishes each snapshot's deferred copies, then seals it."""
        try:
            self._work_loop()
        finally:  # (an exception outside the per-job handlers) the next save starts another copier
            with self._cond:
                if self._worker is threading.current_thread():
                    self._worker = None

    def _work_loop(self) -> None:
        while True:
            with self._cond:
                while self._job is None:
                    self._cond.wait()
                job = self._job
            try:
                # A planned snapshot's full structure check, off the training thread: before the deferred
                # copies (nothing changes those tensors before the fence) and before the seal.
                if job.verify is not None and not job.verify():
                    self._reject(job)
                    continue
                self._copy(job)
            except BaseException as exc:  # reported to the loop by raise_error()/fence()
                log.error("memory_snapshot_copy_failed", path=self.path, step=job.step, error=str(exc))
                self._error = exc
                with self._cond:
                    self._job, self._copying, self._sealing = None, False, None
                    self._cond.notify_all()
                continue
            with self._cond:
                self._copying = False
                self._cond.notify_all()
            self._seal(job)
            with self._cond:
                self._job = None
                if self._sealing == job.slot:
                    self._sealing = None
                self._cond.notify_all()

    def _reject(self, job: _CopyJob) -> None:
        """Leave ``job``'s slot invalid: the state's structure is no longer the snapshot's plan, so what was
        copied may be wrong. The previous snapshot stays the newest; the state's owner re-plans the next one
        (the failed check marked it)."""
        if job.event is not None:
            job.event.synchronize()  # no copy still lands in the slot once it is handed out again
        log.info("memory_snapshot_replanned", path=self.path, step=job.step)
        with self._cond:
            if self._newest == job.slot:
                self._newest = job.previous
            self._slot_seq[job.slot] = 0  # rewritten first
            self.rejected_step = job.step
            if self._job is job:
                self._job, self._copying, self._sealing = None, False, None
            self._cond.notify_all()

    @staticmethod
    def _copy(job: _CopyJob) -> None:
        """The deferred CPU copies (GPU copies run on the side stream meanwhile)."""
        if job.later:
            # C-level picks: on the copier thread, Python per tensor holds the interpreter lock the
            # training thread needs.
            take = operator.itemgetter(*job.later)
            dests, srcs = take(job.dests), take(job.flat.tensors)
            if len(job.later) == 1:
                dests, srcs = (dests,), (srcs,)
            torch._foreach_copy_(list(dests), list(srcs))

    def _seal(self, job: _CopyJob, *, timed: bool = False) -> None:
        """Write the metadata, checksum data and metadata, then publish the header (the slot is valid).

        ``timed``: on the training thread, while :attr:`stats` records (the data's checksum counts with the
        copy: both are the snapshot's floor, not its Python).
        """
        try:
            assert self._mm is not None
            if job.event is not None:
                job.event.synchronize()
            prefix, rest = self._meta_parts(job.flat, self._layout)  # save re-allocates for another layout
            meta_len = len(prefix) + len(rest)
            if meta_len > self._meta_cap:
                # Left unsealed (the previous snapshot stays the valid one); the next save makes room.
                log.warning("memory_snapshot_meta_grew", path=self.path, step=job.step, bytes=meta_len)
                self._meta_need = 2 * meta_len
                return
            base = self._slot_base(job.slot)
            if self._meta_prefix.get(job.slot) != self._layout:  # what changed: the skeleton, every step
                self._mm[base + PAGE : base + PAGE + len(prefix)] = prefix
                self._meta_prefix[job.slot] = self._layout
            self._mm[base + PAGE + len(prefix) : base + PAGE + meta_len] = rest
            mv = memoryview(self._mm)
            sum_meta = checksum(mv[base + PAGE : base + PAGE + meta_len])
            start = base + PAGE + self._meta_cap
            if timed:
                t0, c0 = time.perf_counter(), time.thread_time()
                sum_data = checksum(mv[start : start + job.flat.nbytes])
                self.stats.copy_s += time.perf_counter() - t0
                self.stats.copy_cpu_s += time.thread_time() - c0
            else:
                sum_data = checksum(mv[start : start + job.flat.nbytes])
            del mv
            header = _SLOT.pack(VALID, job.step, job.seq, sum_data, sum_meta, meta_len, job.flat.nbytes)
            self._mm[base + _SLOT.size : base + _SLOT.size + 4] = _SLOT_CRC.pack(zlib.crc32(header))
            self._mm[base : base + _SLOT.size] = header
            self.sealed_step = job.step
        except BaseException as exc:  # reported to the loop by raise_error()
            log.error("memory_snapshot_seal_failed", path=self.path, step=job.step, error=str(exc))
            self._error = exc

    def fence(self) -> None:
        """Return once the last snapshot's tensors are copied (and a planned snapshot's structure checked):
        they may be modified from now on.

        On a GPU the copies are ordered before the current stream's later kernels instead (the host does
        not wait). The seal (checksums) may still be running.

        Raises:
            CheckpointError: the background copy failed.
        """
        with self._cond:
            while self._copying:
                self._cond.wait()
            job = self._job
        if job is not None and job.event is not None:
            torch.cuda.current_stream(job.device).wait_event(job.event)
        self.raise_error()

    def raise_error(self) -> None:
        """Raise a failure of the background sealer in the caller's thread."""
        if self._error is not None:
            exc, self._error = self._error, None
            raise CheckpointError(f"sealing the shared-memory snapshot failed: {exc}") from exc

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until the last snapshot is copied and sealed (or failed); False if it still is not after
        ``timeout`` seconds."""
        if self._job is None and self._sealing is None:
            # Only save() (the training thread) sets them, and the copier clears them once done (the job
            # first): both None is idle, and stays so until the next save.
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._sealing is not None or self._job is not None:
                if deadline is None:
                    self._cond.wait()
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def pin(self, slot: int) -> None:
        """Keep ``slot`` from being rewritten (while a background copy reads it)."""
        with self._cond:
            self._pinned.add(slot)

    def unpin(self, slot: int) -> None:
        with self._cond:
            self._pinned.discard(slot)
            self._cond.notify_all()
