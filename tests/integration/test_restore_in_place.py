"""A holder whose live tensors hold the restored step (``restore(live=step)``, a worker that re-forms its
group in-process) hashes them where they are instead of reading its shared-memory slot, and sends them from
there; the slot's checksum still decides. Scenarios (2 ranks, rank 0 holds step 5 and its live tensors,
rank 1 holds nothing and receives):

- ``kept``: the live tensors are the snapshot's; the slot's copy of them is then damaged. The restore does not
  read it (it would fail its checksum and the ranks would find no snapshot): both end on step 5, bit for bit;
- ``changed``: a live tensor changed after the snapshot was taken. The checksum over the live bytes fails, the
  holder reads its slot after all, and both end on the snapshot's bytes; the slot stays valid;
- ``stale``: the hint names another step than the one restored: the slot is read (a damaged slot is found).
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

STEP = 5


def state(step: int) -> dict:
    gen = torch.Generator().manual_seed(step)
    n = (2 * transfer.BUCKET + 999) // 4
    return {"model": {"w": torch.rand(n, generator=gen), "b": torch.arange(9.0) + step}, "step": step}


def _damage(memdir: str, run: str, local_rank: int, scope: str) -> None:
    """Flip a byte of ``/model/w`` in the newest slot (its data checksum no longer holds)."""
    snap = MemorySnapshot(memdir, run, local_rank, scope)
    held = snap.newest_valid()
    assert held is not None and held.step == STEP
    w = next(s for s in held.specs if s.path == "/model/w")
    data = snap.data(held.slot, held.nbytes)
    pos = w.offset + w.nbytes // 2
    data[pos] = 255 - int(data[pos])
    snap.detach()


def _rank(rank: int, scenario: str, port: int, url: str, memdir: str, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    run = f"in-place-{scenario}"
    cfg = CheckpointConfig(url=url, every_steps=0, memory=True, memory_dir=memdir)
    want = state(STEP)
    live = {"/model/w": torch.zeros_like(want["model"]["w"])}
    hint = None
    if rank == 0:
        mine = state(STEP)  # the holder's live state, snapshotted by this process
        live["/model/w"] = mine["model"]["w"]
        alone = CheckpointManager(cfg, run, rank=0, world_size=1, local_rank=0)
        alone.save(STEP, mine)
        alone.close()
        hint = STEP if scenario != "stale" else STEP - 1
        if scenario in ("kept", "stale"):
            _damage(memdir, run, 0, alone.run_path)
        else:
            live["/model/w"][7] += 1.0
    dist.barrier()
    m = CheckpointManager(cfg, run, rank=rank, world_size=2, local_rank=rank, group=dist.group.WORLD)
    restored = m.restore(into=lambda specs: [live.get(s.path) for s in specs], live=hint)
    if scenario == "stale":
        result = "ok" if restored is None else f"restored step {restored.step} from a damaged slot"
    else:
        ok = (
            restored is not None
            and restored.step == STEP
            and restored.state["model"]["w"] is live["/model/w"]
            and torch.equal(live["/model/w"], want["model"]["w"])
            and torch.equal(restored.state["model"]["b"], want["model"]["b"])
        )
        if ok and rank == 0 and scenario == "changed":
            assert m.memory is not None
            held = m.memory.newest_valid()
            ok = held is not None and held.step == STEP
        result = "ok" if ok else f"differs: step {restored.step if restored else None}"
    with open(os.path.join(out, f"rank-{rank}"), "w") as f:
        f.write(result)
    m.close(release_memory=True)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("scenario", ["kept", "changed", "stale"])
def test_live_tensors_are_hashed_in_place_and_the_checksum_decides(scenario: str, tmp_path, memdir) -> None:
    out = tempfile.mkdtemp(dir=tmp_path)
    args = (scenario, free_port(), str(tmp_path / "ck"), memdir, out)
    mp.spawn(_rank, args=args, nprocs=2, join=True)
    for r in range(2):
        with open(os.path.join(out, f"rank-{r}")) as f:
            assert f.read() == "ok", f"rank {r}"
