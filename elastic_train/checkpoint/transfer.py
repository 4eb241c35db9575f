"""Moving a restored flat state from its holder to the ranks without it, straight into its tensors.

The holder sends the flat bytes (its shared-memory slot, or a durable checkpoint it read) to the ranks that
do not hold the step, in chunks of at most :data:`BUCKET` bytes, :data:`WINDOW` in flight, as point-to-point
messages along a pipelined chain (holder → first receiver → …): the state crosses each link once, and ranks
that hold the step themselves take no part. Before a chunk of a shared-memory slot goes out, the holder
hashes it (:class:`~elastic_train.checkpoint.slots.DataCheck`): the slot is verified while it is sent, in
the same pass that brings its pages in, and the restore's verdict afterwards says whether the bytes may be
used.

Both ends cut the state the same way (:func:`chunks_of`, from its tensor specs alone): a tensor of at least
:data:`DIRECT_MIN` bytes travels in chunks that lie inside it, which a receiver receives straight into where
the tensor lands; the small tensors and the alignment gaps between them travel together, through one of a
few reused bounce buffers, and are copied to their places. Where they land is :class:`Landing`: a *live*
tensor the state will be loaded into (the model's parameters, an optimizer's existing buffers, where dtype
and shape match), or a compact buffer for the rest. Loading the state then finds the parameters already
holding it (``copy_`` of a tensor onto itself returns at once), so the bytes are written once between the
socket and the model, and the big ones by the socket itself.
"""

from __future__ import annotations

import bisect
import collections
import pickle
import queue
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from elastic_train.checkpoint.codec import ALIGN, dtype_of, tensor_at
from elastic_train.checkpoint.specs import TensorSpec

#: Bytes per message (chain hop) of a restored state's small tensors at most (they travel through reused
#: bounce buffers of this size), and messages in flight at once.
BUCKET = 8 << 20
WINDOW = 4
#: Bytes per message of a tensor received in place at most: fewer, larger messages keep the link busier
#: (a 1 GB restore on loopback moved 20-25% faster in 32 MiB messages than in 8 MiB ones).
DIRECT_BUCKET = 32 << 20
#: Chunks of a shared-memory slot its holder reads (and hashes) ahead of the one it sends.
AHEAD = 2
#: A tensor of at least this many bytes is received straight into where it lands (no bounce, no copy).
DIRECT_MIN = 256 << 10
#: Tags of the two messages that carry the state's metadata to a receiver (chunk k is tag k).
_META_TAG = 1 << 28

#: One chunk of the flat state: (start, end, direct): ``direct`` chunks lie inside one tensor's bytes.
Chunk = tuple[int, int, bool]


class Check(Protocol):
    """What hashes a holder's bytes as they are read (:class:`~elastic_train.checkpoint.slots.DataCheck`)."""

    def update(self, data: torch.Tensor) -> None: ...


class Reader(Protocol):
    """Where a holder reads its state from (:class:`~elastic_train.checkpoint.slots.SlotReader`)."""

    def read_into(self, start: int, dest: torch.Tensor) -> None: ...


def chunks_of(specs: Sequence[TensorSpec], nbytes: int) -> list[Chunk]:
    """The chunks the flat state of ``specs`` (``nbytes`` in all) travels in: in order, covering every byte.

    Every rank computes the same chunks from the specs: a tensor of at least :data:`DIRECT_MIN` bytes is cut
    into chunks of its own (received in place); the bytes between such tensors (small tensors, padding) into
    chunks of at most :data:`BUCKET`.
    """
    out: list[Chunk] = []

    def cut(a: int, b: int, direct: bool) -> None:
        step = DIRECT_BUCKET if direct else BUCKET
        out.extend((s, min(s + step, b), direct) for s in range(a, b, step))

    pos = 0
    for s in sorted((s for s in specs if s.nbytes >= DIRECT_MIN), key=lambda s: s.offset):
        cut(pos, s.offset, False)
        cut(s.offset, s.offset + s.nbytes, True)
        pos = s.offset + s.nbytes
    cut(pos, nbytes, False)
    return out


class Landing:
    """Where each tensor of a restored state lands: a given live tensor, or a region of one new buffer.

    Args:
        specs: the restored state's tensors.
        live: per spec, a tensor to write its bytes into (None: a new one); one whose dtype, shape, device
            (CPU) or layout (contiguous) differs is not used.
    """

    def __init__(
        self, specs: Sequence[TensorSpec], live: Sequence[torch.Tensor | None] | None = None
    ) -> None:
        fits = [
            t if t is not None and _fits(t, s) else None
            for t, s in zip(live if live is not None else [None] * len(specs), specs, strict=True)
        ]
        rest = 0
        places = []
        for s, t in zip(specs, fits, strict=True):
            places.append(rest if t is None else -1)
            if t is None:
                rest += (s.nbytes + ALIGN - 1) // ALIGN * ALIGN
        self.rest = torch.empty(rest, dtype=torch.uint8)
        #: The restored tensors, in spec order (live ones where they fit).
        self.tensors: list[torch.Tensor] = []
        #: (flat offset, bytes, uint8 view of the destination) per non-empty tensor, by offset.
        self._pieces: list[tuple[int, int, torch.Tensor]] = []
        self.live = 0
        live_starts: set[int] = set()
        for s, t, at in zip(specs, fits, places, strict=True):
            if t is None:
                dest = tensor_at(self.rest, s, base=s.offset - at)
            else:
                dest = t
                self.live += s.nbytes
                live_starts.add(s.offset)
            self.tensors.append(dest)
            if s.nbytes:
                self._pieces.append((s.offset, s.nbytes, dest.reshape(-1).view(torch.uint8)))
        self._pieces.sort(key=lambda p: p[0])
        self._starts = [p[0] for p in self._pieces]
        self._live = [p[0] in live_starts for p in self._pieces]
        self._next = 0

    def target(self, start: int, end: int) -> torch.Tensor:
        """Where the flat bytes ``[start, end)``, inside one tensor's bytes (a direct chunk), land."""
        i = bisect.bisect_right(self._starts, start) - 1
        offset, n, raw = self._pieces[i]
        assert offset <= start and end <= offset + n, (start, end, offset, n)
        return raw[start - offset : end - offset]

    def is_live(self, start: int) -> bool:
        """Whether the flat byte ``start`` lands in a live tensor (given to the landing), not a new buffer."""
        i = bisect.bisect_right(self._starts, start) - 1
        return i >= 0 and self._live[i] and start < self._pieces[i][0] + self._pieces[i][1]

    def land(self, start: int, data: torch.Tensor) -> None:
        """Copy ``data``, the flat state's bytes from ``start`` on, to their tensors (call in order)."""
        end = start + int(data.numel())
        pieces, i = self._pieces, self._next
        while i < len(pieces) and pieces[i][0] + pieces[i][1] <= start:
            i += 1
        self._next = i
        while i < len(pieces) and pieces[i][0] < end:
            offset, n, raw = pieces[i]
            a, b = max(offset, start), min(offset + n, end)
            raw[a - offset : b - offset].copy_(data[a - start : b - start])
            if offset + n > end:
                break
            i += 1

    def land_all(self, buf: torch.Tensor) -> None:
        """Copy every tensor out of the whole flat buffer ``buf``."""
        for offset, n, raw in self._pieces:
            raw.copy_(buf[offset : offset + n])


def _fits(t: torch.Tensor, spec: TensorSpec) -> bool:
    return (
        t.dtype == dtype_of(spec.dtype)
        and tuple(t.shape) == spec.shape
        and t.device.type == "cpu"
        and t.is_contiguous()
        and not t.requires_grad
    )


def lane(group: Any, k: int) -> Any:
    """The process group chunk ``k`` travels in: ``group`` itself, or with several groups of the same ranks
    (a tuple or list), each in turn. Every group has connections (and a gloo I/O thread) of its own, so the
    chunks stream over several TCP connections at once: on loopback two of them moved 1 GB about 25% faster
    than one, beyond what a single stream reaches (NCCL's socket transport stripes for the same reason)."""
    return group[k % len(group)] if isinstance(group, tuple | list) else group


#: Bytes of the first (often only) message of :func:`broadcast_small`: a restore's decision with the
#: metadata of a state of a few hundred tensors fits.
SMALL = 64 << 10


def broadcast_small(obj: Any, *, src: int, group: Any) -> Any:
    """``obj`` (picklable; only ``src``'s counts) from ``src`` (a global rank) to every rank of ``group``.

    As ``dist.broadcast_object_list`` of one object, in one broadcast of :data:`SMALL` bytes (its length
    first) where it fits, a second one with the rest where it does not: an object broadcast takes a size
    broadcast and a payload broadcast, each a round of messages on a busy machine.
    """
    room = SMALL - 8  # after the length
    mine = dist.get_rank() == src
    payload = pickle.dumps(obj) if mine else b""
    # Built as bytes, not with tensor ops: a fill of SMALL elements is over torch's parallel grain, and
    # waking the intra-op threads (one per core, on cores the other ranks keep busy) cost 5-10 ms here.
    raw = bytearray(SMALL)
    if mine:
        raw[:8] = len(payload).to_bytes(8, "little")
        first = payload[:room]
        raw[8 : 8 + len(first)] = first
    head = torch.frombuffer(raw, dtype=torch.uint8)
    dist.broadcast(head, src=src, group=group)
    size = int.from_bytes(raw[:8], "little")
    tail = None
    if size > room:
        tail = (
            torch.frombuffer(bytearray(payload[room:]), dtype=torch.uint8)
            if mine
            else torch.empty(size - room, dtype=torch.uint8)
        )
        dist.broadcast(tail, src=src, group=group)
    if mine:
        return obj
    rest = tail.numpy().tobytes() if tail is not None else b""
    return pickle.loads(bytes(raw[8 : 8 + min(size, room)]) + rest)


def send_meta(meta: Any, *, dsts: Sequence[int], group: Any) -> None:
    """The holder's side: the state's metadata (any picklable object) to each of ``dsts`` (global ranks)."""
    payload = torch.frombuffer(bytearray(pickle.dumps(meta)), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    works: list[Any] = []
    for dst in dsts:
        works.append(dist.isend(size, dst=dst, group=group, tag=_META_TAG))
        works.append(dist.isend(payload, dst=dst, group=group, tag=_META_TAG + 1))
    for w in works:
        w.wait()


def recv_meta(*, src: int, group: Any) -> Any:
    """A receiver's side of :func:`send_meta` (``src``: the holder's global rank)."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src=src, group=group, tag=_META_TAG)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(payload, src=src, group=group, tag=_META_TAG + 1)
    return pickle.loads(payload.numpy().tobytes())


def send(
    source: torch.Tensor | Reader,
    chunks: Sequence[Chunk],
    *,
    chain: Sequence[int],
    group: Any,
    check: Check | None = None,
    landing: Landing | None = None,
    live: bool = False,
) -> None:
    """The holder's side: the flat state along ``chain`` (global ranks, the holder first).

    Args:
        source: the state's flat bytes (a checkpoint read from storage: sent from there), or a reader of a
            shared-memory slot (each chunk is read into the holder's own ``landing`` first, hashed by
            ``check`` and sent from there).
        chunks: :func:`chunks_of` the state.
        chain: the holder, then every receiver in the order the bytes pass them.
        group: the process group of the chain's ranks, or several groups of the same ranks (lanes): chunk k
            travels in lane ``k % len(group)`` (see :func:`lane`).
        check: hashes each chunk right before it goes out (the caller asks it for the verdict afterwards).
        landing: the holder's own tensors (required with a reader).
        live: the landing's live tensors hold the slot's bytes already (this process took the snapshot from
            them and has not changed them since, as far as it knows): their chunks are hashed and sent where
            they are instead of read from the slot. The hash covers them all the same, so the verdict also
            says whether they did hold the slot's bytes.
    """
    _pump(source, chunks, chain[1] if len(chain) > 1 else None, group, check, landing, live)


def land_own(
    source: Reader, chunks: Sequence[Chunk], landing: Landing, check: Check | None, *, live: bool = False
) -> None:
    """A holder that sends to nobody: its own slot read into ``landing``, each chunk hashed by ``check``
    (``live``: as in :func:`send`; the live tensors' chunks are then only hashed)."""
    _pump(source, chunks, None, None, check, landing, live)


def _pump(
    source: torch.Tensor | Reader,
    chunks: Sequence[Chunk],
    nxt: int | None,
    group: Any,
    check: Check | None,
    landing: Landing | None,
    live: bool = False,
) -> None:
    if not isinstance(source, torch.Tensor):
        assert landing is not None
        _pump_slot(source, chunks, nxt, group, check, landing, live)
        return
    pending: collections.deque[Any] = collections.deque()
    for k, (start, end, _) in enumerate(chunks):
        data = source[start:end]
        if check is not None:
            check.update(data)
        if nxt is not None:
            pending.append(dist.isend(data, dst=nxt, group=lane(group, k), tag=k))
        if landing is not None:
            landing.land(start, data)
        if len(pending) >= WINDOW:
            pending.popleft().wait()
    while pending:
        pending.popleft().wait()


def _pump_slot(
    source: Reader,
    chunks: Sequence[Chunk],
    nxt: int | None,
    group: Any,
    check: Check | None,
    landing: Landing,
    live: bool,
) -> None:
    """A shared-memory slot's chunks: read and hashed by a reader thread up to :data:`AHEAD` chunks ahead of
    this one, which sends each (and lands the loose ones) as soon as it is read. With ``live`` a chunk of a
    live tensor is not read: it is hashed (and sent) where it is.

    The read (a copy out of the slot) and the hash then overlap the sends instead of taking turns with them
    on one thread: ``pread`` and xxh3 release the GIL, and the holder keeps the link busy while it reads.
    The hash still sees every chunk in order, and a verdict is only asked for after :func:`send` returns.
    """
    loose = max((e - s for s, e, d in chunks if not d), default=0)
    # A bounce buffer is read into again len(bounce) loose chunks later: by then this thread has taken the
    # chunk (the queue holds AHEAD), sent it and waited for its send (WINDOW in flight).
    bounce = [torch.empty(loose, dtype=torch.uint8) for _ in range(WINDOW + AHEAD + 2)] if loose else []
    ready: queue.Queue[tuple[torch.Tensor, BaseException | None]] = queue.Queue(maxsize=AHEAD)
    stop = threading.Event()

    def read() -> None:
        used = 0
        try:
            for start, end, direct in chunks:
                if direct:  # read where it lands: the holder's own tensor
                    data = landing.target(start, end)
                    if not (live and landing.is_live(start)):
                        source.read_into(start, data)
                else:
                    data = bounce[used % len(bounce)][: end - start]
                    used += 1
                    source.read_into(start, data)
                if check is not None:
                    check.update(data)
                if not _put(ready, (data, None), stop):
                    return
        except BaseException as exc:  # handed to the sending thread, which raises it
            _put(ready, (torch.empty(0), exc), stop)

    reader = threading.Thread(target=read, name="restore-reader", daemon=True)
    reader.start()
    pending: collections.deque[Any] = collections.deque()
    try:
        for k, (start, _, direct) in enumerate(chunks):
            data, error = ready.get()
            if error is not None:
                raise error
            if nxt is not None:
                pending.append(dist.isend(data, dst=nxt, group=lane(group, k), tag=k))
            if not direct:
                landing.land(start, data)
            if len(pending) >= WINDOW:
                pending.popleft().wait()
        while pending:
            pending.popleft().wait()
    finally:
        stop.set()
        reader.join()


def _put(q: queue.Queue[Any], item: Any, stop: threading.Event) -> bool:
    """Put ``item`` on ``q`` unless ``stop`` is set first (the consumer gave up); whether it was put."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def receive(
    chunks: Sequence[Chunk], landing: Landing, *, chain: Sequence[int], rank: int, group: Any
) -> None:
    """A receiver's side: each chunk from its predecessor in ``chain`` (global ranks, the holder first),
    straight into its tensor (direct chunks) or through a bounce buffer; forwarded to the next rank."""
    pos = list(chain).index(rank)
    prev, nxt = chain[pos - 1], chain[pos + 1] if pos + 1 < len(chain) else None
    loose = max((e - s for s, e, d in chunks if not d), default=0)
    bounce = [torch.empty(loose, dtype=torch.uint8) for _ in range(WINDOW + 1)] if loose else []
    pending: collections.deque[tuple[Any, int, torch.Tensor | None]] = collections.deque()

    def finish() -> None:
        work, start, data = pending.popleft()
        work.wait()
        if data is not None:
            landing.land(start, data)

    used = 0
    for k, (start, end, direct) in enumerate(chunks):
        if direct:
            data = landing.target(start, end)
        else:
            # A bounce buffer is reused WINDOW + 1 loose chunks later: its receive (and send) is done by then.
            data = bounce[used % len(bounce)][: end - start]
            used += 1
        if nxt is None:  # the end of the chain: receives in flight, each landed as it ends
            work = dist.irecv(data, src=prev, group=lane(group, k), tag=k)
            pending.append((work, start, None if direct else data))
        else:  # in the middle: received, landed, forwarded while the next one arrives
            dist.recv(data, src=prev, group=lane(group, k), tag=k)
            if not direct:
                landing.land(start, data)
            pending.append((dist.isend(data, dst=nxt, group=lane(group, k), tag=k), start, None))
        if len(pending) >= WINDOW:
            finish()
    while pending:
        finish()
