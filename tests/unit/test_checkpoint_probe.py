"""Start checks of the checkpoint tiers: the durable URL shared by all nodes, the memory tier within /dev/shm.

The shared-storage check runs over a group of threads here (one per rank, an all-gather made of a barrier):
each "node" opens its own view of the URL, one storage for all or a directory of its own.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_train.checkpoint import capacity, probe
from elastic_train.checkpoint.capacity import memory_tier_refusal
from elastic_train.checkpoint.codec import flatten
from elastic_train.checkpoint.errors import CheckpointSetupError
from elastic_train.checkpoint.memory import MemorySnapshot
from elastic_train.checkpoint.storage import open_storage


class Gather:
    """An all-gather among threads (rank order), as ``dist.all_gather_object`` over a group."""

    def __init__(self, n: int) -> None:
        self.slots: list[Any] = [None] * n
        self.barrier = threading.Barrier(n)
        self.calls = 0

    def __call__(self, rank: int, obj: Any) -> list[Any]:
        self.slots[rank] = obj
        self.barrier.wait()
        out = list(self.slots)
        if self.barrier.wait() == 0:
            self.calls += 1
        return out


def check_group(roots: list[Path], local_ranks: list[int], names: list[str]) -> tuple[list[Any], int]:
    """Run the check on one thread per rank; returns what each raised (None: passed) and the gathers."""
    gather = Gather(len(roots))
    out: list[Any] = [None] * len(roots)

    def rank(i: int) -> None:
        storage = open_storage(str(roots[i]))
        check = probe.SharedStorageCheck(
            storage, storage.join(storage.root, "job"), "/data/ckpt", rank=i, local_rank=local_ranks[i],
            gather=lambda obj: gather(i, obj), environ={"ELASTIC_TRAIN_NODE_ID": names[i]},
        )  # fmt: skip
        try:
            check.run()
        except CheckpointSetupError as exc:
            out[i] = exc

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(len(roots))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out, gather.calls


@pytest.fixture(autouse=True)
def _fresh_process() -> None:
    probe._checked.clear()


def test_one_storage_for_all_nodes_passes_and_leaves_no_probe(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    raised, calls = check_group([shared] * 4, [0, 1, 0, 0], ["a", "a", "b", "c"])
    assert raised == [None] * 4 and calls == 3
    assert list((shared / "job" / probe.PROBES).iterdir()) == []
    # the next group of the same processes: one gather, nothing written
    raised, calls = check_group([shared] * 4, [0, 1, 0, 0], ["a", "a", "b", "c"])
    assert raised == [None] * 4 and calls == 1


def test_a_local_path_on_separate_machines_is_refused_on_every_rank(tmp_path: Path) -> None:
    roots = [tmp_path / "host-a", tmp_path / "host-a", tmp_path / "host-b"]
    raised, _ = check_group(roots, [0, 1, 0], ["host-a", "host-a", "host-b"])
    assert all(isinstance(e, CheckpointSetupError) for e in raised)
    line = str(raised[0])
    assert line.startswith("checkpoint.url /data/ckpt is not shared between the nodes: host-a cannot read ")
    assert "host-a cannot read host-b's, host-b cannot read host-a's probe" in line
    assert len({str(e) for e in raised}) == 1


def test_nodes_with_one_name_are_told_apart_by_rank(tmp_path: Path) -> None:
    raised, _ = check_group([tmp_path / "x", tmp_path / "y"], [0, 0], ["vm", "vm"])
    assert "vm (rank 0) cannot read vm (rank 1)'s" in str(raised[0])


def test_one_node_alone_has_nothing_to_compare(tmp_path: Path) -> None:
    raised, calls = check_group([tmp_path / "a", tmp_path / "a"], [0, 1], ["a", "a"])
    assert raised == [None, None] and calls == 1


def test_refusal_names_a_few_pairs_and_counts_the_rest() -> None:
    pairs = [(f"n{i}", f"m{i}") for i in range(6)]
    line = probe.refusal("/x", pairs)
    assert "n3 cannot read m3's and 2 more probe written there" in line and "n4" not in line


GIB = 1 << 30

# (local ranks, one rank's file, room) -> refused
FITS = {
    "the gpu overlay: 8 ranks x 3 slots of 2.6 GiB in 64 GiB": (8, int(3 * 2.6 * GIB), 64 * GIB, False),
    "8 ranks x 3 slots of 2.8 GiB in 64 GiB": (8, int(3 * 2.8 * GIB), 64 * GIB, True),
    "one rank, exactly the room": (1, 3 * GIB, 3 * GIB, False),
}


@pytest.mark.parametrize("case", sorted(FITS))
def test_memory_tier_sizing(case: str) -> None:
    ranks, file_bytes, room, refused = FITS[case]
    line = memory_tier_refusal(
        directory="/dev/shm", local_ranks=ranks, slots=3, file_bytes=file_bytes, state_bytes=file_bytes // 3,
        room=room,
    )  # fmt: skip
    assert (line is not None) == refused
    if line is not None:
        assert line.startswith("the memory tier needs 8 local rank(s) x 3 slots x 2.80 GiB (a 2.80 GiB state")
        assert "= 67.20 GiB in /dev/shm, which holds 64.00 GiB for it (room for a 2.67 GiB state" in line
        assert "checkpoint.memory: false" in line


def test_a_snapshot_the_node_cannot_hold_is_refused_before_it_is_allocated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    state = {"w": torch.zeros(256, 1024)}  # 1 MiB
    flat = flatten(state)
    monkeypatch.setattr(capacity, "free_bytes", lambda _d: 16 << 20)  # 16 MiB: room for 5 MiB per rank
    snap = MemorySnapshot(str(tmp_path), "run", 0)
    with pytest.raises(CheckpointSetupError, match=r"needs 8 local rank\(s\) x 3 slots"):
        snap.save(1, flat)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    snap.save(1, flat)
    snap.release()
