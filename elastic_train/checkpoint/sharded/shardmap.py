"""The shard map of a sharded state: each tensor's global shape, dtype and the dim-0 rows each rank holds.

FSDP2 (``fully_shard`` on a 1-D mesh) shards every parameter, and the optimizer state shaped like it, along
dim 0 in even chunks: ``chunk = ceil(rows / W)``, rank ``r`` holds rows ``[r·chunk, (r+1)·chunk)`` clipped to
the tensor, so the last ranks may hold fewer rows or none (:func:`fsdp_ranges`). A rank's memory slot keeps
the map of its round next to its local shards: with it, any later world's ownership and what must move to
whom is a pure computation (:mod:`elastic_train.checkpoint.sharded.reshard`).

Pure functions and plain data. The JSON form (:meth:`ShardMap.to_json`) is read back from shared memory and
from durable manifests, so :meth:`ShardMap.from_json` validates it before anything is computed from it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from elastic_train.checkpoint.specs import DTYPE_SIZES

#: A run of dim-0 rows: (first row, number of rows).
Rows = tuple[int, int]

#: The JSON of ranges that are exactly FSDP's even chunks of the map's world size.
EVEN = "even"


def fsdp_ranges(rows: int, world_size: int) -> tuple[Rows, ...]:
    """FSDP2's ownership of a tensor of ``rows`` dim-0 rows over ``world_size`` ranks, one entry per rank.

    ``torch.chunk`` semantics, as ``fully_shard`` pads them: chunks of ``ceil(rows / W)`` rows, the last
    non-empty one shorter, the ranks after it empty (a tensor of 2 rows over 3 ranks: 1, 1, 0).

    Raises:
        ValueError: ``rows`` is negative or ``world_size`` is not positive.
    """
    if rows < 0 or world_size < 1:
        raise ValueError(f"fsdp_ranges: rows {rows}, world size {world_size}")
    chunk = -(-rows // world_size) if rows else 0
    out = []
    for r in range(world_size):
        start = min(r * chunk, rows)
        out.append((start, max(0, min(chunk, rows - start))))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class TensorShards:
    """One sharded tensor: its global shape and dtype, and the dim-0 rows each rank holds."""

    shape: tuple[int, ...]
    dtype: str
    ranges: tuple[Rows, ...]
    """Per rank of the round, ``(first row, rows)``."""

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def row_bytes(self) -> int:
        """Bytes of one dim-0 row (a row range is contiguous in a contiguous tensor)."""
        return math.prod(self.shape[1:]) * DTYPE_SIZES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes


@dataclass(frozen=True, slots=True)
class ShardMap:
    """Every sharded tensor of a state (by its path in the state) over the ranks of one round."""

    world_size: int
    tensors: Mapping[str, TensorShards]

    @classmethod
    def even(cls, shapes: Mapping[str, tuple[Sequence[int], str]], world_size: int) -> ShardMap:
        """FSDP2's map of tensors ``{path: (global shape, dtype)}`` over ``world_size`` ranks."""
        return cls(
            world_size,
            {
                path: TensorShards(tuple(shape), dtype, fsdp_ranges(shape[0], world_size))
                for path, (shape, dtype) in shapes.items()
            },
        )

    def resized(self, world_size: int) -> ShardMap:
        """The same tensors in FSDP2's ownership over ``world_size`` ranks (the new world's map)."""
        return ShardMap.even({p: (t.shape, t.dtype) for p, t in self.tensors.items()}, world_size)

    def rank_bytes(self, rank: int) -> int:
        """Bytes of the shards ``rank`` holds."""
        return sum(t.ranges[rank][1] * t.row_bytes for t in self.tensors.values())

    @property
    def nbytes(self) -> int:
        """Bytes of every sharded tensor, whole."""
        return sum(t.nbytes for t in self.tensors.values())

    def to_json(self) -> dict[str, Any]:
        """Plain data; even chunks are written as ``"even"`` (a map is kept with every step's snapshot)."""
        out: dict[str, Any] = {}
        for path, t in self.tensors.items():
            even = t.ranges == fsdp_ranges(t.rows, self.world_size)
            out[path] = [list(t.shape), t.dtype, EVEN if even else [list(r) for r in t.ranges]]
        return {"world_size": self.world_size, "tensors": out}

    @classmethod
    def from_json(cls, data: Any) -> ShardMap:
        """The map :meth:`to_json` wrote, validated (it comes from shared memory or storage).

        Raises:
            ValueError: one line naming the first problem.
        """
        if not isinstance(data, dict) or not isinstance(data.get("tensors"), dict):
            raise ValueError("shard map: not a mapping with 'tensors'")
        world = data.get("world_size")
        if type(world) is not int or world < 1:
            raise ValueError(f"shard map: world size {world!r}")
        tensors: dict[str, TensorShards] = {}
        for path, entry in data["tensors"].items():
            if not (isinstance(entry, list) and len(entry) == 3):
                raise ValueError(f"shard map: {path}: not [shape, dtype, ranges]")
            shape, dtype, ranges = entry
            if not (isinstance(shape, list) and shape and all(type(s) is int and s >= 0 for s in shape)):
                raise ValueError(f"shard map: {path}: shape {shape!r} (a sharded tensor has a dim 0)")
            if dtype not in DTYPE_SIZES:
                raise ValueError(f"shard map: {path}: unknown dtype {dtype!r}")
            even = ranges == EVEN
            rows = fsdp_ranges(shape[0], world) if even else _ranges(path, ranges, shape[0], world)
            tensors[str(path)] = TensorShards(tuple(shape), dtype, rows)
        return cls(world, tensors)


def _ranges(path: str, ranges: Any, rows: int, world: int) -> tuple[Rows, ...]:
    ok = isinstance(ranges, list) and len(ranges) == world
    out: list[Rows] = []
    for r in ranges if ok else ():
        if not (isinstance(r, list) and len(r) == 2 and all(type(x) is int and x >= 0 for x in r)):
            ok = False
            break
        if r[0] + r[1] > rows:
            raise ValueError(f"shard map: {path}: rows {r} beyond its {rows} rows")
        out.append((r[0], r[1]))
    if not ok:
        raise ValueError(f"shard map: {path}: ranges {ranges!r} are not one [first, rows] per rank")
    return tuple(out)
