"""What a manifest (and a shared-memory snapshot's metadata) must say before any byte it names is read.

Manifests come from storage that other people and programs can write to, so they are untrusted input. A
manifest is checked against a pydantic model before it is used: every file it names is a plain name inside
its step directory, integers are integers (not strings, floats or booleans), dtypes are ones this version
knows, each tensor's byte count is its shape times its element size, offsets are aligned and lie inside the
state and the files, and the skeleton only refers to tensors that exist and holds valid base64. A manifest
that fails is an invalid checkpoint (:func:`problem` gives the one-line reason), exactly like one whose
checksum does not match.

pydantic (v2) rather than JSON Schema: the rules that matter most here relate fields to each other (shape and
dtype to ``nbytes``, tensors to files, files to the layout), which are plain validators on typed models,
and its errors carry the location of the offending value, which goes into the reason.

:func:`head` builds the fields both kinds of manifest (replicated, sharded) begin with.
"""

from __future__ import annotations

import base64
import binascii
import math
import platform
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError, model_validator
from pydantic import field_validator as _field_validator

from elastic_train.checkpoint.specs import DTYPE_SIZES, MARKERS, NUMPY_DTYPES, TensorSpec
from elastic_train.version import __version__


def head(
    *, kind: str, format: int | str, run_id: str, step: int, world_size: int, round: int | None, base: int,
    sampler: Any,
) -> dict[str, Any]:  # fmt: skip
    """The fields every manifest (replicated or sharded) begins with: what it is, the run and step, the
    writing world's round and base (only in a rendezvous round: the stale-writer rule reads them), when and
    by which versions it was written, and the sampler's scalar entries (epoch, cursor, seed …) for people
    reading it."""
    import torch  # loaded wherever a state is saved; reading manifests does without it

    lineage = {} if round is None else {"round": round, "base": base}
    plain = (type(None), bool, int, float, str)
    return {
        "kind": kind,
        "format": format,
        "run_id": run_id,
        "step": step,
        **lineage,
        "world_size": world_size,
        "time": time.time(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": {
            "elastic_train": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "sampler": (
            {str(k): v for k, v in sampler.items() if isinstance(v, plain)}
            if isinstance(sampler, Mapping)
            else None
        ),
    }


#: Deepest nesting of a skeleton (real states nest a handful of levels; this keeps every walk bounded).
MAX_DEPTH = 100
#: A file name in a manifest: a plain name (no separator, no ``..``, not hidden, not absolute).
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")

Count = Annotated[StrictInt, Field(ge=0)]


class TensorModel(BaseModel):
    """One entry of ``tensors``: its place in the flat layout."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    path: StrictStr
    dtype: StrictStr
    shape: list[Count] = Field(max_length=64)
    offset: Count
    nbytes: Count

    @_field_validator("dtype")
    @classmethod
    def _known_dtype(cls, v: str) -> str:
        if v not in DTYPE_SIZES:
            raise ValueError(f"unknown tensor dtype {v!r}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> TensorModel:
        size = DTYPE_SIZES[self.dtype]
        expected = math.prod(self.shape) * size
        if expected != self.nbytes:
            raise ValueError(
                f"tensor {self.path!r}: {self.dtype}{self.shape} is {expected} bytes, the manifest says "
                f"{self.nbytes}"
            )
        if self.offset % size:
            raise ValueError(f"tensor {self.path!r}: offset {self.offset} is not aligned to its dtype")
        return self

    def spec(self) -> TensorSpec:
        return TensorSpec(self.path, self.dtype, tuple(self.shape), self.offset, self.nbytes)


class FileModel(BaseModel):
    """One entry of ``files``: a share file of the checkpoint, with its size and checksum."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    name: StrictStr
    size: Count
    sha256: StrictStr
    hash: StrictStr
    """The checksum algorithm (:data:`elastic_train.checkpoint.digest.TREE`)."""
    rank: Count | None = None
    offset: Count | None = None
    """Where the file's bytes start in the flat layout."""

    @_field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        if not _PLAIN_NAME.match(v) or v == "manifest.json":
            raise ValueError(f"{v!r} is not a plain file name inside the step directory")
        return v

    @_field_validator("sha256")
    @classmethod
    def _hex(cls, v: str) -> str:
        if not _HEX64.match(v):
            raise ValueError("not a sha256 hex digest")
        return v

    @_field_validator("hash")
    @classmethod
    def _algorithm(cls, v: str) -> str:
        from elastic_train.checkpoint import digest

        if v != digest.TREE:
            raise ValueError(f"unknown checksum {v!r}")
        return v


class ManifestModel(BaseModel):
    """A checkpoint's ``manifest.json`` (the fields loading relies on; others are informational)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    format: StrictInt
    step: Count
    world_size: Annotated[StrictInt, Field(ge=1)]
    run_id: StrictStr | None = None
    layout_bytes: Count | None = None
    round: Count | None = None
    base: Count | None = None
    files: list[FileModel]
    tensors: list[TensorModel]
    skeleton: Any

    @model_validator(mode="after")
    def _layout(self) -> ManifestModel:
        names = [f.name for f in self.files]
        if len(set(names)) != len(names):
            raise ValueError("a file is listed twice")
        self._tiling()
        check_skeleton(self.skeleton, [t.dtype for t in self.tensors])
        return self

    def _tiling(self) -> None:
        """The files cover the flat layout exactly, and every tensor lies inside it."""
        if self.layout_bytes is None:
            raise ValueError("layout_bytes is missing")
        pos = 0
        for f in sorted(self.files, key=lambda f: -1 if f.offset is None else f.offset):
            if f.offset is None:
                raise ValueError(f"file {f.name} has no offset")
            if f.offset != pos:
                raise ValueError(f"files do not cover the state: a gap or overlap at byte {pos}")
            pos += f.size
        if pos != self.layout_bytes:
            raise ValueError(f"files hold {pos} bytes, the state has {self.layout_bytes}")
        for t in self.tensors:
            if t.offset + t.nbytes > self.layout_bytes:
                raise ValueError(f"tensor {t.path!r} lies beyond the end of the state")

    def specs(self) -> list[TensorSpec]:
        return [t.spec() for t in self.tensors]


class SnapshotMeta(BaseModel):
    """The metadata of a shared-memory snapshot slot: its skeleton and tensor layout."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    skeleton: Any
    specs: list[TensorModel]

    @model_validator(mode="after")
    def _refs(self) -> SnapshotMeta:
        check_skeleton(self.skeleton, [t.dtype for t in self.specs])
        return self


def check_skeleton(skeleton: Any, dtypes: list[str]) -> None:
    """Check that :func:`codec.unflatten` can rebuild ``skeleton`` over tensors of ``dtypes``: markers well
    formed, tensor indices valid (numpy arrays of a dtype numpy has), base64 valid, dict keys hashable,
    nesting bounded.

    Raises:
        ValueError: the first problem, naming where in the skeleton it is.
    """
    n_tensors = len(dtypes)
    stack: list[tuple[Any, str, int, bool]] = [(skeleton, "", 0, False)]
    while stack:
        v, where, depth, as_key = stack.pop()
        at = where or "/"
        if depth > MAX_DEPTH:
            raise ValueError(f"skeleton nested deeper than {MAX_DEPTH} levels at {at}")
        if isinstance(v, list):
            if as_key:
                raise ValueError(f"skeleton at {at}: a list cannot be a dict key")
            stack.extend((x, f"{where}/{i}", depth + 1, False) for i, x in enumerate(v))
        elif isinstance(v, dict):
            marker: str = next(iter(v)) if len(v) == 1 else ""
            x: Any = v.get(marker)
            if marker not in MARKERS:
                if as_key:
                    raise ValueError(f"skeleton at {at}: a mapping cannot be a dict key")
                stack.extend((y, f"{where}/{k}", depth + 1, False) for k, y in v.items())
            elif marker in ("__tensor__", "__ndarray__"):
                if type(x) is not int or not 0 <= x < n_tensors:
                    raise ValueError(f"skeleton at {at}: tensor index {x!r} (the manifest has {n_tensors})")
                if marker == "__ndarray__" and (as_key or dtypes[x] not in NUMPY_DTYPES):
                    raise ValueError(f"skeleton at {at}: a {dtypes[x]} tensor cannot be a numpy array here")
            elif marker == "__bytes__":
                try:
                    base64.b64decode(x if isinstance(x, str) else "\0", validate=True)
                except (binascii.Error, ValueError):
                    raise ValueError(f"skeleton at {at}: bytes are not valid base64") from None
            elif marker == "__tuple__":
                if not isinstance(x, list):
                    raise ValueError(f"skeleton at {at}: a tuple must be a list")
                stack.extend((y, f"{where}/{i}", depth + 1, as_key) for i, y in enumerate(x))
            else:  # __dict__: [key, value] pairs
                pairs = isinstance(x, list) and all(isinstance(p, list) and len(p) == 2 for p in x)
                if as_key or not pairs:
                    raise ValueError(f"skeleton at {at}: a dict must be a list of [key, value] pairs")
                for key, y in x:
                    stack.append((key, where, depth + 1, True))
                    stack.append((y, f"{where}/{key}", depth + 1, False))


def reason(exc: ValidationError) -> str:
    """The first error of ``exc`` as one line: where in the manifest, and what is wrong."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    where = ".".join(str(p) for p in first["loc"])
    msg = str(first["msg"]).removeprefix("Value error, ")
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where}: {msg}{more}" if where else f"{msg}{more}"


def manifest(m: dict[str, Any]) -> ManifestModel:
    """``m`` validated.

    Raises:
        ValueError: one line naming the first problem.
    """
    try:
        return ManifestModel.model_validate(m)
    except ValidationError as exc:
        raise ValueError(f"invalid manifest: {reason(exc)}") from None


#: Slot metadata this process validated, by its exact bytes and the slot's data length: the specs it holds
#: (the same bytes validate the same way). A worker that re-forms in-process looks its slots up again with a
#: new manager, which has encoded nothing yet: a sharded restore's six slots cost ~3 ms of validation each.
_VALIDATED: OrderedDict[tuple[bytes, int], tuple[TensorSpec, ...]] = OrderedDict()
_VALIDATED_LOCK = threading.Lock()
VALIDATED_ENTRIES = 16
VALIDATED_MAX_BYTES = 4 << 20  # larger metadata (a model of tens of thousands of tensors) is not kept


def snapshot_meta(
    raw: bytes, data_len: int, known: tuple[bytes, tuple[TensorSpec, ...]] | None = None
) -> tuple[Any, tuple[TensorSpec, ...]]:
    """(skeleton, specs) of a shared-memory slot's metadata, every tensor inside its ``data_len`` bytes.

    Args:
        known: the start of a metadata this process encoded itself, ``{"specs":[…],"skeleton":``, and the
            specs it encodes. When ``raw`` starts with exactly those bytes only the skeleton after them is
            parsed and checked (the specs' JSON and validation are most of a lookup's time; a survivor looks
            up the slots it wrote itself); anything else is parsed whole.

    Raises:
        ValueError: the metadata does not parse or does not describe a state that fits the slot.
    """
    import json

    key = (raw, data_len)
    with _VALIDATED_LOCK:
        seen = _VALIDATED.get(key)
        if seen is not None:
            _VALIDATED.move_to_end(key)
    if seen is not None:  # a skeleton of its own for each caller
        return json.loads(raw)["skeleton"], seen
    if known is not None and raw.startswith(known[0]) and raw.endswith(b"}"):
        specs = known[1]
        try:
            skeleton = json.loads(raw[len(known[0]) : -1])
            check_skeleton(skeleton, [t.dtype for t in specs])
        except (ValueError, RecursionError):
            pass  # parsed whole below, which names the problem
        else:
            if all(s.offset + s.nbytes <= data_len for s in specs):
                _validated(key, specs)
                return skeleton, specs
    try:
        meta = SnapshotMeta.model_validate(json.loads(raw))
    except ValidationError as exc:
        raise ValueError(f"invalid snapshot metadata: {reason(exc)}") from None
    except RecursionError:
        raise ValueError("invalid snapshot metadata: nested too deeply") from None
    specs = tuple(t.spec() for t in meta.specs)
    if any(s.offset + s.nbytes > data_len for s in specs):
        raise ValueError("invalid snapshot metadata: a tensor lies beyond the slot's data")
    _validated(key, specs)
    return meta.skeleton, specs


def _validated(key: tuple[bytes, int], specs: tuple[TensorSpec, ...]) -> None:
    if len(key[0]) > VALIDATED_MAX_BYTES:
        return
    with _VALIDATED_LOCK:
        _VALIDATED[key] = specs
        _VALIDATED.move_to_end(key)
        while len(_VALIDATED) > VALIDATED_ENTRIES:
            _VALIDATED.popitem(last=False)
