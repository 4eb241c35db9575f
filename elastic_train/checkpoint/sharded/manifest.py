"""The manifest of a sharded durable checkpoint: the project's ``manifest.json`` beside a DCP directory.

The step directory holds DCP's files (``.metadata``, ``__<rank>_<n>.distcp``) and, written last, this
manifest: step, round and base (the stale-writer rule), world size, the sampler's position, each file with
its size and sha256 tree (and the digest of each 8 MiB piece, so that a restore verifies exactly the pieces
it reads), every tensor of the state with its DCP key, the shard map, and the skeleton of the rest of the
state (scheduler, data position, RNG, step), which DCP would otherwise keep as pickles. Format ``dcp-1``:
``durable.check_manifest`` hands such a manifest here, and it is validated like any other before a byte it
names is read.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError, model_validator
from pydantic import field_validator as _field_validator

from elastic_train.checkpoint import digest, schema
from elastic_train.checkpoint.sharded.shardmap import ShardMap
from elastic_train.checkpoint.specs import DTYPE_SIZES

#: The manifest format of a sharded (DCP) checkpoint.
FORMAT = "dcp-1"
KIND = "elastic_train.checkpoint"
#: DCP's metadata file, and the names of its data files (one or more per writing rank).
METADATA = ".metadata"
DATA_FILE = re.compile(r"^__\d{1,7}_\d{1,7}\.distcp$")

Count = Annotated[StrictInt, Field(ge=0)]
_Hex64 = Annotated[StrictStr, Field(pattern=r"^[0-9a-f]{64}$")]


class FileEntry(BaseModel):
    """One file of the DCP directory."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    name: StrictStr
    size: Count
    sha256: _Hex64
    hash: Literal["sha256-tree-8MiB"]
    rank: Count | None = None
    pieces: list[_Hex64]

    @_field_validator("name")
    @classmethod
    def _dcp_name(cls, v: str) -> str:
        if v != METADATA and not DATA_FILE.match(v):
            raise ValueError(f"{v!r} is not a file of a DCP directory")
        return v

    @model_validator(mode="after")
    def _tree(self) -> FileEntry:
        if len(self.pieces) != -(-self.size // digest.PIECE_BYTES):
            raise ValueError(f"{self.name}: {len(self.pieces)} piece digests for {self.size} bytes")
        if hashlib.sha256(b"".join(bytes.fromhex(p) for p in self.pieces)).hexdigest() != self.sha256:
            raise ValueError(f"{self.name}: the piece digests do not make its sha256")
        return self


class TensorEntry(BaseModel):
    """One tensor of the state: its global shape and dtype, and its key in the DCP directory."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    path: StrictStr
    dtype: StrictStr
    shape: list[Count] = Field(max_length=64)
    nbytes: Count
    key: StrictStr

    @model_validator(mode="after")
    def _size(self) -> TensorEntry:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"unknown tensor dtype {self.dtype!r}")
        n = DTYPE_SIZES[self.dtype]
        for s in self.shape:
            n *= s
        if n != self.nbytes:
            raise ValueError(f"tensor {self.path!r}: {self.dtype}{self.shape} is not {self.nbytes} bytes")
        return self


class ShardedManifest(BaseModel):
    """A sharded checkpoint's ``manifest.json`` (the fields a restore relies on)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    format: Literal["dcp-1"]
    step: Count
    world_size: Annotated[StrictInt, Field(ge=1)]
    run_id: StrictStr | None = None
    round: Count | None = None
    base: Count | None = None
    files: list[FileEntry]
    tensors: list[TensorEntry]
    shards: Any
    skeleton: Any

    @model_validator(mode="after")
    def _consistent(self) -> ShardedManifest:
        names = [f.name for f in self.files]
        if len(set(names)) != len(names):
            raise ValueError("a file is listed twice")
        if METADATA not in names:
            raise ValueError(f"{METADATA} is not listed")
        schema.check_skeleton(self.skeleton, [t.dtype for t in self.tensors])
        smap = ShardMap.from_json(self.shards)
        if smap.world_size != self.world_size:
            raise ValueError(f"shard map of {smap.world_size} ranks, world size {self.world_size}")
        by_path = {t.path: t for t in self.tensors}
        for path, t in smap.tensors.items():
            entry = by_path.get(path)
            if entry is None or entry.dtype != t.dtype or tuple(entry.shape) != t.shape:
                raise ValueError(f"sharded tensor {path!r} is not listed as such in tensors")
        return self

    def shard_map(self) -> ShardMap:
        return ShardMap.from_json(self.shards)


def problem(m: Mapping[str, Any], step: int | None = None) -> str | None:
    """Why ``m`` is not a usable sharded manifest (None when it is)."""
    try:
        ShardedManifest.model_validate(m)
    except ValidationError as exc:
        return f"invalid manifest: {schema.reason(exc)}"
    except (ValueError, RecursionError) as exc:
        return f"invalid manifest: {exc}"
    if step is not None and m["step"] != step:
        return f"manifest says step {m['step']}, directory says {step}"
    return None


def build(
    *,
    run_id: str,
    step: int,
    world_size: int,
    skeleton: Any,
    tensors: Sequence[Mapping[str, Any]],
    smap: ShardMap,
    files: Mapping[str, tuple[int, str, list[str], int]],
    sampler: Any,
    model: list[list[Any]],
    round: int | None,
    base: int,
) -> dict[str, Any]:
    """The manifest of a DCP directory whose files (``{name: (size, sha256 tree, pieces, rank)}``) are
    durable."""
    return {
        **schema.head(
            kind=KIND,
            format=FORMAT,
            run_id=run_id,
            step=step,
            world_size=world_size,
            round=round,
            base=base,
            sampler=sampler,
        ),
        "layout": "torch.distributed.checkpoint",
        "model": {"params": model, "count": len(model)},
        "bytes": sum(f[0] for f in files.values()),
        "files": [
            {"name": name, "size": size, "sha256": sha, "hash": digest.TREE, "rank": rank, "pieces": pieces}
            for name, (size, sha, pieces, rank) in sorted(files.items())
        ],
        "tensors": list(tensors),
        "shards": smap.to_json(),
        "skeleton": skeleton,
    }
