"""The shard map: FSDP2's even dim-0 chunks, and the map's JSON form read back as untrusted input."""

from __future__ import annotations

import pytest

from elastic_train.checkpoint.sharded.shardmap import EVEN, ShardMap, TensorShards, fsdp_ranges


@pytest.mark.parametrize(
    ("rows", "world", "expected"),
    [
        (7, 3, ((0, 3), (3, 3), (6, 1))),  # uneven last chunk
        (2, 3, ((0, 1), (1, 1), (2, 0))),  # fewer rows than ranks: an empty shard
        (4, 3, ((0, 2), (2, 2), (4, 0))),  # torch.chunk: 2 chunks of 2, the third rank empty
        (6, 3, ((0, 2), (2, 2), (4, 2))),
        (1, 4, ((0, 1), (1, 0), (1, 0), (1, 0))),
        (0, 2, ((0, 0), (0, 0))),
        (5, 1, ((0, 5),)),
        (10, 4, ((0, 3), (3, 3), (6, 3), (9, 1))),
    ],
)
def test_fsdp_ranges_are_torch_chunk(rows: int, world: int, expected: tuple[tuple[int, int], ...]) -> None:
    assert fsdp_ranges(rows, world) == expected


def test_fsdp_ranges_match_fully_shard() -> None:
    """The same rows FSDP2 gives each rank (torch.chunk of the rows, padded: missing chunks empty)."""
    import torch

    for rows in range(0, 13):
        for world in range(1, 6):
            chunks = torch.arange(rows).chunk(world) if rows else ()
            got = fsdp_ranges(rows, world)
            for r in range(world):
                want = chunks[r].tolist() if r < len(chunks) else []
                assert list(range(got[r][0], got[r][0] + got[r][1])) == want, (rows, world, r)


def test_fsdp_ranges_refuse_nonsense() -> None:
    with pytest.raises(ValueError):
        fsdp_ranges(3, 0)
    with pytest.raises(ValueError):
        fsdp_ranges(-1, 2)


def test_map_bytes_and_resize() -> None:
    m = ShardMap.even({"w": ((7, 5), "float32"), "b": ((2,), "float64")}, 3)
    assert m.tensors["w"].row_bytes == 20 and m.tensors["b"].row_bytes == 8
    assert m.nbytes == 7 * 20 + 2 * 8
    assert [m.rank_bytes(r) for r in range(3)] == [3 * 20 + 8, 3 * 20 + 8, 20]
    two = m.resized(2)
    assert two.tensors["w"].ranges == ((0, 4), (4, 3)) and two.tensors["b"].ranges == ((0, 1), (1, 1))


def test_json_round_trip_writes_even_chunks_compactly() -> None:
    m = ShardMap(2, {"even": TensorShards((4, 2), "float32", ((0, 2), (2, 2))),
                     "odd": TensorShards((4,), "int64", ((0, 1), (1, 3)))})  # fmt: skip
    data = m.to_json()
    assert data["tensors"]["even"][2] == EVEN and data["tensors"]["odd"][2] == [[0, 1], [1, 3]]
    assert ShardMap.from_json(data) == m


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ([], "not a mapping"),
        ({"world_size": 0, "tensors": {}}, "world size"),
        ({"world_size": "2", "tensors": {}}, "world size"),
        ({"world_size": 2, "tensors": {"w": [[4], "float32"]}}, "not [shape, dtype, ranges]"),
        ({"world_size": 2, "tensors": {"w": [[], "float32", EVEN]}}, "dim 0"),
        ({"world_size": 2, "tensors": {"w": [[-1], "float32", EVEN]}}, "shape"),
        ({"world_size": 2, "tensors": {"w": [[4], "float99", EVEN]}}, "unknown dtype"),
        ({"world_size": 2, "tensors": {"w": [[4], "float32", [[0, 2]]]}}, "one [first, rows] per rank"),
        ({"world_size": 2, "tensors": {"w": [[4], "float32", [[0, 2], [2, "2"]]]}}, "per rank"),
        ({"world_size": 2, "tensors": {"w": [[4], "float32", [[0, 2], [3, 2]]]}}, "beyond"),
    ],
)
def test_json_is_validated(data: object, says: str) -> None:
    with pytest.raises(ValueError, match="shard map") as info:
        ShardMap.from_json(data)
    assert says in str(info.value)
