"""Which step a sharded state restores, and which dim-0 rows move from whom to whom (pure decisions).

Two questions, each a pure function of plain data, so that every rank of the new world computes the same
answer from the same gathered facts:

1. :func:`choose`: given what each rank of the new world holds in shared memory (:class:`Holding`: per slot,
   the step, the world that saved it and whose shards it holds — its own, or a replica of another rank's)
   and the steps of the durable checkpoints, the newest step whose state is complete: every old rank's
   shards held by some rank (memory), or the old ranks nobody alive holds read from a durable checkpoint of
   that very step, or a durable checkpoint alone.
2. :func:`plan`: given the old world's :class:`~elastic_train.checkpoint.sharded.shardmap.ShardMap`, who
   holds which old rank's shards and the new world size, FSDP2's ownership for the new size and, for each
   new rank, every run of rows it needs: kept in place, sent by a peer (only rows it lacks move), or read
   from durable storage (rows nobody alive holds).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from elastic_train.checkpoint.sharded.shardmap import ShardMap

MEMORY = "memory"
DURABLE = "durable"


@dataclass(frozen=True, slots=True)
class Holding:
    """One shared-memory slot a rank of the new world holds."""

    rank: int
    """The holder's rank in the new world."""
    step: int
    round: int
    """The rendezvous round of the world that saved it (its restart count outside a rendezvous)."""
    world_size: int
    """That world's size."""
    old_rank: int
    """Whose shards the slot holds: the saver's own rank in that world, or the rank it keeps a replica of."""


@dataclass(frozen=True, slots=True)
class Choice:
    """The state a sharded restore takes (the same on every rank)."""

    step: int
    source: str
    """``memory`` when live ranks hold every shard, else ``durable`` (the lost shards, or all, come from
    storage)."""
    world: tuple[int, int] | None
    """(round, world size) of the world whose slots are used; None when everything comes from storage."""
    holders: Mapping[int, frozenset[int]] = field(default_factory=dict)
    """New rank -> the old ranks whose shards it holds at ``step``."""
    lost: frozenset[int] = frozenset()
    """Old ranks whose shards nobody alive holds: read from the durable checkpoint of ``step``."""

    @property
    def memory_used(self) -> bool:
        return bool(self.holders)


def choose(
    holdings: Sequence[Holding], durable_steps: Collection[int], *, skip: Collection[int] = ()
) -> Choice | None:
    """The newest step whose state is complete, or None when there is none.

    For each step (memory and durable ones, newest first, ``skip`` left out: durable checkpoints that failed
    to load), the slots of the newest world that saved it: complete when together they hold every rank of
    that world; otherwise the durable checkpoint of that step fills what is missing, when there is one. A
    durable checkpoint with no slot of its step is the whole state. A tie of memory and durable at one step
    goes to memory.
    """
    steps = sorted({h.step for h in holdings} | set(durable_steps), reverse=True)
    durable = set(durable_steps) - set(skip)
    for step in steps:
        at = [h for h in holdings if h.step == step]
        if at:
            world = max((h.round, h.world_size) for h in at)
            holders: dict[int, set[int]] = {}
            for h in at:
                if (h.round, h.world_size) == world and 0 <= h.old_rank < world[1]:
                    holders.setdefault(h.rank, set()).add(h.old_rank)
            held = set().union(*holders.values()) if holders else set()
            lost = frozenset(range(world[1])) - held
            frozen = {r: frozenset(o) for r, o in holders.items()}
            if not lost:
                return Choice(step, MEMORY, world, frozen)
            if step in durable:
                return Choice(step, DURABLE, world, frozen, lost)
        elif step in durable:
            return Choice(step, DURABLE, None)
    return None


@dataclass(frozen=True, slots=True)
class Piece:
    """A run of rows of one tensor that a new rank needs, and where it comes from."""

    path: str
    dst: int
    """The new rank that needs the rows."""
    dst_row: int
    """Where they start in its new local shard."""
    rows: int
    src: int | None
    """The new rank that holds them (``dst`` itself: kept in place); None: read from durable storage."""
    old: int
    """The old rank whose shard holds them (``src`` holds that shard: its own, or a replica)."""
    src_row: int
    """Where they start in that old rank's shard."""


@dataclass(frozen=True, slots=True)
class Plan:
    """Every piece of the new world's shards: the same list on every rank."""

    old: ShardMap
    new: ShardMap
    pieces: tuple[Piece, ...]

    def _bytes(self, piece: Piece) -> int:
        return piece.rows * self.old.tensors[piece.path].row_bytes

    def received(self, rank: int) -> int:
        """Bytes peers send to ``rank``."""
        return sum(self._bytes(p) for p in self.pieces if p.dst == rank and p.src not in (None, rank))

    def sent(self, rank: int) -> int:
        """Bytes ``rank`` sends to peers."""
        return sum(self._bytes(p) for p in self.pieces if p.src == rank and p.dst != rank)

    def from_durable(self, rank: int) -> int:
        """Bytes ``rank`` reads from durable storage (rows nobody alive holds)."""
        return sum(self._bytes(p) for p in self.pieces if p.dst == rank and p.src is None)

    def kept(self, rank: int) -> int:
        """Bytes of ``rank``'s new shards it already holds."""
        return sum(self._bytes(p) for p in self.pieces if p.dst == rank and p.src == rank)


def plan(old: ShardMap, holders: Mapping[int, Collection[int]], world_size: int) -> Plan:
    """Each new rank's rows of each tensor (FSDP2's even chunks over ``world_size``), and their sources.

    A run of rows the new rank holds itself (its own old shard, or a replica it keeps) stays in place; one
    that another rank holds is sent by the holder that has sent the fewest bytes so far (several hold it
    when replicas are kept); one that nobody holds comes from durable storage. Deterministic: every rank
    computes the same plan from the same arguments.
    """
    new = old.resized(world_size)
    holding: dict[int, list[int]] = {}
    for rank, olds in sorted(holders.items()):
        for j in olds:
            holding.setdefault(j, []).append(rank)
    load: Counter[int] = Counter()
    pieces = []
    for path in sorted(old.tensors):
        before, after = old.tensors[path], new.tensors[path]
        for dst, (first, rows) in enumerate(after.ranges):
            for j, (their_first, their_rows) in enumerate(before.ranges):
                lo, hi = max(first, their_first), min(first + rows, their_first + their_rows)
                if lo >= hi:
                    continue
                candidates = holding.get(j, [])
                src: int | None
                if dst in candidates:
                    src = dst
                elif candidates:
                    src = min(candidates, key=lambda r: (load[r], r))
                    load[src] += (hi - lo) * before.row_bytes
                else:
                    src = None
                pieces.append(Piece(path, dst, lo - first, hi - lo, src, j, lo - their_first))
    return Plan(old, new, tuple(pieces))


def minimum(old: ShardMap, holders: Mapping[int, Collection[int]], world_size: int, rank: int) -> int:
    """The bytes that must reach ``rank`` for its new shards: those it does not hold itself (the figure a
    transfer is measured against; :func:`plan` moves exactly these)."""
    new = old.resized(world_size)
    mine = holders.get(rank, ())
    need = 0
    for path, t in old.tensors.items():
        first, rows = new.tensors[path].ranges[rank]
        have = 0
        for j in mine:
            b, m = t.ranges[j]
            have += max(0, min(first + rows, b + m) - max(first, b))
        need += (rows - have) * t.row_bytes
    return need
