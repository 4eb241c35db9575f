"""The shared-memory snapshot file's layout: a file header, then three slots, each valid once its header is.

::

    [header 4 KiB][slot 0: header 4 KiB | meta (JSON: specs, skeleton) | data][slot 1: …][slot 2: …]

:class:`SlotFile` maps the file (allocated whole at once, ``posix_fallocate``: a full tmpfs fails here, not
with SIGBUS later) and addresses its slots. A slot's header (state, step, sequence, the checksums of data
and metadata, their lengths, a crc of all that) is written after every byte it describes and zeroed before
any of them is rewritten, so a crash at any point leaves the slot either invalid or whole. A restore reads
a slot's data with ``pread`` (:class:`SlotReader`) and checks it piece by piece (:class:`DataCheck`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import time
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from elastic_train.checkpoint.errors import CheckpointError
from elastic_train.checkpoint.specs import TensorSpec
from elastic_train.log import get_logger

log = get_logger(__name__)

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

#: A slot header's fields: (state, step, sequence, data checksum, metadata checksum, metadata length,
#: data length).
Header = tuple[int, int, int, int, int, int, int]


def checksum(view: memoryview) -> int:
    """xxh3-64 of ``view``.

    About 25 GB/s per core here against 4 GB/s for zlib's crc32, and it releases the GIL: sealing a
    snapshot every step takes little CPU from the training loop and from a durable write running beside it.
    """
    return int(xxhash.xxh3_64_intdigest(view))


def free_bytes(directory: str) -> int:
    """Bytes an unprivileged process may still allocate in ``directory``'s filesystem."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def sizes(nbytes: int, meta_len: int) -> tuple[int, int, int, int]:
    """(metadata room, data room, one slot, the whole file) in bytes, for a state of ``nbytes`` with
    ``meta_len`` bytes of metadata (room for twice that)."""
    data_cap = (nbytes + PAGE - 1) // PAGE * PAGE
    meta_cap = max(64 << 10, (2 * meta_len + PAGE - 1) // PAGE * PAGE)
    slot_bytes = PAGE + meta_cap + data_cap
    return meta_cap, data_cap, slot_bytes, PAGE + SLOTS * slot_bytes


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f}"


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


class SlotFile:
    """One snapshot file, mapped: where each slot's header, metadata and data lie, and their bytes.

    ``mm`` (the mapping) and ``buf`` (a uint8 tensor over it) are None until :meth:`allocate` or
    :meth:`open_existing`; ``layout`` is the layout key the file was allocated for.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.mm: mmap.mmap | None = None
        self.buf: torch.Tensor | None = None
        self.layout = ""
        self.meta_cap = 0
        self.data_cap = 0
        self.slot_bytes = 0

    def allocate(self, nbytes: int, meta_len: int, layout: str) -> None:
        """A new file for a state of ``nbytes`` with ``meta_len`` bytes of metadata (room for twice that),
        every slot invalid.

        Raises:
            CheckpointError: the tmpfs cannot hold it (needed and free sizes in the message).
        """
        self.unmap()
        meta_cap, data_cap, slot_bytes, total = sizes(nbytes, meta_len)
        directory = os.path.dirname(self.path)
        # A file of an earlier layout keeps its pages: a larger layout allocates only the difference. (A
        # sharded state's part changes size with the world size; allocating its file anew zeroed every page
        # of it on the training thread at the first step after each reshard.)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                if os.fstat(fd).st_size > total:
                    os.ftruncate(fd, total)
                os.posix_fallocate(fd, 0, total)
            except OSError as exc:
                os.unlink(self.path)
                raise CheckpointError(
                    f"the shared-memory snapshot needs {_mib(total)} MiB in {directory} ({SLOTS} copies of a "
                    f"{_mib(nbytes)} MiB state) but {_mib(free_bytes(directory))} MiB are free "
                    f"({exc.strerror}); enlarge it (docker --shm-size, a k8s emptyDir medium: Memory) or set "
                    "checkpoint.memory: false"
                ) from exc
            self.mm = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        self.buf = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.meta_cap, self.data_cap, self.slot_bytes = meta_cap, data_cap, slot_bytes
        self.layout = layout
        self.mm[:PAGE] = bytes(PAGE)
        for slot in range(SLOTS):  # a re-used file holds an earlier layout's bytes where these headers are
            base = PAGE + slot * slot_bytes
            self.mm[base : base + _INVALID_LEN] = _INVALID
        _HDR.pack_into(self.mm, 0, MAGIC, slot_bytes, meta_cap, data_cap, layout.encode())
        log.info("memory_snapshot_allocated", path=self.path, bytes=total)

    def open_existing(self) -> bool:
        """Map the file a previous process left, if there is one and its header is sound."""
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
        self.mm = mm
        self.buf = torch.frombuffer(mm, dtype=torch.uint8)
        self.slot_bytes, self.meta_cap, self.data_cap = slot_bytes, meta_cap, data_cap
        self.layout = key.rstrip(b"\0").decode("ascii", "replace")
        return True

    def unmap(self) -> None:
        self.buf = None
        if self.mm is not None:
            with contextlib.suppress(BufferError):
                self.mm.close()
            self.mm = None

    def base(self, slot: int) -> int:
        """Where ``slot`` (its header) starts in the file."""
        return PAGE + slot * self.slot_bytes

    def data_start(self, slot: int) -> int:
        """Where ``slot``'s data starts in the file."""
        return PAGE + slot * self.slot_bytes + PAGE + self.meta_cap

    def data(self, slot: int, nbytes: int) -> torch.Tensor:
        """The data region of ``slot`` as a uint8 tensor view (valid until that slot is rewritten)."""
        assert self.buf is not None
        start = self.data_start(slot)
        return self.buf[start : start + nbytes]

    def header(self, slot: int) -> Header | None:
        """``slot``'s header when it is valid (state and crc), else None."""
        assert self.mm is not None
        base = self.base(slot)
        fields = _SLOT.unpack_from(self.mm, base)
        (crc,) = _SLOT_CRC.unpack_from(self.mm, base + _SLOT.size)
        if fields[0] != VALID or zlib.crc32(self.mm[base : base + _SLOT.size]) != crc:
            return None
        return fields

    def clear_header(self, slot: int) -> None:
        """Make ``slot`` invalid: done before any of its bytes is rewritten, or when it turned out torn."""
        assert self.mm is not None
        base = PAGE + slot * self.slot_bytes
        self.mm[base : base + _INVALID_LEN] = _INVALID

    def seal(
        self,
        slot: int,
        meta: tuple[bytes | None, int, bytes],
        step: int,
        seq: int,
        nbytes: int,
        *,
        timed: bool,
    ) -> tuple[float, float]:
        """Seal ``slot``: write its metadata, checksum it and the first ``nbytes`` of data, then the header
        that makes the slot valid, after every byte it describes.

        Args:
            meta: (a prefix written at the metadata's start, None when it is there already; where the rest
                goes; the rest).
            timed: time the data's checksum.

        Returns:
            The wall and CPU seconds of the data's checksum when ``timed`` (zeros otherwise).
        """
        mm = self.mm
        assert mm is not None
        prefix, at, rest = meta
        base = PAGE + slot * self.slot_bytes
        start = base + PAGE
        if prefix is not None:
            mm[start : start + len(prefix)] = prefix
        meta_len = at + len(rest)
        mm[start + at : start + meta_len] = rest
        mv = memoryview(mm)
        sum_meta = checksum(mv[start : start + meta_len])
        data = start + self.meta_cap
        took = (0.0, 0.0)
        if timed:
            t0, c0 = time.perf_counter(), time.thread_time()
            sum_data = checksum(mv[data : data + nbytes])
            took = (time.perf_counter() - t0, time.thread_time() - c0)
        else:
            sum_data = checksum(mv[data : data + nbytes])
        del mv
        header = _SLOT.pack(VALID, step, seq, sum_data, sum_meta, meta_len, nbytes)
        mm[base + _SLOT.size : base + _SLOT.size + 4] = _SLOT_CRC.pack(zlib.crc32(header))
        mm[base : base + _SLOT.size] = header
        return took

    def data_checksum(self, slot: int, nbytes: int) -> int:
        """The checksum of ``slot``'s first ``nbytes`` bytes of data."""
        assert self.mm is not None
        start = self.data_start(slot)
        mv = memoryview(self.mm)
        value = checksum(mv[start : start + nbytes])
        del mv
        return value

    def meta_bytes(self, slot: int, meta_len: int) -> memoryview:
        """``slot``'s metadata (a view: release it before the file is unmapped)."""
        assert self.mm is not None
        base = self.base(slot) + PAGE
        return memoryview(self.mm)[base : base + meta_len]
