"""Every rank holds the chosen step in its own memory snapshot (the survivors of an in-process re-formation):
each restores its own, and no byte of the state is sent."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elastic_train.checkpoint import CheckpointConfig, CheckpointManager, transfer
from elastic_train.net import free_port


def state(step: int, rank: int) -> dict:
    """Model bytes of the step, and a part that is the rank's own (as an RNG state is)."""
    gen = torch.Generator().manual_seed(step)
    own = torch.full((3,), float(rank))
    return {"model": {"w": torch.rand(5000, generator=gen)}, "own": own, "step": step}


def _rank(rank: int, world: int, port: int, url: str, memdir: str, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    cfg = CheckpointConfig(url=url, every_steps=0, memory=True, memory_dir=memdir)
    alone = CheckpointManager(cfg, "own", rank=0, world_size=1, local_rank=rank)
    alone.save(7, state(7, rank))  # every rank snapshots step 7
    alone.close()

    def no_transfer(*_: object, **__: object) -> None:
        raise AssertionError("a state was sent although every rank held it")

    transfer.send = transfer.receive = no_transfer  # type: ignore[assignment]
    m = CheckpointManager(cfg, "own", rank=rank, world_size=world, local_rank=rank, group=dist.group.WORLD)
    live = torch.zeros(5000)
    restored = m.restore(into=lambda specs: [live if s.path == "/model/w" else None for s in specs])
    assert restored is not None and (restored.step, restored.source) == (7, "memory")
    want = state(7, rank)
    ok = (
        restored.state["model"]["w"] is live
        and torch.equal(live, want["model"]["w"])
        and torch.equal(restored.state["own"], want["own"])
    )
    with open(os.path.join(out, f"rank-{rank}"), "w") as f:
        f.write("ok" if ok else "differs")
    m.close(release_memory=True)
    dist.barrier()
    dist.destroy_process_group()


def test_every_rank_restores_its_own_snapshot_when_all_hold_the_step(tmp_path, memdir) -> None:
    out = tempfile.mkdtemp(dir=tmp_path)
    mp.spawn(_rank, args=(3, free_port(), str(tmp_path / "ck"), memdir, out), nprocs=3, join=True)
    for r in range(3):
        with open(os.path.join(out, f"rank-{r}")) as f:
            assert f.read() == "ok", f"rank {r} restored other bytes"
