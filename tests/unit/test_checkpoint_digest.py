"""The sha256 tree of share files, and manifests of format 1 (plain sha256) still loading."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from pathlib import Path

import pytest
import torch

from elastic_train.checkpoint import CheckpointConfig, CheckpointManager, digest, durable
from elastic_train.checkpoint.storage import open_storage


def tree(data: bytes, piece: int = digest.PIECE_BYTES) -> str:
    parts = [hashlib.sha256(data[i : i + piece]).digest() for i in range(0, len(data), piece)]
    return hashlib.sha256(b"".join(parts)).hexdigest()


@pytest.mark.parametrize(
    "size", [0, 1, digest.PIECE_BYTES - 1, digest.PIECE_BYTES, 2 * digest.PIECE_BYTES + 5]
)
def test_tree_digest_matches_its_definition_however_the_bytes_are_split(size):
    data = os.urandom(size)
    whole = digest.digest([memoryview(data)])
    assert whole == tree(data)
    cuts = sorted({0, size, size // 3, size // 2, max(0, size - 7)})
    views = [memoryview(data)[a:b] for a, b in itertools.pairwise(cuts)]
    assert digest.digest(views) == whole
    assert digest.digest([memoryview(data)], digest.PLAIN) == hashlib.sha256(data).hexdigest()
    if size:
        flipped = bytearray(data)
        flipped[size // 2] ^= 1
        assert digest.digest([memoryview(flipped)]) != whole


def test_pieces_cut_at_piece_boundaries_without_copies():
    data = bytearray(10)
    got = digest.pieces([memoryview(data)[:3], memoryview(data)[3:]], piece_bytes=4)
    assert [sum(p.nbytes for p in piece) for piece in got] == [4, 4, 2]
    got[0][0][0] = 7
    assert data[0] == 7
    with pytest.raises(ValueError, match="unknown checksum"):
        digest.start([memoryview(data)], "md5")


def test_format_1_manifest_with_plain_sha256_still_loads_and_verifies(tmp_path):
    url = str(tmp_path / "ckpt")
    mgr = CheckpointManager(
        CheckpointConfig(url=url, every_steps=1, memory_every_steps=0),
        "run",
        rank=0,
        world_size=1,
        local_rank=0,
    )
    state = {"w": torch.arange(1000, dtype=torch.float32), "step": 3}
    mgr.save(3, state)
    mgr.close()
    storage = open_storage(url)
    run = storage.join(url, "run")
    (entry,) = durable.list_entries(storage, run)
    assert entry.valid and entry.manifest["files"][0]["hash"] == digest.TREE
    m = dict(entry.manifest, format=1)
    for f in m["files"]:
        f.pop("hash")
        f["sha256"] = hashlib.sha256(Path(entry.path, f["name"]).read_bytes()).hexdigest()
    with open(os.path.join(entry.path, durable.MANIFEST), "w") as out:
        json.dump(m, out)
    (old,) = durable.list_entries(storage, run)
    assert old.valid and durable.verify(storage, old.path) == []
    buf, _ = durable.load(storage, old)
    assert buf.numel() >= 4000
    m["files"][0]["sha256"] = "0" * 64
    with open(os.path.join(entry.path, durable.MANIFEST), "w") as out:
        json.dump(m, out)
    assert any("checksum mismatch (sha256:" in p for p in durable.verify(storage, entry.path))
