"""Carrying out a reshard plan over gloo: each rank's new shard, row for row, with pieces in several messages
and both ranks sending and receiving."""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests.unit.test_group_links import run_ranks

CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    import torch.distributed as dist
    from elastic_train.checkpoint.sharded import move
    from elastic_train.checkpoint.sharded.reshard import plan
    from elastic_train.checkpoint.sharded.shardmap import ShardMap
    from elastic_train.train import group

    out = sys.argv[1]
    world = group.init("gloo")
    me = world.rank
    lanes = (dist.new_group(backend="gloo"), dist.new_group(backend="gloo"))
    rows, cols = 1000, 300  # a piece travels in several messages (move.BUCKET is patched below)
    move.BUCKET = 64 * cols * 4
    full = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    old = ShardMap.even({"w": ((rows, cols), "float32")}, 3)  # world 3 -> 2: rank 0 holds old 0 and 2
    holders = {0: {0, 2}, 1: {1}}
    p = plan(old, holders, 2)

    def old_rows(j, first, n):
        start = old.tensors["w"].ranges[j][0] + first
        return full[start : start + n].contiguous()

    new_first, new_rows = p.new.tensors["w"].ranges[me]
    dest = torch.full((new_rows, cols), -1.0)
    for piece in p.pieces:  # what the slots' reads put in place
        if piece.src == me == piece.dst:
            rows_kept = old_rows(piece.old, piece.src_row, piece.rows)
            dest[piece.dst_row : piece.dst_row + piece.rows] = rows_kept

    def source(piece):
        return old_rows(piece.old, piece.src_row, piece.rows).reshape(-1).view(torch.uint8)

    moved = move.execute(p, me, source=source, dests={"w": dest}, to_global=lambda r: r, lanes=lanes)
    results = {
        "right": bool(torch.equal(dest, full[new_first : new_first + new_rows])),
        "moved": [moved.kept, moved.received, moved.sent],
        "expected": [p.kept(me), p.received(me), p.sent(me)],
    }
    json.dump(results, open(out, "w"))
    group.shutdown()
    """
)


def test_each_rank_gets_its_new_shard_row_for_row(tmp_path: Path) -> None:
    results = run_ranks(CHILD, tmp_path)
    for rank, got in enumerate(results):
        assert got["right"], f"rank {rank}: {got}"
        assert got["moved"] == got["expected"]
    assert results[0]["moved"][2] > 0 and results[1]["moved"][2] > 0  # both ranks send and receive
