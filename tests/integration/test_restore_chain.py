"""A memory snapshot held by one rank reaches every other rank intact: the pipelined chain of the restore
(world >= 3, several buckets in flight) and the bucketed broadcast (world 2), into a buffer of the
receiver's own or straight into its live tensors."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elastic_train.checkpoint import CheckpointConfig, CheckpointManager, transfer
from elastic_train.net import free_port

HOLDER = 1


def big_state(step: int) -> dict:
    """A state of a few messages whose every byte depends on the step (one in the wrong place shows); they
    alternate between the two lanes (groups) of the restore."""
    n = (3 * transfer.DIRECT_BUCKET + 12345) // 4
    gen = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.rand(n, generator=gen), "b": torch.arange(7.0) + step}, "step": step}


def _rank(rank: int, world: int, port: int, url: str, memdir: str, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    cfg = CheckpointConfig(url=url, every_steps=0, memory=True, memory_dir=memdir)
    run = "chain"
    if rank == HOLDER:  # only this rank has a snapshot, of step 5
        alone = CheckpointManager(cfg, run, rank=0, world_size=1, local_rank=rank)
        alone.save(5, big_state(5))
        alone.close()
    dist.barrier()
    m = CheckpointManager(cfg, run, rank=rank, world_size=world, local_rank=rank, group=dist.group.WORLD)
    want = big_state(5)
    # Even ranks restore into live tensors: "w" fits and receives the bytes, "b" has another shape.
    live = {"/model/w": torch.zeros_like(want["model"]["w"]), "/model/b": torch.zeros(3)}
    into = (lambda specs: [live.get(s.path) for s in specs]) if rank % 2 == 0 else None
    restored = m.restore(into=into)
    assert restored is not None and (restored.step, restored.source) == (5, "memory")
    assert restored.holder_rank == HOLDER
    ok = torch.equal(restored.state["model"]["w"], want["model"]["w"]) and torch.equal(
        restored.state["model"]["b"], want["model"]["b"]
    )
    if into is not None:
        ok = (
            ok
            and restored.state["model"]["w"] is live["/model/w"]
            and torch.equal(live["/model/b"], torch.zeros(3))
        )
    with open(os.path.join(out, f"rank-{rank}"), "w") as f:
        f.write("ok" if ok else "differs")
    m.close(release_memory=True)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_rank_restores_the_holders_snapshot_bit_for_bit(world: int, tmp_path, memdir) -> None:
    out = tempfile.mkdtemp(dir=tmp_path)
    mp.spawn(_rank, args=(world, free_port(), str(tmp_path / "ck"), memdir, out), nprocs=world, join=True)
    assert sorted(os.listdir(out)) == [f"rank-{r}" for r in range(world)]
    for r in range(world):
        with open(os.path.join(out, f"rank-{r}")) as f:
            assert f.read() == "ok", f"rank {r} restored other bytes"


def _broadcast_rank(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    got = []
    for size in (10, transfer.SMALL - 64, transfer.SMALL, 5 * transfer.SMALL + 3):
        obj = {"size": size, "blob": bytes(range(256)) * (size // 256) + b"x" * (size % 256)}
        mine = obj if rank == 1 else {"size": -1}
        got.append(transfer.broadcast_small(mine, src=1, group=dist.group.WORLD) == obj)
    with open(os.path.join(out, f"rank-{rank}"), "w") as f:
        f.write("ok" if all(got) else f"differs: {got}")
    dist.destroy_process_group()


def test_a_small_broadcast_carries_objects_below_and_beyond_its_first_message(tmp_path) -> None:
    out = tempfile.mkdtemp(dir=tmp_path)
    mp.spawn(_broadcast_rank, args=(free_port(), out), nprocs=3, join=True)
    for r in range(3):
        with open(os.path.join(out, f"rank-{r}")) as f:
            assert f.read() == "ok", f"rank {r}"
