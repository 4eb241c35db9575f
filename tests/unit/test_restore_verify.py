"""A restore verifies a shared-memory slot while it reads it (each chunk hashed right before it is sent or
landed), and a slot whose bytes fail the checksum is never what a restore returns: it is marked torn and the
next-newest snapshot (or a durable checkpoint) is restored instead."""

from __future__ import annotations

import itertools

import pytest
import torch

from elastic_train.checkpoint import CheckpointConfig, CheckpointManager, transfer
from elastic_train.checkpoint.codec import flatten, tensor_at
from elastic_train.checkpoint.memory import MemorySnapshot
from elastic_train.checkpoint.slots import DataCheck, checksum


def big_state(step: int) -> dict:
    """Big tensors (received in place) between small ones (bounced), every byte depending on the step."""
    gen = torch.Generator().manual_seed(step)
    n = (2 * transfer.BUCKET + 4321) // 4
    return {
        "model": {
            "a": torch.rand(7, generator=gen),
            "w": torch.rand(n, generator=gen),
            "b": torch.arange(5, dtype=torch.int64) + step,
            "v": torch.rand(transfer.DIRECT_MIN // 8 + 3, generator=gen).double(),
        },
        "step": step,
    }


def test_the_plan_covers_every_byte_in_order_and_direct_chunks_lie_inside_one_tensor() -> None:
    flat = flatten(big_state(1))
    chunks = transfer.chunks_of(flat.specs, flat.nbytes)
    assert chunks[0][0] == 0 and chunks[-1][1] == flat.nbytes
    assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks))
    assert all(0 < e - s <= (transfer.DIRECT_BUCKET if d else transfer.BUCKET) for s, e, d in chunks)
    big = [s for s in flat.specs if s.nbytes >= transfer.DIRECT_MIN]
    assert len(big) == 2
    for s, e, direct in chunks:
        inside = [p for p in big if p.offset <= s and e <= p.offset + p.nbytes]
        assert bool(inside) == direct, (s, e)
    # The data checksum streamed over the chunks is the slot's one-pass checksum.
    buf = torch.zeros(flat.nbytes, dtype=torch.uint8)
    for spec, t in zip(flat.specs, flat.tensors, strict=True):
        tensor_at(buf, spec).copy_(t)
    check = DataCheck(checksum(memoryview(buf.numpy().data)), flat.nbytes)
    for s, e, _ in chunks:
        check.update(buf[s:e])
    assert check.ok()
    buf[flat.nbytes // 2] ^= 1
    check = DataCheck(checksum(memoryview(buf.numpy().data)), flat.nbytes)
    check.update(buf[: flat.nbytes - 1])
    assert not check.ok(), "a check that did not see every byte is no verdict"


def _tear_newest(memdir: str, run: str, at: float, scope: str) -> int:
    """Flip one byte of the newest slot's data at fraction ``at`` of it (no header or seal changes)."""
    snap = MemorySnapshot(memdir, run, 0, scope)
    held = snap.newest_valid()
    assert held is not None
    data = snap.data(held.slot, held.nbytes)
    pos = min(int(held.nbytes * at), held.nbytes - 1)
    data[pos] = 255 - int(data[pos])
    torn = snap.newest_valid(verify_data=False)
    assert torn is not None and torn.step == held.step and torn.data_sum is not None
    snap.detach()
    return held.step


@pytest.mark.parametrize("at", [0.0, 0.5, 0.999])
def test_a_torn_byte_anywhere_in_the_newest_slot_restores_the_step_before(memdir, tmp_path, at) -> None:
    cfg = CheckpointConfig(url=str(tmp_path / "c"), memory_dir=memdir, every_steps=0)
    saver = CheckpointManager(cfg, "run", rank=0, world_size=1, local_rank=0)
    for step in (1, 2, 3):
        saver.save(step, big_state(step))
    saver.close()
    assert _tear_newest(memdir, "run", at, saver.run_path) == 3
    live = torch.zeros_like(big_state(2)["model"]["w"])
    m = CheckpointManager(cfg, "run", rank=0, world_size=1, local_rank=0)
    restored = m.restore(into=lambda specs: [live if s.path == "/model/w" else None for s in specs])
    assert restored is not None and (restored.step, restored.source) == (2, "memory")
    want = big_state(2)["model"]
    assert restored.state["model"]["w"] is live  # the live tensor holds step 2, not what step 3 wrote there
    for k, v in want.items():
        assert torch.equal(restored.state["model"][k], v), k
    # The torn slot is marked: no later reader takes it, and the next save rewrites it first.
    again = MemorySnapshot(memdir, "run", 0, m.run_path).newest_valid(verify_data=False)
    assert again is not None and again.step == 2
    m.close(release_memory=True)


def test_a_torn_only_snapshot_falls_back_to_the_durable_checkpoint(memdir, tmp_path) -> None:
    url = str(tmp_path / "c")
    durable_only = CheckpointConfig(
        url=url, memory_dir=memdir, every_steps=1, memory=False, async_write=False
    )
    writer = CheckpointManager(durable_only, "run", rank=0, world_size=1, local_rank=5)
    writer.save(1, big_state(1))
    writer.close()
    cfg = CheckpointConfig(url=url, memory_dir=memdir, every_steps=0)
    saver = CheckpointManager(cfg, "run", rank=0, world_size=1, local_rank=0)
    saver.save(4, big_state(4))
    saver.close()
    assert _tear_newest(memdir, "run", 0.7, saver.run_path) == 4
    m = CheckpointManager(cfg, "run", rank=0, world_size=1, local_rank=0)
    restored = m.restore()
    assert restored is not None and (restored.step, restored.source) == (1, "durable")
    assert torch.equal(restored.state["model"]["w"], big_state(1)["model"]["w"])
    m.close(release_memory=True)


def test_a_torn_only_snapshot_and_nothing_else_is_nothing_to_restore(memdir, tmp_path) -> None:
    cfg = CheckpointConfig(url=str(tmp_path / "c"), memory_dir=memdir, every_steps=0)
    saver = CheckpointManager(cfg, "run", rank=0, world_size=1, local_rank=0)
    saver.save(4, big_state(4))
    saver.close()
    _tear_newest(memdir, "run", 0.3, saver.run_path)
    m = CheckpointManager(cfg, "run", rank=0, world_size=1, local_rank=0)
    assert m.restore() is None
    m.close(release_memory=True)


def test_a_restore_that_looks_again_records_its_final_base_under_the_same_round(memdir, tmp_path) -> None:
    from elastic_train.checkpoint import durable
    from elastic_train.checkpoint.storage import open_storage
    from elastic_train.node.gate import Link as AgentLink

    cfg = CheckpointConfig(url=str(tmp_path / "c"), memory_dir=memdir, every_steps=0)
    saver = CheckpointManager(cfg, "run", rank=0, world_size=1, local_rank=0)
    for step in (1, 2, 3):
        saver.save(step, big_state(step))
    saver.close()
    _tear_newest(memdir, "run", 0.5, saver.run_path)
    m = CheckpointManager(cfg, "run", rank=0, world_size=1, local_rank=0, link=AgentLink(None, 4))
    restored = m.restore()
    assert restored is not None and restored.step == 2
    assert m.stamp == 4 and m.base == 2  # not round 5: the first attempt's record is replaced, not added to
    storage = open_storage(cfg.url)
    assert durable.read_lineage(storage, storage.join(storage.root, "run")) == [(4, 2)]
    m.close(release_memory=True)


def test_the_lineage_record_is_written_by_the_time_a_restore_returns_and_a_failed_write_is_not_fatal(
    memdir, tmp_path, monkeypatch
) -> None:
    import threading

    from elastic_train.checkpoint import durable
    from elastic_train.checkpoint.errors import StorageError
    from elastic_train.checkpoint.storage import LocalStorage, open_storage
    from elastic_train.node.gate import Link as AgentLink

    cfg = CheckpointConfig(url=str(tmp_path / "c"), memory_dir=memdir, every_steps=0)
    saver = CheckpointManager(cfg, "run", rank=0, world_size=1, local_rank=0)
    saver.save(3, big_state(3))
    saver.close()
    real = LocalStorage.write_small
    slow = threading.Event()

    def write_small(self, path, data):  # a slow store: the record lands while the restore goes on
        if path.endswith(durable.LINEAGE):
            slow.wait(0.3)
        return real(self, path, data)

    monkeypatch.setattr(LocalStorage, "write_small", write_small)
    m = CheckpointManager(cfg, "run", rank=0, world_size=1, local_rank=0, link=AgentLink(None, 2))
    restored = m.restore()
    storage = open_storage(cfg.url)
    assert restored is not None and restored.step == 3 and m.stamp == 2
    assert durable.read_lineage(storage, storage.join(storage.root, "run")) == [(2, 3)]
    m.close()

    def failing(self, path, data):
        if path.endswith(durable.LINEAGE):
            raise StorageError(f"{path}: permission denied")
        return real(self, path, data)

    monkeypatch.setattr(LocalStorage, "write_small", failing)
    m = CheckpointManager(cfg, "run", rank=0, world_size=1, local_rank=0, link=AgentLink(None, 5))
    restored = m.restore()
    assert restored is not None and restored.step == 3 and m.stamp == 5
    assert durable.read_lineage(storage, storage.join(storage.root, "run")) == [(2, 3)]
    m.close(release_memory=True)
