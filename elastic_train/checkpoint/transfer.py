"""Moving a restored flat state from its holder to every rank, straight into the tensors it ends up in.

The holder sends the flat bytes (its shared-memory slot, or a durable checkpoint it read) in buckets of
:data:`BUCKET` bytes, :data:`WINDOW` in flight: to one receiver as broadcasts, to two or more along a
pipelined chain (holder → next rank → …), so the state crosses each link once.

A receiver does not collect the state in a buffer of its own first: each bucket arrives in one of a few
reused bounce buffers (already in memory, so the receive never waits for fresh pages) and is copied at
once to where its bytes belong — a *live* tensor the state will be loaded into (the model's parameters, an
optimizer's existing buffers: :class:`Landing` takes them where dtype and shape match), or a compact
buffer for the rest. Loading the state then finds the parameters already holding it (``copy_`` of a
tensor onto itself returns at once), so the bytes are written once between the socket and the model.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from elastic_train.checkpoint.codec import ALIGN, TensorSpec, dtype_of, tensor_at

#: Bytes per broadcast (or chain hop) of a restored state, and sends in flight at once.
BUCKET = 8 << 20
WINDOW = 4


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
        for s, t, at in zip(specs, fits, places, strict=True):
            if t is None:
                dest = tensor_at(self.rest, s, base=s.offset - at)
            else:
                dest = t
                self.live += s.nbytes
            self.tensors.append(dest)
            if s.nbytes:
                self._pieces.append((s.offset, s.nbytes, dest.reshape(-1).view(torch.uint8)))
        self._pieces.sort(key=lambda p: p[0])
        self._next = 0

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


def send(
    buf: torch.Tensor, *, src: int, world: int, rank: int, group: Any, glob: Callable[[int], int]
) -> None:
    """The holder's side: the flat bytes ``buf`` to every other rank of ``group`` (ranks are group ranks;
    ``glob`` maps one to its global rank)."""
    _move(buf, int(buf.numel()), None, src=src, world=world, rank=rank, group=group, glob=glob)


def receive(
    nbytes: int, landing: Landing, *, src: int, world: int, rank: int, group: Any, glob: Callable[[int], int]
) -> None:
    """A receiver's side: ``nbytes`` of flat state from ``src``, each bucket landed as it arrives (and, in a
    chain, forwarded to the next rank)."""
    _move(None, nbytes, landing, src=src, world=world, rank=rank, group=group, glob=glob)


def _move(
    buf: torch.Tensor | None,
    nbytes: int,
    landing: Landing | None,
    *,
    src: int,
    world: int,
    rank: int,
    group: Any,
    glob: Callable[[int], int],
) -> None:
    bounce = (
        [torch.empty(min(BUCKET, nbytes), dtype=torch.uint8) for _ in range(WINDOW + 1)]
        if buf is None
        else []
    )
    starts = range(0, nbytes, BUCKET)

    def bucket(k: int, start: int) -> torch.Tensor:
        if buf is not None:
            return buf[start : start + BUCKET]
        return bounce[k % len(bounce)][: min(BUCKET, nbytes - start)]

    pending: collections.deque[tuple[Any, int, torch.Tensor]] = collections.deque()

    def finish() -> None:
        work, start, data = pending.popleft()
        work.wait()
        if landing is not None and start >= 0:
            landing.land(start, data)

    if world <= 2:
        # One receiver: a broadcast per bucket (gloo sends it once), a few in flight; each lands as it ends.
        for k, start in enumerate(starts):
            data = bucket(k, start)
            pending.append((dist.broadcast(data, src=glob(src), group=group, async_op=True), start, data))
            if len(pending) >= WINDOW:
                finish()
        while pending:
            finish()
        return
    # Two or more receivers: a chain src → src+1 → … → src-1; each rank receives bucket k from its
    # predecessor, lands it and forwards it while bucket k+1 arrives.
    order = [(src + i) % world for i in range(world)]
    pos = order.index(rank)
    prev = glob(order[pos - 1]) if pos > 0 else None
    nxt = glob(order[pos + 1]) if pos + 1 < world else None
    for k, start in enumerate(starts):
        data = bucket(k, start)
        if prev is not None:
            dist.recv(data, src=prev, group=group, tag=k)
            if landing is not None:
                landing.land(start, data)
        if nxt is not None:
            # The bounce buffer of bucket k is reused WINDOW + 1 buckets later: its send is done by then.
            pending.append((dist.isend(data, dst=nxt, group=group, tag=k), -1, data))
            if len(pending) >= WINDOW:
                finish()
    while pending:
        finish()
