"""A torn shared-memory slot found while a restore sends or lands it: every rank ends on the same valid step.

The holder hashes each chunk right before it goes out and the ranks agree on the verdict at the end; a rank
whose slot failed marks it torn and every rank looks again. Scenarios (3 ranks, rank 2 holds nothing):

- ``sender``: rank 1 alone holds steps 4 and 5, step 5 torn: the receivers end on step 4, not the bytes of 5;
- ``own``: ranks 0 and 1 hold step 5, rank 1's is torn (it lands its own while rank 0 sends to rank 2): all
  end on step 5, rank 1 receiving it from rank 0 at the second attempt;
- ``durable``: rank 1 alone holds step 5, torn, and a durable step 2 exists: every rank restores step 2.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elastic_train.checkpoint import CheckpointConfig, CheckpointManager, transfer
from elastic_train.checkpoint.memory import MemorySnapshot
from elastic_train.net import free_port

WORLD = 3
#: Per scenario: {rank: steps it snapshots}, the rank whose newest slot is torn, the step all must restore.
SCENARIOS = {
    "sender": ({1: (4, 5)}, 1, 5, 4),
    "own": ({0: (4, 5), 1: (4, 5)}, 1, 5, 5),
    "durable": ({1: (5,)}, 1, 5, 2),
}


def state(step: int) -> dict:
    gen = torch.Generator().manual_seed(step)
    n = (2 * transfer.BUCKET + 999) // 4
    return {"model": {"w": torch.rand(n, generator=gen), "b": torch.arange(9.0) + step}, "step": step}


def _tear(memdir: str, run: str, local_rank: int, step: int, scope: str) -> None:
    snap = MemorySnapshot(memdir, run, local_rank, scope)
    held = snap.newest_valid()
    assert held is not None and held.step == step
    data = snap.data(held.slot, held.nbytes)
    pos = held.nbytes * 2 // 3  # in a later chunk: the first ones were sent before it is read
    data[pos] = 255 - int(data[pos])
    snap.detach()


def _rank(rank: int, scenario: str, port: int, url: str, memdir: str, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    held, torn_rank, torn_step, want = SCENARIOS[scenario]
    run = f"torn-{scenario}"
    cfg = CheckpointConfig(url=url, every_steps=0, memory=True, memory_dir=memdir)
    if rank == 0 and scenario == "durable":
        cfg_d = CheckpointConfig(url=url, every_steps=1, memory=False, memory_dir=memdir, async_write=False)
        writer = CheckpointManager(cfg_d, run, rank=0, world_size=1, local_rank=9)
        writer.save(2, state(2))
        writer.close()
    if rank in held:
        alone = CheckpointManager(cfg, run, rank=0, world_size=1, local_rank=rank)
        for step in held[rank]:
            alone.save(step, state(step))
        alone.close()
        if rank == torn_rank:
            _tear(memdir, run, rank, torn_step, alone.run_path)
    dist.barrier()
    m = CheckpointManager(cfg, run, rank=rank, world_size=WORLD, local_rank=rank, group=dist.group.WORLD)
    live = torch.zeros_like(state(want)["model"]["w"])
    restored = m.restore(into=lambda specs: [live if s.path == "/model/w" else None for s in specs])
    # (rank 0 reads a durable checkpoint into a buffer of its own: its tensors are views into that)
    in_place = scenario == "durable" and rank == 0
    ok = (
        restored is not None
        and restored.step == want
        and (in_place or restored.state["model"]["w"] is live)
        and torch.equal(restored.state["model"]["w"], state(want)["model"]["w"])
        and torch.equal(restored.state["model"]["b"], state(want)["model"]["b"])
    )
    with open(os.path.join(out, f"rank-{rank}"), "w") as f:
        f.write("ok" if ok else f"differs: step {restored.step if restored else None}")
    m.close(release_memory=True)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_a_torn_slot_read_during_the_restore_leaves_every_rank_on_the_same_valid_step(
    scenario: str, tmp_path, memdir
) -> None:
    out = tempfile.mkdtemp(dir=tmp_path)
    args = (scenario, free_port(), str(tmp_path / "ck"), memdir, out)
    mp.spawn(_rank, args=args, nprocs=WORLD, join=True)
    for r in range(WORLD):
        with open(os.path.join(out, f"rank-{r}")) as f:
            assert f.read() == "ok", f"rank {r}"
