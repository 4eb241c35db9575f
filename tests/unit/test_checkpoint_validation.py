"""Manifests and shared-memory metadata are validated before use; checkpoint settings checked up front."""

from __future__ import annotations

import json
import os
import struct
import uuid
import zlib
from typing import Any

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from elastic_train.checkpoint import (
    CheckpointConfig,
    CheckpointManager,
    CheckpointSetupError,
    durable,
    schema,
)
from elastic_train.checkpoint import slots as slots_mod
from elastic_train.checkpoint.codec import flatten
from elastic_train.checkpoint.memory import MemorySnapshot
from elastic_train.checkpoint.preflight import check_resume_source, check_root, check_settings
from elastic_train.checkpoint.storage import open_storage
from elastic_train.errors import ConfigError


def state(step: int) -> dict[str, Any]:
    return {
        "model": {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4) * step, "b": torch.ones(3)},
        "extra": {"blob": b"\x00\x01payload", "pairs": {1: (2, 3)}, "arr": torch.zeros(2).numpy()},
        "step": step,
    }


@pytest.fixture
def saved(tmp_path, memdir) -> tuple[str, dict[str, Any]]:
    """A run with checkpoints of steps 1 and 2; returns the run path and step 2's manifest."""
    cfg = CheckpointConfig(url=str(tmp_path / "c"), every_steps=1, memory=False, memory_dir=memdir)
    m = CheckpointManager(cfg, "run", rank=0, world_size=1, local_rank=0)
    m.save(1, state(1))
    m.finalize(2, state(2))
    run = str(tmp_path / "c" / "run")
    with open(os.path.join(run, "step-00000002", durable.MANIFEST)) as f:
        return run, json.load(f)


def _with(m: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A deep copy of ``m`` with the item at ``path`` (``a.0.b``) set to ``value``."""
    out = json.loads(json.dumps(m))
    *parents, last = path.split(".")
    node: Any = out
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[int(last) if isinstance(node, list) else last] = value
    return out


def test_a_saved_manifest_validates(saved):
    _, m = saved
    assert durable.check_manifest(m, 2) is None
    parsed = schema.manifest(m)
    assert [s.path for s in parsed.specs()][:2] == ["/model/w", "/model/b"]


@pytest.mark.parametrize(
    ("path", "value", "reason"),
    [
        ("files.0.name", "../x", "files.0.name: '../x' is not a plain file name inside the step directory"),
        ("files.0.name", "/etc/shadow", "'/etc/shadow' is not a plain file name"),
        ("files.0.name", "sub/share.bin", "is not a plain file name"),
        ("files.0.name", ".hidden", "is not a plain file name"),
        ("files.0.name", "manifest.json", "is not a plain file name"),
        ("files.0.size", -1, "files.0.size: Input should be greater than or equal to 0"),
        ("files.0.size", 1.5, "files.0.size: Input should be a valid integer"),
        ("files.0.sha256", "abc", "files.0.sha256: not a sha256 hex digest"),
        ("files.0.hash", "md5", "unknown checksum 'md5'"),
        ("files.0.offset", 64, "gap or overlap at byte 0"),
        ("step", "2", "step: Input should be a valid integer"),
        ("step", True, "step: Input should be a valid integer"),
        ("world_size", 0, "world_size: Input should be greater than or equal to 1"),
        ("layout_bytes", 7, "files hold"),
        ("tensors.0.dtype", "float128", "tensors.0.dtype: unknown tensor dtype 'float128'"),
        (
            "tensors.0.shape",
            [3, 5],
            "tensors.0: tensor '/model/w': float32[3, 5] is 60 bytes, the manifest says 48",
        ),
        ("tensors.0.shape", [3, -4], "tensors.0.shape.1: Input should be greater than or equal to 0"),
        ("tensors.0.offset", 2, "offset 2 is not aligned to its dtype"),
        ("tensors.0.offset", 1 << 40, "tensor '/model/w' lies beyond the end of the state"),
        ("skeleton.model.w", {"__tensor__": 99}, "skeleton at /model/w: tensor index 99"),
        ("skeleton.model.w", {"__tensor__": "0"}, "skeleton at /model/w: tensor index '0'"),
        ("skeleton.model.w", {"__tensor__": True}, "skeleton at /model/w: tensor index True"),
        ("skeleton.extra.blob", {"__bytes__": "@@@"}, "skeleton at /extra/blob: bytes are not valid base64"),
        ("skeleton.extra.blob", {"__bytes__": 5}, "bytes are not valid base64"),
        ("skeleton.extra.pairs", {"__dict__": [[1]]}, "a dict must be a list of [key, value] pairs"),
        ("skeleton.extra.pairs", {"__dict__": [[[1], 2]]}, "a list cannot be a dict key"),
        ("skeleton.extra.pairs", {"__tuple__": 3}, "a tuple must be a list"),
    ],
)
def test_a_tampered_manifest_names_what_is_wrong(saved, path, value, reason):
    _, m = saved
    problem = durable.check_manifest(_with(m, path, value), 2)
    assert problem is not None and problem.startswith("invalid manifest: ") and reason in problem, problem


def test_a_bfloat16_tensor_cannot_be_a_numpy_array(saved):
    _, m = saved
    bad = _with(m, "tensors.0.dtype", "bfloat16")
    bad = _with(bad, "tensors.0.nbytes", 24)
    bad = _with(bad, "skeleton.model.w", {"__ndarray__": 0})
    assert "a bfloat16 tensor cannot be a numpy array" in (durable.check_manifest(bad) or "")


def test_nesting_and_duplicates_are_bounded(saved):
    _, m = saved
    deep: Any = 1
    for _ in range(schema.MAX_DEPTH + 5):
        deep = [deep]
    assert "nested deeper than 100 levels" in (
        durable.check_manifest(_with(m, "skeleton.extra.deep", deep)) or ""
    )
    dup = _with(m, "files", [m["files"][0], m["files"][0]])
    assert "a file is listed twice" in (durable.check_manifest(dup) or "")


def test_an_invalid_newest_checkpoint_is_skipped_at_restore(saved, memdir, tmp_path):
    run, m = saved
    path = os.path.join(run, "step-00000002", durable.MANIFEST)
    with open(path, "w") as f:
        json.dump(_with(m, "files.0.name", "../../../etc/passwd"), f)
    storage = open_storage(run)
    (entry,) = [e for e in durable.list_entries(storage, run) if e.step == 2]
    assert not entry.valid and "not a plain file name" in (entry.problem or "")
    assert durable.verify(storage, entry.path) == [entry.problem]
    cfg = CheckpointConfig(url=str(tmp_path / "c"), memory=False, memory_dir=memdir)
    restored = CheckpointManager(cfg, "run", rank=0, world_size=1, local_rank=0).restore()
    assert restored is not None and restored.step == 1
    assert restored.state["extra"]["blob"] == b"\x00\x01payload"


# -- shared-memory metadata ------------------------------------------------------------------------


def _reseal(snap: MemorySnapshot, slot: int, meta: bytes) -> None:
    """Rewrite a slot's metadata and seal it again with valid checksums (a buggy or hostile writer)."""
    mm = snap._file.mm
    assert mm is not None
    base = snap._file.base(slot)
    fields = list(slots_mod._SLOT.unpack_from(mm, base))
    mm[base + slots_mod.PAGE : base + slots_mod.PAGE + len(meta)] = meta
    fields[4] = slots_mod.checksum(memoryview(meta))
    fields[5] = len(meta)
    header = slots_mod._SLOT.pack(*fields)
    mm[base + slots_mod._SLOT.size : base + slots_mod._SLOT.size + 4] = struct.pack("<I", zlib.crc32(header))
    mm[base : base + slots_mod._SLOT.size] = header


@pytest.mark.parametrize(
    "change",
    [
        lambda meta: meta["specs"][0].update(nbytes=1 << 30, shape=[1 << 28]),
        lambda meta: meta["skeleton"]["model"].update(w={"__tensor__": 42}),
        lambda meta: meta["specs"][0].update(dtype="complex32"),
        lambda meta: meta.pop("specs"),
    ],
)
def test_invalid_snapshot_metadata_is_skipped_like_a_torn_slot(memdir, change):
    snap = MemorySnapshot(memdir, f"run-{uuid.uuid4().hex[:6]}", 0)
    try:
        snap.save(1, flatten(state(1)), background=False)
        newest = snap.save(2, flatten(state(2)), background=False)
        held = snap.newest_valid()
        assert held is not None and held.step == 2
        flat = flatten(state(2))
        meta = {"skeleton": flat.skeleton, "specs": [s.to_json() for s in flat.specs]}
        change(meta)
        _reseal(snap, newest, json.dumps(meta).encode())
        held = snap.newest_valid()
        assert held is not None and held.step == 1, "the older slot is used"
    finally:
        snap.release()


def test_a_lookup_of_a_slot_this_process_wrote_parses_only_its_skeleton(memdir, monkeypatch):
    snap = MemorySnapshot(memdir, f"run-{uuid.uuid4().hex[:6]}", 0)
    try:
        snap.save(1, flatten(state(1)), background=False)
        whole = schema.snapshot_meta
        full_parses = []

        def counted(raw, data_len, known=None):
            if known is None or not raw.startswith(known[0]):
                full_parses.append(raw)
            return whole(raw, data_len, known)

        monkeypatch.setattr(schema, "snapshot_meta", counted)
        held = snap.newest_valid()
        assert held is not None and held.step == 1 and not full_parses
        flat = flatten(state(1))
        assert held.specs == flat.specs
        # the same as a full parse of the slot's metadata
        base = snap._file.base(held.slot)
        fields = slots_mod._SLOT.unpack_from(snap._file.mm, base)
        raw = bytes(snap._file.mm[base + slots_mod.PAGE : base + slots_mod.PAGE + fields[5]])
        assert whole(raw, held.nbytes) == (held.skeleton, held.specs)
    finally:
        snap.release()


def test_metadata_validated_once_is_not_validated_again_by_a_new_reader(memdir, monkeypatch):
    """A worker that re-forms in-process opens its slots again with a new manager: the same bytes are not
    validated twice, and each reader gets a skeleton of its own."""
    run = f"run-{uuid.uuid4().hex[:6]}"
    snap = MemorySnapshot(memdir, run, 0)
    again = MemorySnapshot(memdir, run, 0)  # the next group's manager, on the same file
    try:
        snap.save(1, flatten(state(1)), background=False)
        first = snap.newest_valid()
        assert first is not None

        def refused(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError("validated again")

        monkeypatch.setattr(schema.SnapshotMeta, "model_validate", refused)
        monkeypatch.setattr(schema, "check_skeleton", refused)
        held = again.newest_valid()
        assert held is not None and held.step == 1
        assert held.specs == first.specs and held.skeleton == first.skeleton
        assert held.skeleton is not first.skeleton
        held.skeleton["added"] = 1  # a caller's change stays its own
        assert "added" not in again.newest_valid().skeleton
    finally:
        again.detach()
        snap.release()


def test_validated_metadata_is_checked_again_against_another_data_length(memdir):
    snap = MemorySnapshot(memdir, f"run-{uuid.uuid4().hex[:6]}", 0)
    try:
        snap.save(1, flatten(state(1)), background=False)
        held = snap.newest_valid()
        assert held is not None
        base = snap._file.base(held.slot)
        fields = slots_mod._SLOT.unpack_from(snap._file.mm, base)
        raw = bytes(snap._file.mm[base + slots_mod.PAGE : base + slots_mod.PAGE + fields[5]])
        assert schema.snapshot_meta(raw, held.nbytes)[1] == held.specs  # known (validated) now
        with pytest.raises(ValueError, match="beyond the slot's data"):
            schema.snapshot_meta(raw, max(s.offset + s.nbytes for s in held.specs) - 1)
    finally:
        snap.release()


def test_the_validated_metadata_kept_is_bounded(monkeypatch):
    monkeypatch.setattr(schema, "_VALIDATED", type(schema._VALIDATED)())
    flat = flatten(state(1))
    specs = [s.to_json() for s in flat.specs]
    nbytes = max(s.offset + s.nbytes for s in flat.specs)
    for i in range(schema.VALIDATED_ENTRIES + 5):
        raw = json.dumps({"specs": specs, "skeleton": {**flat.skeleton, "i": i}}).encode()
        schema.snapshot_meta(raw, nbytes)
    assert len(schema._VALIDATED) == schema.VALIDATED_ENTRIES
    big = json.dumps({"specs": specs, "skeleton": "x" * schema.VALIDATED_MAX_BYTES}).encode()
    schema.snapshot_meta(big, nbytes)
    assert all(len(raw) <= schema.VALIDATED_MAX_BYTES for raw, _ in schema._VALIDATED)


@pytest.mark.parametrize(
    "skeleton",
    [
        '{"model":{"w":{"__tensor__":42}}}',  # a tensor index beyond the specs
        '1},"specs":[]',  # the metadata's object closes early: text follows it
        "[",
    ],
)
def test_a_slot_with_this_process_s_specs_but_a_bad_skeleton_is_skipped(memdir, skeleton):
    snap = MemorySnapshot(memdir, f"run-{uuid.uuid4().hex[:6]}", 0)
    try:
        snap.save(1, flatten(state(1)), background=False)
        newest = snap.save(2, flatten(state(2)), background=False)
        assert snap._meta.known is not None
        _reseal(snap, newest, snap._meta.known[0] + skeleton.encode() + b"}")
        held = snap.newest_valid()
        assert held is not None and held.step == 1, "the older slot is used"
    finally:
        snap.release()


# -- the end of a job ------------------------------------------------------------------------------


def test_recycle_pool_is_emptied_when_the_last_step_is_a_checkpoint_step(tmp_path, memdir):
    url = str(tmp_path / "c")
    cfg = CheckpointConfig(
        url=url, every_steps=2, keep_last=1, memory=False, memory_dir=memdir, async_write=False
    )
    m = CheckpointManager(cfg, "run", rank=0, world_size=1, local_rank=0)
    for step in range(1, 7):
        m.save(step, state(step))
    assert os.listdir(os.path.join(url, "run", durable.POOL)), "retention put retired shares into the pool"
    committed = m.finalize(6, state(6))  # step 6 was just checkpointed: nothing new is written
    assert committed is not None and committed.step == 6
    assert sorted(os.listdir(os.path.join(url, "run"))) == ["latest", "step-00000006"]


# -- checks before a job starts --------------------------------------------------------------------


def test_checkpoint_root_checks(tmp_path):
    check_root(str(tmp_path / "new" / "deeper"))  # creatable: fine, and nothing is created
    assert not (tmp_path / "new").exists()
    check_root(str(tmp_path))
    assert os.listdir(tmp_path) == []
    afile = tmp_path / "f"
    afile.write_text("x")
    with pytest.raises(CheckpointSetupError, match="is a file, not a directory"):
        check_root(str(afile))
    with pytest.raises(CheckpointSetupError, match=f"{afile} is a file, not a directory"):
        check_root(str(afile / "a" / "b"))
    url = f"memory://ckpt-{uuid.uuid4().hex}"
    check_root(url)
    storage = open_storage(url)
    assert storage.listdir(storage.root) == [], "the write probe is removed"
    storage.write_small(storage.join(storage.root, "afile"), b"x")
    with pytest.raises(CheckpointSetupError, match="is a file"):
        check_root(f"{url}/afile")


def test_checkpoint_setup_error_is_a_configuration_error():
    assert issubclass(CheckpointSetupError, ConfigError) and CheckpointSetupError.exit_code == 2


def test_resume_source_checks(saved, tmp_path, memdir):
    run, m = saved
    assert check_resume_source(run).step == 2
    assert check_resume_source(os.path.join(run, "step-00000001")).step == 1
    with pytest.raises(CheckpointSetupError, match="does not exist"):
        check_resume_source(str(tmp_path / "nothing"))
    with pytest.raises(CheckpointSetupError, match="holding runs run; name one"):
        check_resume_source(os.path.dirname(run))
    with pytest.raises(CheckpointSetupError, match="step-00000003: does not exist"):
        check_resume_source(os.path.join(run, "step-00000003"))
    for step in (1, 2):
        with open(os.path.join(run, f"step-{step:08d}", durable.MANIFEST), "w") as f:
            json.dump(_with(m, "step", "x"), f)
    with pytest.raises(
        CheckpointSetupError, match=r"no valid checkpoint \(step-00000002: invalid manifest: step"
    ):
        check_resume_source(run)
    # The run to be resumed already has a checkpoint of its own: resume_from is not used, so not checked.
    own = CheckpointConfig(url=str(tmp_path / "own"), memory=False, memory_dir=memdir)
    CheckpointManager(own, "r", rank=0, world_size=1, local_rank=0).finalize(1, state(1))
    own.resume_from = str(tmp_path / "nothing")
    check_settings(own, "r")
    with pytest.raises(CheckpointSetupError, match="does not exist"):
        check_settings(own, "another")


class _ReadOnlyMemory(MemoryFileSystem):
    """memory:// whose writes fail: with PermissionError (denied) or a plain OSError (an outage)."""

    protocol = ("etreadonly",)
    error: type[OSError] = PermissionError

    def pipe_file(self, path: str, value: bytes, *args: Any, **kwargs: Any) -> None:
        raise self.error(f"cannot write {path}")


def test_object_store_root_refused_only_when_writes_are_denied(monkeypatch):
    fsspec.register_implementation("etreadonly", _ReadOnlyMemory, clobber=True)
    with pytest.raises(CheckpointSetupError, match="not writable"):
        check_root("etreadonly://bucket/ckpt")
    check_root("etreadonly://bucket/ckpt", probe_remote=False)  # the worker does not write
    monkeypatch.setattr(_ReadOnlyMemory, "error", OSError)
    check_root("etreadonly://bucket/ckpt")  # an outage at start-up is not a reason to end the job


def test_every_manifest_begins_with_the_same_head() -> None:
    sampler = {"epoch": 1, "cursor": None, "order": [3, 1, 2], 7: "seven"}
    outside = schema.head(
        kind="k", format=3, run_id="r", step=5, world_size=2, round=None, base=0, sampler=sampler
    )
    assert "round" not in outside and "base" not in outside  # no rendezvous round: no lineage
    assert outside["sampler"] == {"epoch": 1, "cursor": None, "7": "seven"}  # scalars only, for people
    assert set(outside["versions"]) == {"elastic_train", "torch", "python"}
    inside = schema.head(
        kind="k", format="dcp-1", run_id="r", step=5, world_size=2, round=4, base=3, sampler=[1]
    )
    assert (inside["round"], inside["base"], inside["sampler"]) == (4, 3, None)
