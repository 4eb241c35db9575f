"""A sharded checkpoint's manifest is untrusted input: validated before a byte it names is read."""

from __future__ import annotations

import copy
import hashlib
from typing import Any

import pytest

from elastic_train.checkpoint import durable
from elastic_train.checkpoint.sharded import manifest
from elastic_train.checkpoint.sharded.shardmap import ShardMap


def _file(data: bytes) -> tuple[int, str, list[str], int]:
    pieces = [hashlib.sha256(data).digest()] if data else []
    return len(data), hashlib.sha256(b"".join(pieces)).hexdigest(), [p.hex() for p in pieces], 0


def valid() -> dict[str, Any]:
    smap = ShardMap.even({"/model/w": ((6, 4), "float32")}, 2)
    tensors = [
        {"path": "/model/w", "dtype": "float32", "shape": [6, 4], "nbytes": 96, "key": "model.w"},
        {"path": "/rng/torch", "dtype": "uint8", "shape": [8], "nbytes": 8, "key": "elastic_train.rng/torch"},
    ]
    skeleton = {"model": {"w": {"__tensor__": 0}}, "rng": {"__tensor__": 1}}
    return manifest.build(
        run_id="r", step=12, world_size=2, skeleton=skeleton,
        tensors=tensors, smap=smap, files={".metadata": _file(b"meta"), "__0_0.distcp": _file(b"data" * 10)},
        sampler={"epoch": 1, "cursor": 16}, model=[["w", "float32", [6, 4]]], round=3, base=10,
    )  # fmt: skip


def test_a_valid_manifest_passes_the_common_check() -> None:
    m = valid()
    assert durable.check_manifest(m, 12) is None
    assert m["format"] == "dcp-1" and m["round"] == 3 and m["base"] == 10 and m["bytes"] == 44


def _set(path: str, value: Any) -> Any:
    def change(m: dict[str, Any]) -> None:
        target: Any = m
        keys = path.split(".")
        for k in keys[:-1]:
            target = target[int(k) if k.isdigit() else k]
        last = keys[-1]
        target[int(last) if last.isdigit() else last] = value

    return change


CASES = [
    ("a file outside the directory", _set("files.0.name", "../x"), "is not a file of a DCP directory"),
    ("a file listed twice", _set("files.1.name", ".metadata"), "listed twice"),
    ("no metadata", _set("files.0.name", "__1_0.distcp"), ".metadata is not listed"),
    ("pieces that do not make the digest", _set("files.0.pieces", ["0" * 64]), "do not make its sha256"),
    ("a size the pieces do not fit", _set("files.0.size", 9 << 20), "piece digests for"),
    ("a step as a string", _set("step", "12"), "step"),
    ("a tensor of the wrong size", _set("tensors.0.nbytes", 95), "is not 95 bytes"),
    ("an unknown dtype", _set("tensors.1.dtype", "float99"), "unknown tensor dtype"),
    ("a skeleton naming a missing tensor", _set("skeleton.rng", {"__tensor__": 5}), "tensor index 5"),
    ("a map of another world", _set("shards.world_size", 3), "shard map of 3 ranks"),
    ("a sharded tensor not listed", _set("shards.tensors./model/v", [[2], "float32", "even"]), "not listed"),
    ("another directory's step", None, "manifest says step 12, directory says 11"),
]


@pytest.mark.parametrize(("change", "says"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_invalid_manifests_are_not_checkpoints(change: Any, says: str) -> None:
    m = copy.deepcopy(valid())
    step = 12
    if change is None:
        step = 11
    else:
        change(m)
    problem = durable.check_manifest(m, step)
    assert problem is not None and says in problem, problem


def test_a_replicated_reader_of_format_3_is_told_which_format() -> None:
    m = valid()
    m["format"] = "dcp-9"
    assert durable.check_manifest(m) == "unsupported format 'dcp-9' (this version reads 3)"
