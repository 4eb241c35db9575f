"""Carrying out a reshard plan: point-to-point range transfers, only the rows a rank lacks.

Every rank walks the same :class:`~elastic_train.checkpoint.sharded.reshard.Plan` in the same order. A piece
kept in place was read straight into the new shard; a piece a peer holds is one or more messages (at most
:data:`BUCKET` bytes each) from the holder's buffer of those rows straight into the rows of the receiver's
new shard (a row range of a contiguous tensor is one contiguous byte range: no packing, no bounce buffer);
a piece nobody alive holds is handed to ``durable`` (read from a checkpoint). Message ``k`` of the walk
carries tag ``k`` and travels in lane ``k`` (the manager's gloo groups in turn: each pair of ranks streams
over several connections).

gloo here; the same calls run on NCCL (point-to-point sends between GPU tensors), where a shard lives on
the device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastic_train.checkpoint.sharded.reshard import Piece, Plan
from elastic_train.checkpoint.transfer import lane

#: Bytes per message at most (a 1 GB restore on loopback moved fastest in 32 MiB messages).
BUCKET = 32 << 20


@dataclass(frozen=True, slots=True)
class Moved:
    """What this rank did for a plan (bytes)."""

    kept: int
    received: int
    sent: int
    durable: int


def _rows(t: torch.Tensor, first: int, rows: int) -> torch.Tensor:
    """Rows ``[first, first + rows)`` of a contiguous tensor as bytes (a view: writes land in ``t``)."""
    return t[first : first + rows].reshape(-1).view(torch.uint8)


def messages(piece: Piece, row_bytes: int) -> list[tuple[int, int]]:
    """The (first row, rows) of each message a moved piece travels in (relative to the piece)."""
    per = max(1, BUCKET // max(row_bytes, 1))
    return [(i, min(per, piece.rows - i)) for i in range(0, piece.rows, per)]


def execute(
    plan: Plan,
    me: int,
    *,
    source: Callable[[Piece], torch.Tensor],
    dests: Mapping[str, torch.Tensor],
    to_global: Callable[[int], int],
    lanes: Any,
    durable: Callable[[Piece, torch.Tensor], None] | None = None,
) -> Moved:
    """This rank's part of ``plan``: send what it holds to those who need it, receive what it lacks.

    The rows a rank keeps are already in place (its slots were read straight into its new shards), so only
    counted here.

    Args:
        plan: the plan (the same on every rank).
        me: this rank in the new world.
        source: the rows of a piece this rank sends, as one contiguous uint8 tensor.
        dests: this rank's new local shards by path (the tensors the restored rows land in).
        to_global: a new-world rank's global rank in ``lanes``' groups.
        lanes: the process group(s) messages travel in (:func:`elastic_train.checkpoint.transfer.lane`).
        durable: fills a piece nobody alive holds (``durable(piece, destination rows)``); required when the
            plan has such pieces for this rank.

    Raises:
        RuntimeError: a peer failed mid-transfer (the group is broken; the caller re-forms it).
    """
    works: list[Any] = []
    kept = received = sent = from_storage = 0
    tag = 0
    lost: list[tuple[Piece, torch.Tensor]] = []
    for piece in plan.pieces:
        row_bytes = plan.old.tensors[piece.path].row_bytes
        if piece.src is None:
            if piece.dst == me:
                lost.append((piece, dests[piece.path][piece.dst_row : piece.dst_row + piece.rows]))
            continue
        if piece.src == piece.dst:
            if piece.dst == me:
                kept += piece.rows * row_bytes
            continue
        data = source(piece) if piece.src == me else None
        for first, rows in messages(piece, row_bytes):
            group = lane(lanes, tag)
            if data is not None:
                part = data[first * row_bytes : (first + rows) * row_bytes]
                works.append(dist.isend(part, dst=to_global(piece.dst), group=group, tag=tag))
                sent += rows * row_bytes
            elif piece.dst == me:
                into = _rows(dests[piece.path], piece.dst_row + first, rows)
                works.append(dist.irecv(into, src=to_global(piece.src), group=group, tag=tag))
                received += rows * row_bytes
            tag += 1
    if lost:
        if durable is None:
            raise AssertionError("the plan reads pieces from durable storage, and none was given")
        for piece, rows_view in lost:
            durable(piece, rows_view)
            from_storage += piece.rows * plan.old.tensors[piece.path].row_bytes
    for work in works:
        if work is not None:
            work.wait()
    return Moved(kept, received, sent, from_storage)
