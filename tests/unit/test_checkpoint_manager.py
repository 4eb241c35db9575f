"""CheckpointManager in one process: memory:// and local storage, integrity, retention, errors, shm tier."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import uuid

import pytest
import torch

from elastic_train.checkpoint import (
    CheckpointConfig,
    CheckpointError,
    CheckpointManager,
    CheckpointSetupError,
    ModelMismatch,
    StorageError,
    WriteFailed,
    durable,
)
from elastic_train.checkpoint import storage as storage_mod
from elastic_train.checkpoint.codec import flatten
from elastic_train.checkpoint.memory import MemorySnapshot
from elastic_train.checkpoint.shmfiles import snapshot_files, sweep_stale
from elastic_train.checkpoint.storage import open_storage


def make_state(step: int, width: int = 8) -> dict:
    torch.manual_seed(step)
    model = torch.nn.Linear(width, 3)
    return {
        "model": model.state_dict(),
        "optimizer": {"state": {0: {"m": torch.randn(width)}}, "param_groups": []},
        "sampler": {"epoch": 1, "cursor": step * 4, "seed": 9},
        "step": step,
        "extra": {"k": [step]},
    }


def cfg(url: str, memdir: str, **kw) -> CheckpointConfig:
    kw.setdefault("memory", False)
    return CheckpointConfig(url=url, memory_dir=memdir, **kw)


def manager(c: CheckpointConfig, run: str = "run") -> CheckpointManager:
    return CheckpointManager(c, run, rank=0, world_size=1, local_rank=0)


def run_root(url: str, run: str = "run") -> tuple[storage_mod.Storage, str]:
    s = open_storage(url)
    return s, s.join(s.root, run)


def test_durable_save_restore_on_memory_url(memdir):
    url = f"memory://ckpt-{uuid.uuid4().hex}"
    m = manager(cfg(url, memdir, every_steps=2, keep_last=2))
    assert m.restore() is None
    for step in range(1, 8):
        m.save(step, make_state(step))
    m.finalize(7, make_state(7))
    s, root = run_root(url)
    entries = durable.list_entries(s, root)
    assert [e.step for e in entries] == [6, 7]  # keep_last 2
    assert s.read(s.join(root, "latest")).decode().strip() == "step-00000007"
    manifest = entries[-1].manifest
    assert manifest is not None and manifest["sampler"] == {"epoch": 1, "cursor": 28, "seed": 9}
    assert manifest["world_size"] == 1 and manifest["versions"]["torch"] == torch.__version__
    assert ["weight", "float32", [3, 8]] in manifest["model"]["params"]
    r = manager(cfg(url, memdir)).restore(model=make_state(0)["model"])
    assert r is not None and r.step == 7 and r.source == "durable" and r.holder_rank is None
    assert torch.equal(r.state["model"]["weight"], make_state(7)["model"]["weight"])
    assert r.state["optimizer"]["state"][0]["m"].shape == (8,) and r.state["extra"] == {"k": [7]}


def test_flipped_byte_fails_verify_and_loader_falls_back(tmp_path, memdir):
    url = str(tmp_path / "c")
    m = manager(cfg(url, memdir, every_steps=1, keep_last=5, async_write=False))
    for step in (1, 2):
        m.save(step, make_state(step))
    m.close()
    s, root = run_root(url)
    newest = durable.list_entries(s, root)[-1]
    assert newest.manifest is not None
    share = os.path.join(newest.path, newest.manifest["files"][0]["name"])
    with open(share, "r+b") as f:
        f.seek(10)
        byte = f.read(1)
        f.seek(10)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert any("checksum mismatch" in p for p in durable.verify(s, newest.path))
    assert durable.verify(s, durable.list_entries(s, root)[0].path) == []
    r = manager(cfg(url, memdir)).restore()
    assert r is not None and r.step == 1 and r.source == "durable"


def test_leftovers_never_block_and_are_cleaned(tmp_path, memdir):
    url = str(tmp_path / "c")
    s, root = run_root(url)
    os.makedirs(os.path.join(root, "step-00000004"))
    with open(os.path.join(root, "step-00000004", "share-00000.dead.bin"), "wb") as f:
        f.write(b"torn")
    os.makedirs(os.path.join(root, "step-00000009"))  # from a run that got further, then crashed
    m = manager(cfg(url, memdir, every_steps=4, async_write=False))
    assert m.restore() is None  # no manifest: not a checkpoint
    for step in range(1, 5):
        m.save(step, make_state(step))
    entries = durable.list_entries(s, root)
    assert [(e.step, e.valid) for e in entries] == [(4, True)]
    assert len(os.listdir(entries[0].path)) == 2  # the manifest and the new share; the torn file is gone
    m.close()


def test_truncated_share_is_invalid_and_skipped(tmp_path, memdir):
    url = str(tmp_path / "c")
    m = manager(cfg(url, memdir, every_steps=1, keep_last=3, async_write=False))
    for step in (1, 2):
        m.save(step, make_state(step))
    m.close()
    s, root = run_root(url)
    newest = durable.list_entries(s, root)[-1]
    assert newest.manifest is not None
    os.truncate(os.path.join(newest.path, newest.manifest["files"][0]["name"]), 5)
    assert "bytes, manifest says" in (durable.list_entries(s, root)[-1].problem or "")
    r = manager(cfg(url, memdir)).restore()
    assert r is not None and r.step == 1


def test_model_mismatch_is_a_checkpoint_error(tmp_path, memdir):
    url = str(tmp_path / "c")
    m = manager(cfg(url, memdir))
    m.finalize(3, make_state(3, width=8))
    with pytest.raises(ModelMismatch, match="different model") as info:
        manager(cfg(url, memdir)).restore(model=make_state(0, width=5)["model"])
    assert "\n" not in str(info.value) and isinstance(info.value, CheckpointError)


def test_resume_from_used_only_without_own_state(tmp_path, memdir):
    src = str(tmp_path / "src")
    manager(cfg(src, memdir)).finalize(5, make_state(5))
    step_url = os.path.join(src, "run", "step-00000005")
    r = manager(cfg(str(tmp_path / "dst"), memdir, resume_from=step_url), "new").restore()
    assert r is not None and r.source == "resume_from" and r.step == 5
    r = manager(cfg(str(tmp_path / "dst"), memdir, resume_from=os.path.join(src, "run")), "new").restore()
    assert r is not None and r.step == 5
    manager(cfg(str(tmp_path / "dst"), memdir), "new").finalize(6, make_state(6))
    r = manager(cfg(str(tmp_path / "dst"), memdir, resume_from=step_url), "new").restore()
    assert r is not None and r.source == "durable" and r.step == 6
    with pytest.raises(CheckpointSetupError, match="nothing: does not exist"):
        manager(cfg(str(tmp_path / "e"), memdir, resume_from=str(tmp_path / "nothing")), "x").restore()


class FailingStorage:
    """Wraps a storage; records the share writes, makes each take ``delay`` seconds (so it is still in
    flight), and lets the first ``failures`` of them raise."""

    def __init__(self, inner, failures: int = 0, delay: float = 0.0) -> None:
        self.inner, self.failures, self.delay, self.writes = inner, failures, delay, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def write_chunks(self, path, chunks):
        import time

        time.sleep(self.delay)
        self.writes.append(path)
        if len(self.writes) <= self.failures:
            raise StorageError(f"cannot write {path}: disk on fire")
        return self.inner.write_chunks(path, chunks)


@pytest.mark.parametrize(
    ("on_error", "failures", "raises", "committed"),
    [
        ("retry", 2, False, True),
        ("retry", 3, True, False),
        ("fatal", 1, True, False),
        ("log", 1, False, False),
    ],
)
def test_write_failures_follow_on_error(tmp_path, memdir, on_error, failures, raises, committed):
    m = manager(cfg(str(tmp_path / "c"), memdir, every_steps=1, on_error=on_error, retries=3))
    m.storage = FailingStorage(m.storage, failures)
    m.save(1, make_state(1))
    m.wait()
    if raises:
        with pytest.raises(WriteFailed, match="disk on fire"):
            m.save(2, make_state(2))
    else:
        m.save(2, make_state(2))
    m.close()
    s, root = run_root(str(tmp_path / "c"))
    assert (1 in [e.step for e in durable.list_entries(s, root) if e.valid]) == committed


def test_missing_s3_extra_names_it(monkeypatch):
    import fsspec

    def boom(*a, **k):
        raise ImportError("No module named 's3fs'")

    monkeypatch.setattr(fsspec, "filesystem", boom)
    with pytest.raises(StorageError, match=r"elastic-train's \[s3\] extra"):
        open_storage("s3://bucket/x")


def test_memory_tier_double_buffer_detects_torn_slot(memdir):
    snap = MemorySnapshot(memdir, "run", 0)
    for step in (1, 2, 3):
        snap.save(step, flatten(make_state(step)))
    snap.wait_idle()
    reader = MemorySnapshot(memdir, "run", 0)
    held = reader.newest_valid()
    assert held is not None and held.step == 3
    # Tear the newest slot's data (a crash mid-copy) → the previous step is still there.
    data = snap.data(held.slot, held.nbytes)
    data[:16] = 7
    reader2 = MemorySnapshot(memdir, "run", 0)
    held2 = reader2.newest_valid()
    assert held2 is not None and held2.step == 2
    # An interrupted copy also leaves the invalidated header: only the other slot counts.
    snap.release()
    assert snapshot_files(memdir, "run") == []


def test_pinned_slot_is_never_rewritten_and_the_other_two_alternate(memdir):
    """A durable write reads a pinned slot; saves meanwhile keep double-buffering in the two others."""
    snap = MemorySnapshot(memdir, "run", 0)
    pinned = snap.save(1, flatten(make_state(1)), background=False)
    snap.pin(pinned)
    before = snap.data(pinned, flatten(make_state(1)).nbytes).clone()
    used = [snap.save(step, flatten(make_state(step)), background=False) for step in range(2, 7)]
    assert pinned not in used and len(set(used)) == 2
    assert all(a != b for a, b in itertools.pairwise(used))  # consecutive saves never share a slot
    assert torch.equal(snap.data(pinned, before.numel()), before)
    # Tear the newest (a crash mid-copy): the step before it is still valid, not only the pinned step 1.
    held = MemorySnapshot(memdir, "run", 0).newest_valid()
    assert held is not None and held.step == 6
    snap.data(held.slot, held.nbytes)[:16] = 7
    again = MemorySnapshot(memdir, "run", 0).newest_valid()
    assert again is not None and again.step == 5
    snap.unpin(pinned)
    assert snap.save(7, flatten(make_state(7)), background=False) == pinned  # the oldest slot again
    snap.release()


def test_memory_tier_reallocates_when_layout_changes(memdir):
    snap = MemorySnapshot(memdir, "run", 0)
    snap.save(1, flatten({"a": torch.ones(3)}), background=False)
    snap.save(2, flatten({"a": torch.ones(3), "b": torch.ones(1000)}), background=False)
    held = MemorySnapshot(memdir, "run", 0).newest_valid()
    assert held is not None and held.step == 2 and len(held.specs) == 2
    snap.release()


def test_restore_prefers_newer_memory_snapshot_and_finalize_releases_it(tmp_path, memdir):
    url = str(tmp_path / "c")
    m = manager(cfg(url, memdir, every_steps=3, memory=True))
    for step in range(1, 6):
        m.save(step, make_state(step))
    m.close()  # an error path: the snapshot stays for the restarted worker
    assert len(snapshot_files(memdir, "run")) == 1
    m2 = manager(cfg(url, memdir, every_steps=3, memory=True))
    r = m2.restore()
    assert r is not None and (r.step, r.source, r.holder_rank) == (5, "memory", 0)
    assert torch.equal(r.state["model"]["bias"], make_state(5)["model"]["bias"])
    m2.finalize(6, make_state(6))
    assert snapshot_files(memdir, "run") == []
    r = manager(cfg(url, memdir)).restore()
    assert r is not None and (r.step, r.source) == (6, "durable")


def test_close_with_release_and_stale_owner_sweep(tmp_path, memdir):
    m = manager(cfg(str(tmp_path / "c"), memdir, memory=True))
    m.save(1, make_state(1))
    m.close(release_memory=True)
    assert snapshot_files(memdir, "run") == []
    # A snapshot whose owner process is gone is swept by the next manager on the node.
    owner = subprocess.Popen([sys.executable, "-c", "pass"])
    owner.wait()
    env_before = os.environ.get("ELASTIC_TRAIN_SHM_OWNER")
    os.environ["ELASTIC_TRAIN_SHM_OWNER"] = str(owner.pid)
    try:
        MemorySnapshot(memdir, "run", 0).save(1, flatten(make_state(1)), background=False)
    finally:
        if env_before is None:
            del os.environ["ELASTIC_TRAIN_SHM_OWNER"]
        else:
            os.environ["ELASTIC_TRAIN_SHM_OWNER"] = env_before
    assert len(snapshot_files(memdir, "run")) == 1
    assert len(sweep_stale(memdir)) == 1 and snapshot_files(memdir, "run") == []


def test_runs_of_one_id_with_other_checkpoint_directories_never_share_a_snapshot(tmp_path, memdir):
    """Two scripts run in turn from one shell, each a world of one (run id ``default``, one owner): the
    second, with its own checkpoint directory, starts fresh instead of reading the first's memory tier."""
    first = manager(cfg(str(tmp_path / "a"), memdir, memory=True), "default")
    first.save(3, make_state(3, width=4))
    second = manager(cfg(str(tmp_path / "b"), memdir, memory=True), "default")
    assert second.restore(model=make_state(0)["model"]) is None
    again = manager(cfg(str(tmp_path / "a"), memdir, memory=True), "default")
    held = again.restore(model=make_state(0, width=4)["model"])
    assert held is not None and (held.step, held.source) == (3, "memory")
    second.save(1, make_state(1))
    assert len(snapshot_files(memdir, "default")) == 2  # one per durable location, both found by run id
    for m in (first, second, again):
        m.close(release_memory=True)


def test_manifest_is_json_with_checksums(tmp_path, memdir):
    manager(cfg(str(tmp_path / "c"), memdir)).finalize(2, make_state(2))
    m = json.loads((tmp_path / "c" / "run" / "step-00000002" / "manifest.json").read_text())
    assert m["kind"] == "elastic_train.checkpoint" and m["format"] == 3 and m["step"] == 2
    assert all(len(f["sha256"]) == 64 and f["size"] > 0 for f in m["files"])
    assert sum(f["size"] for f in m["files"]) == m["bytes"]


def test_final_checkpoint_is_retried_and_never_silently_lost(tmp_path, memdir, monkeypatch):
    from elastic_train.checkpoint import writer as writer_module

    monkeypatch.setattr(writer_module, "retry_delay", lambda attempt: 0.0)
    # on_error=log: the regular checkpoint of step 2 fails and is only logged ...
    m = manager(cfg(str(tmp_path / "c"), memdir, every_steps=2, on_error="log", retries=1))
    m.storage = FailingStorage(m.storage, 1)
    m.save(1, make_state(1))
    m.save(2, make_state(2))
    m.wait()
    s, root = run_root(str(tmp_path / "c"))
    assert [e.step for e in durable.list_entries(s, root) if e.valid] == []
    # ... but the final one of the same step is written anyway, through further failures.
    m.storage = FailingStorage(m.storage.inner, 3)
    committed = m.finalize(2, make_state(2))
    assert committed is not None and committed.step == 2
    assert [e.step for e in durable.list_entries(s, root) if e.valid] == [2]

    # A final checkpoint that cannot be written at all fails the job, whatever on_error says; the memory
    # snapshot stays (the only copy of step 1), and a restarted worker restores it and writes it again.
    c = cfg(str(tmp_path / "d"), memdir, every_steps=0, on_error="log", retries=1, memory=True)
    m2 = manager(c, "other")
    m2.storage = FailingStorage(m2.storage, 10**6)
    m2.save(1, make_state(1))
    with pytest.raises(WriteFailed, match="disk on fire"):
        m2.finalize(1, make_state(1))
    assert len(snapshot_files(memdir, "other")) == 1
    m3 = manager(c, "other")
    held = m3.restore()
    assert held is not None and (held.step, held.source) == (1, "memory")
    assert m3.finalize(1, held.state) is not None
    assert snapshot_files(memdir, "other") == []


def test_a_final_checkpoint_broken_by_the_group_is_a_group_failure(tmp_path, memdir, monkeypatch):
    """The group breaks under the final write (a peer gone): the WriteFailed raised carries the broken
    group's error, so that the hot path re-forms in-process and the final checkpoint is written again
    there, instead of the worker exiting; the memory snapshot stays for it."""
    from elastic_train.checkpoint import writer as writer_module
    from elastic_train.train.hot import classify_failure

    gloo = (
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1"
    )

    def broken(self, job, source):
        raise RuntimeError(gloo)

    monkeypatch.setattr(writer_module.DurableWriter, "_attempt", broken)
    m = manager(cfg(str(tmp_path / "c"), memdir, every_steps=0, memory=True), "broken")
    m.save(1, make_state(1))
    with pytest.raises(WriteFailed) as info:
        m.finalize(1, make_state(1))
    failure = classify_failure(info.value)
    assert failure is not None and failure.reform and "Connection closed by peer" in failure.reason
    assert len(snapshot_files(memdir, "broken")) == 1
    m.close()


def _shares(entry: durable.Entry) -> list[str]:
    assert entry.manifest is not None
    return [os.path.join(entry.path, f["name"]) for f in entry.manifest["files"]]


def test_retired_shares_are_overwritten_in_place_and_the_final_checkpoint_empties_the_pool(tmp_path, memdir):
    url = str(tmp_path / "c")
    s, root = run_root(url)
    pool = durable.pool_path(s, root)
    m = manager(cfg(url, memdir, every_steps=1, keep_last=1, async_write=False))
    m.save(1, make_state(1))
    (first,) = _shares(durable.list_entries(s, root)[0])
    inode = os.stat(first).st_ino
    assert not os.path.exists(pool)
    m.save(2, make_state(2))  # retires step 1: its share moves into the pool
    assert [e.step for e in durable.list_entries(s, root)] == [2]
    (retired,) = os.listdir(pool)
    assert os.stat(os.path.join(pool, retired)).st_ino == inode
    m.save(3, make_state(3))  # step 3's share is step 1's file, rewritten
    (entry,) = durable.list_entries(s, root)
    (third,) = _shares(entry)
    assert os.stat(third).st_ino == inode and durable.verify(s, entry.path) == []
    assert len(os.listdir(pool)) == 1  # now step 2's file
    r = manager(cfg(url, memdir)).restore()
    assert r is not None and r.step == 3
    assert torch.equal(r.state["model"]["weight"], make_state(3)["model"]["weight"])
    m.finalize(4, make_state(4))
    assert [e.step for e in durable.list_entries(s, root)] == [4]
    assert not os.path.exists(pool)


@pytest.mark.parametrize("retired_size", [1, 10_000_000])
def test_a_recycled_file_of_another_size_is_grown_or_cut(tmp_path, retired_size):
    s = open_storage(str(tmp_path))
    pool = s.join(s.root, durable.POOL)
    os.makedirs(pool)
    with open(os.path.join(pool, "old.bin"), "wb") as f:
        f.write(b"\xee" * retired_size)
    state = flatten(make_state(5, width=64))
    buf = torch.empty(state.nbytes, dtype=torch.uint8)
    from elastic_train.checkpoint.codec import copy_into

    copy_into(state, buf)
    record = durable.write_share(s, s.join(s.root, "step-00000005"), 0, buf, 0, state.nbytes, pool=pool)
    path = os.path.join(s.root, "step-00000005", record.name)
    assert os.listdir(pool) == [] and record.size == os.path.getsize(path) == state.nbytes
    with open(path, "rb") as f:
        assert f.read() == buf.numpy().tobytes()


def test_pool_keeps_at_most_the_bytes_of_the_newest_checkpoint(tmp_path, memdir):
    url = str(tmp_path / "c")
    s, root = run_root(url)
    pool = durable.pool_path(s, root)
    os.makedirs(pool)
    for i in range(3):  # retired files of an earlier, larger run of the job
        with open(os.path.join(pool, f"junk{i}.bin"), "wb") as f:
            f.write(b"\0" * 100_000)
    m = manager(cfg(url, memdir, every_steps=1, keep_last=2, async_write=False))
    for step in (1, 2, 3):
        m.save(step, make_state(step))
    newest = durable.list_entries(s, root)[-1]
    assert newest.manifest is not None
    held = sum(os.path.getsize(os.path.join(pool, n)) for n in os.listdir(pool))
    assert 0 < held <= newest.manifest["bytes"]
    assert not any(n.startswith("junk") for n in os.listdir(pool))  # claimed once, the rest cut
    m.close()


@pytest.mark.parametrize("where", ["local-recycle-off", "memory"])
def test_no_pool_without_recycling(tmp_path, memdir, where):
    url = str(tmp_path / "c") if where.startswith("local") else f"memory://ckpt-{uuid.uuid4().hex}"
    m = manager(cfg(url, memdir, every_steps=1, keep_last=1, async_write=False, recycle=False))
    if where == "memory":
        m.cfg.recycle = True  # asked for, but object stores never recycle
    for step in (1, 2, 3):
        m.save(step, make_state(step))
    s, root = run_root(url)
    assert s.listdir(root) == ["latest", "step-00000003"]
    m.close()


def test_finalize_on_a_checkpoint_step_writes_that_step_once(tmp_path, memdir):
    m = manager(cfg(str(tmp_path / "c"), memdir, every_steps=4))
    m.storage = slow = FailingStorage(m.storage, delay=0.3)
    for step in range(1, 5):
        m.save(step, make_state(step))  # step 4's write is in flight when finalize is called
    committed = m.finalize(4, make_state(4))
    assert committed is not None and committed.step == 4
    assert [os.path.basename(os.path.dirname(p)) for p in slow.writes] == ["step-00000004"]
