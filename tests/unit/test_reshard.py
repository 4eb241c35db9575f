"""The sharded restore's two pure decisions, as tables: which step (and from where), and which rows move."""

from __future__ import annotations

import pytest

from elastic_train.checkpoint.sharded.reshard import DURABLE, MEMORY, Holding, Piece, choose, minimum, plan
from elastic_train.checkpoint.sharded.shardmap import ShardMap


def held(*rows: tuple[int, int, int, int, int]) -> list[Holding]:
    """(new rank, step, round, world size, old rank) per slot."""
    return [Holding(*r) for r in rows]


# -- choose ------------------------------------------------------------------------------------------------

CHOICES = [
    # name, holdings, durable steps, expected (step, source, lost old ranks)
    ("join: every old rank alive", held((0, 9, 2, 2, 0), (1, 9, 2, 2, 1)), [], (9, MEMORY, set())),
    (
        "kill with replicas: the dead rank's shards on its buddy",
        held((0, 9, 3, 3, 0), (0, 9, 3, 3, 2), (1, 9, 3, 3, 1), (1, 9, 3, 3, 0)),
        [5],
        (9, MEMORY, set()),
    ),
    (
        "kill without replicas: the newest durable checkpoint",
        held((0, 9, 3, 3, 0), (1, 9, 3, 3, 1), (0, 8, 3, 3, 0), (1, 8, 3, 3, 1)),
        [5],
        (5, DURABLE, None),
    ),
    (
        "kill without replicas, a durable checkpoint of that very step: only the lost shards from it",
        held((0, 10, 3, 3, 0), (1, 10, 3, 3, 1)),
        [5, 10],
        (10, DURABLE, {2}),
    ),
    (
        "one rank missed the newest seal: the step before, held by all",
        held((0, 9, 3, 2, 0), (0, 8, 3, 2, 0), (1, 8, 3, 2, 1)),
        [],
        (8, MEMORY, set()),
    ),
    (
        "a durable checkpoint newer than every slot wins",
        held((0, 9, 3, 2, 0), (1, 9, 3, 2, 1)),
        [12],
        (12, DURABLE, None),
    ),
    ("a tie goes to memory", held((0, 9, 3, 2, 0), (1, 9, 3, 2, 1)), [9], (9, MEMORY, set())),
    (
        "slots of one step from two worlds: the newer world's only",
        held((0, 9, 4, 2, 0), (1, 9, 4, 2, 1), (2, 9, 3, 3, 2)),
        [],
        (9, MEMORY, set()),
    ),
    ("nothing anywhere", [], [], None),
]


Expected = tuple[int, str, set[int] | None] | None


@pytest.mark.parametrize(
    ("holdings", "durable", "expected"), [c[1:] for c in CHOICES], ids=[str(c[0]) for c in CHOICES]
)
def test_choose(holdings: list[Holding], durable: list[int], expected: Expected) -> None:
    choice = choose(holdings, durable)
    if expected is None:
        assert choice is None
        return
    assert choice is not None
    step, source, lost = expected
    assert (choice.step, choice.source) == (step, source)
    if lost is None:
        assert choice.world is None and not choice.holders
    else:
        assert set(choice.lost) == lost


def test_choose_skips_durable_checkpoints_that_failed() -> None:
    holdings = held((0, 4, 1, 1, 0))
    assert choose(holdings, [6, 5], skip=[6]).step == 5  # type: ignore[union-attr]
    assert choose(holdings, [6, 5], skip=[6, 5]).step == 4  # type: ignore[union-attr]


def test_choose_keeps_the_older_worlds_slots_out() -> None:
    choice = choose(held((0, 9, 4, 2, 0), (1, 9, 4, 2, 1), (2, 9, 3, 3, 2)), [])
    assert choice is not None and choice.world == (4, 2) and set(choice.holders) == {0, 1}


# -- plan --------------------------------------------------------------------------------------------------


def test_kill_three_to_two_with_a_replica() -> None:
    """Old ranks 0, 1, 2 (rank 2's replica on rank 0); rank 2 died; new ranks 0, 1 are old 0, 1."""
    old = ShardMap.even({"w": ((12, 1), "float32")}, 3)  # rows 0-3, 4-7, 8-11
    p = plan(old, {0: {0, 2}, 1: {1}}, 2)  # new rows 0-5, 6-11
    assert p.pieces == (
        Piece("w", 0, 0, 4, 0, 0, 0),  # kept
        Piece("w", 0, 4, 2, 1, 1, 0),  # rows 4-5 from new rank 1 (old rank 1)
        Piece("w", 1, 0, 2, 1, 1, 2),  # rows 6-7 kept by new rank 1
        Piece("w", 1, 2, 4, 0, 2, 0),  # rows 8-11 from rank 0's replica of old rank 2
    )
    assert [p.received(r) for r in (0, 1)] == [8, 16] and [p.sent(r) for r in (0, 1)] == [16, 8]
    assert [p.received(r) for r in (0, 1)] == [minimum(old, {0: {0, 2}, 1: {1}}, 2, r) for r in (0, 1)]
    assert [p.kept(r) for r in (0, 1)] == [16, 8] and p.from_durable(0) == 0


def test_kill_without_replica_reads_the_lost_rows_from_durable() -> None:
    old = ShardMap.even({"w": ((12, 1), "float32")}, 3)
    p = plan(old, {0: {0}, 1: {1}}, 2)
    assert [x.src for x in p.pieces if x.dst == 1] == [1, None]
    assert p.from_durable(1) == 16 and p.from_durable(0) == 0


def test_join_two_to_three_moves_only_what_each_lacks() -> None:
    old = ShardMap.even({"w": ((7, 5), "float32"), "b": ((2,), "float32")}, 2)  # w: 0-3, 4-6; b: 0, 1
    holders = {0: {0}, 1: {1}}  # new rank 2 joined with nothing
    p = plan(old, holders, 3)  # w: 0-2, 3-5, 6; b: 0, 1, -
    for r in range(3):
        assert p.received(r) == minimum(old, holders, 3, r)
    assert p.received(2) == 1 * 20  # w row 6 from old rank 1
    assert p.received(1) == 1 * 20  # w row 3 from old rank 0 (rows 4-5 and b row 1 it keeps)
    assert p.received(0) == 0
    new_b = [x for x in p.pieces if x.path == "b"]
    assert [(x.dst, x.src) for x in new_b] == [(0, 0), (1, 1)]  # rank 2's b shard is empty


def test_replicas_spread_the_sends() -> None:
    """Two holders of the same old shard: the one that has sent less sends the next piece."""
    old = ShardMap.even({"a": ((2, 4), "float32"), "b": ((2, 4), "float32")}, 2)
    p = plan(old, {0: {0, 1}, 1: {1, 0}}, 1)  # world of one: new rank 0 holds everything itself
    assert all(x.src == 0 for x in p.pieces) and p.received(0) == 0
    p = plan(old, {1: {0, 1}, 2: {0, 1}}, 1)  # new rank 0 (a joiner) receives from two holders in turn
    assert {x.src for x in p.pieces} == {1, 2} and p.received(0) == old.nbytes


def test_empty_and_tiny_tensors() -> None:
    old = ShardMap.even({"tiny": ((1,), "float64"), "none": ((0, 3), "float32")}, 3)
    p = plan(old, {0: {0}, 1: {1}, 2: {2}}, 2)
    assert p.pieces == (Piece("tiny", 0, 0, 1, 0, 0, 0),)
    assert minimum(old, {0: {0}, 1: {1}, 2: {2}}, 2, 1) == 0


@pytest.mark.parametrize("sizes", [(3, 2), (2, 3), (4, 1), (1, 4), (3, 5), (5, 3)])
def test_every_row_is_placed_once(sizes: tuple[int, int]) -> None:
    before, after = sizes
    old = ShardMap.even({"w": ((17, 3), "float32"), "v": ((4,), "int64")}, before)
    p = plan(old, {r: {r} for r in range(before)}, after)
    for path, t in p.new.tensors.items():
        for rank, (first, rows) in enumerate(t.ranges):
            got = sorted((x.dst_row, x.rows) for x in p.pieces if x.path == path and x.dst == rank)
            covered = [first + d + i for d, n in got for i in range(n)]
            assert covered == list(range(first, first + rows)), (path, rank)
            for x in p.pieces:  # each piece lies inside its old shard
                if x.path == path and x.dst == rank:
                    assert x.src_row + x.rows <= old.tensors[path].ranges[x.old][1]
