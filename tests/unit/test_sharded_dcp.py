"""Reading DCP directories without executing pickles: the metadata allow-list, row reads of stored chunks,
piece checksums."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp_api

from elastic_train.checkpoint.errors import CheckpointCorrupt
from elastic_train.checkpoint.sharded.dcp import DcpReader, file_digests, read_metadata, written_by
from elastic_train.checkpoint.storage import open_storage

#: DCP itself, saving without a process group, says so.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A DCP directory written by DCP itself (one process, no group): tensors and a pickled entry."""
    state = {
        "model": {"w": torch.arange(24.0).view(6, 4), "b": torch.arange(3, dtype=torch.float64)},
        "step": torch.tensor(7),
        "note": {"anything": [1, 2, 3]},
    }
    path = tmp_path / "dcp"
    dcp_api.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def test_metadata_and_rows(checkpoint: Path) -> None:
    storage = open_storage(str(checkpoint))
    reader = DcpReader(storage, storage.root)
    assert set(reader.layout.tensors) == {"model.w", "model.b", "step"}
    assert "note.anything" in reader.layout.other  # a pickled entry: listed, never read
    rows = torch.empty(3, 4)
    reader.read("model.w", rows, 2)
    assert torch.equal(rows, torch.arange(8.0, 20.0).view(3, 4))
    step = torch.empty((), dtype=torch.int64)
    reader.read("step", step)
    assert int(step) == 7


def test_read_refuses_another_dtype_or_shape_or_key(checkpoint: Path) -> None:
    storage = open_storage(str(checkpoint))
    reader = DcpReader(storage, storage.root)
    with pytest.raises(CheckpointCorrupt, match=r"model.b is float64\[3\], not the float32"):
        reader.read("model.b", torch.empty(3))
    with pytest.raises(CheckpointCorrupt, match="holds no tensor 'model.x'"):
        reader.read("model.x", torch.empty(1))


class _Payload:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("true",))


def test_metadata_naming_anything_else_is_refused() -> None:
    with pytest.raises(CheckpointCorrupt, match="posix.system is not part of a DCP checkpoint's metadata"):
        read_metadata(pickle.dumps(_Payload()))
    with pytest.raises(CheckpointCorrupt, match="not DCP metadata"):
        read_metadata(pickle.dumps({"a": 1}))
    with pytest.raises(CheckpointCorrupt, match="not DCP metadata"):
        read_metadata(b"\x80\x04garbage")


def test_pieces_are_verified_before_use(checkpoint: Path) -> None:
    storage = open_storage(str(checkpoint))
    names = sorted(os.listdir(checkpoint))
    digests = file_digests(storage, storage.root, names)
    pieces = {name: d[2] for name, d in digests.items()}
    reader = DcpReader(storage, storage.root, pieces)
    rows = torch.empty(6, 4)
    reader.read("model.w", rows)
    (data,) = written_by(names, 0)
    raw = bytearray((checkpoint / data).read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (checkpoint / data).write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorrupt, match=f"checksum mismatch in {data}"):
        DcpReader(storage, storage.root, pieces).read("model.w", rows)


def test_metadata_is_verified_too(checkpoint: Path) -> None:
    storage = open_storage(str(checkpoint))
    pieces = {n: d[2] for n, d in file_digests(storage, storage.root, sorted(os.listdir(checkpoint))).items()}
    raw = bytearray((checkpoint / ".metadata").read_bytes())
    raw[-3] ^= 0x01
    (checkpoint / ".metadata").write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorrupt, match="checksum mismatch in .metadata"):
        DcpReader(storage, storage.root, pieces)
