"""Nested state ⇄ a flat byte layout plus a JSON skeleton (no pickle anywhere).

A state is a nested structure of dicts (any JSON-able keys, int keys included), lists, tuples, tensors,
numpy arrays and plain values. :func:`flatten` replaces every tensor by ``{"__tensor__": i}`` in a JSON
skeleton and describes tensor ``i`` by a :class:`TensorSpec` (path, dtype, shape, byte offset and length in
one flat buffer, 64-byte aligned). The same layout serves the shared-memory tier, the durable shares and the
broadcast at restore; :func:`unflatten` rebuilds the state from a skeleton, specs and bytes.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from elastic_train.checkpoint.errors import CheckpointCorrupt, CheckpointError

ALIGN = 64
_TENSOR, _NDARRAY, _DICT, _TUPLE, _BYTES = "__tensor__", "__ndarray__", "__dict__", "__tuple__", "__bytes__"
MARKERS = frozenset((_TENSOR, _NDARRAY, _DICT, _TUPLE, _BYTES))
"""Keys of the one-key dicts that stand for a tensor, a numpy array, a dict, a tuple or bytes."""
PLAIN = frozenset({int, float, str, bool, type(None)})
"""The exact types stored as they are; a list or tuple of only these is stored without a per-element walk."""
STR = frozenset({str})
"""The key types of a dict that is walked as it is (``STR.issuperset(map(type, d))``: its keys are str)."""

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        *(
            getattr(torch, n)
            for n in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64")
            if hasattr(torch, n)
        ),
    )
}

DTYPE_SIZES: dict[str, int] = {name: d.itemsize for name, d in _DTYPES.items()}
"""Bytes per element of every dtype a checkpoint may hold."""
NUMPY_DTYPES = frozenset(n for n in _DTYPES if n != "bfloat16" and not n.startswith("float8"))
"""Dtypes a tensor can be handed out in as a numpy array."""


_NAMES = {d: n for n, d in _DTYPES.items()}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Where tensor ``i`` of a state lives in the flat buffer."""

    path: str
    """Human-readable location in the state, e.g. ``model/fc.weight``."""
    dtype: str
    """torch dtype name without the ``torch.`` prefix."""
    shape: tuple[int, ...]
    offset: int
    """Byte offset in the flat buffer (64-byte aligned)."""
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "offset": self.offset,
            "nbytes": self.nbytes,
        }

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> TensorSpec:
        return TensorSpec(
            str(d["path"]),
            str(d["dtype"]),
            tuple(int(x) for x in d["shape"]),
            int(d["offset"]),
            int(d["nbytes"]),
        )


@dataclass(frozen=True, slots=True)
class Flat:
    """A flattened state: the skeleton, the tensor specs, the source tensors and the buffer size."""

    skeleton: Any
    specs: tuple[TensorSpec, ...]
    tensors: tuple[torch.Tensor, ...]
    nbytes: int
    layout: str = ""
    """The layout key when the producer knows it already (a planned snapshot); computed otherwise."""

    @property
    def layout_key(self) -> str:
        """Digest of the tensor layout; equal keys mean one pre-allocated buffer fits both states."""
        return self.layout or layout_key(self.specs)


def layout_key(specs: tuple[TensorSpec, ...] | list[TensorSpec]) -> str:
    h = hashlib.sha256()
    for s in specs:
        h.update(f"{s.path}|{s.dtype}|{s.shape}|{s.offset}|{s.nbytes};".encode())
    return h.hexdigest()[:32]


def dtype_of(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise CheckpointCorrupt(f"unknown tensor dtype {name!r}") from None


def flatten(state: Any) -> Flat:
    """Split ``state`` into a JSON skeleton and a list of tensors with their flat layout.

    Raises:
        CheckpointError: a value is neither a tensor, an array nor JSON-able (the message names its path).
    """
    walker = Walker()
    skeleton = walker.enc(state, "")
    specs = walker.specs()
    return Flat(skeleton, specs, tuple(walker.tensors), walker.offset)


class Walker:
    """One walk of a state: the skeleton it returns, the tensors in order and what places them.

    ``places`` holds (path, dtype name, shape, nbytes) per tensor; :meth:`specs` lays them out. The
    snapshot plan (:mod:`elastic_train.checkpoint.plan`) walks with a subclass that reuses the skeletons of
    parts whose structure did not change.
    """

    __slots__ = ("offset", "places", "tensors")

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.places: list[tuple[str, str, tuple[int, ...], int]] = []
        self.offset = 0

    def specs(self) -> tuple[TensorSpec, ...]:
        """The tensors' specs: each at the next 64-byte aligned offset, in walk order."""
        out = []
        offset = 0
        for path, name, shape, nbytes in self.places:
            out.append(TensorSpec(path, name, shape, offset, nbytes))
            offset += (nbytes + ALIGN - 1) // ALIGN * ALIGN
        self.offset = offset
        return tuple(out)

    # Called once per tensor at every snapshot: each attribute read here costs the loop on every step.
    def add(self, t: torch.Tensor, path: str) -> int:
        name = _NAMES.get(t.dtype)
        if name is None or t.layout is not torch.strided:
            if t.layout is not torch.strided or t.is_quantized:
                raise CheckpointError(f"state at {path or '/'}: only dense tensors can be checkpointed")
            raise CheckpointError(f"state at {path or '/'}: dtype {t.dtype} is not supported")
        self.places.append((path, name, tuple(t.shape), t.nbytes))
        self.tensors.append(t.detach() if t.requires_grad else t)
        return len(self.tensors) - 1

    def enc(self, v: Any, path: str) -> Any:
        kind = type(v)
        if kind in PLAIN:  # the exact types first: most values of a step's state are these
            return v
        if kind is dict and STR.issuperset(map(type, v)) and MARKERS.isdisjoint(v):
            return {k: self.enc(x, f"{path}/{k}") for k, x in v.items()}
        if isinstance(v, torch.Tensor):
            return {_TENSOR: self.add(v, path)}
        if isinstance(v, np.ndarray):
            return {_NDARRAY: self.add(torch.from_numpy(np.ascontiguousarray(v)), path)}
        if isinstance(v, np.generic):
            return v.item()
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, (bytes, bytearray)):
            return {_BYTES: base64.b64encode(bytes(v)).decode()}
        enc = self.enc
        if isinstance(v, tuple):
            if PLAIN.issuperset(map(type, v)):  # e.g. Python's RNG state: 625 ints, every step
                return {_TUPLE: list(v)}
            return {_TUPLE: [enc(x, f"{path}/{i}") for i, x in enumerate(v)]}
        if isinstance(v, list):
            if PLAIN.issuperset(map(type, v)):
                return list(v)
            return [enc(x, f"{path}/{i}") for i, x in enumerate(v)]
        if isinstance(v, Mapping):
            if STR.issuperset(map(type, v)) and MARKERS.isdisjoint(v):
                return {k: enc(x, f"{path}/{k}") for k, x in v.items()}
            pairs = []
            for k, x in v.items():
                if not (k is None or isinstance(k, (bool, int, float, str, tuple))):
                    raise CheckpointError(f"state at {path or '/'}: dict key {k!r} is not JSON-able")
                pairs.append([enc(k, path), enc(x, f"{path}/{k}")])
            return {_DICT: pairs}
        return self.other(v, path)

    def other(self, v: Any, path: str) -> Any:
        raise CheckpointError(f"state at {path or '/'}: cannot checkpoint a {type(v).__name__}")


def destinations(specs: tuple[TensorSpec, ...], buf: torch.Tensor) -> list[torch.Tensor | None]:
    """Typed views of every tensor's place in the uint8 tensor ``buf`` (None for empty tensors)."""
    return [tensor_at(buf, spec) if spec.nbytes else None for spec in specs]


def aligned_zeros(nbytes: int, align: int) -> torch.Tensor:
    """A zeroed uint8 tensor of ``nbytes`` whose first byte sits at a multiple of ``align`` in memory."""
    base = torch.zeros(nbytes + align, dtype=torch.uint8)
    skip = -base.data_ptr() % align
    return base[skip : skip + nbytes]


def copy_into(flat: Flat, buf: torch.Tensor) -> None:
    """Copy every tensor of ``flat`` into the uint8 tensor ``buf`` at its offset (the loop's only stall)."""
    copy_to(flat, destinations(flat.specs, buf))


def copy_to(flat: Flat, dests: list[torch.Tensor | None]) -> None:
    """Copy every tensor of ``flat`` into its :func:`destinations` view (kept by a caller that copies the same
    layout into the same buffer every step: building the views costs about as much as copying a small state).
    """
    for dst, src in zip(dests, flat.tensors, strict=True):
        if dst is not None:
            dst.copy_(src)


def tensor_at(buf: torch.Tensor, spec: TensorSpec, *, base: int = 0) -> torch.Tensor:
    """A view of ``spec``'s tensor in the uint8 tensor ``buf`` (whose byte 0 is layout offset ``base``)."""
    start = spec.offset - base
    raw = buf[start : start + spec.nbytes]
    if raw.numel() != spec.nbytes:
        raise CheckpointCorrupt(f"tensor {spec.path} lies outside its buffer")
    return raw.view(dtype_of(spec.dtype)).view(spec.shape)


def unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """Rebuild the state from its skeleton and tensor list (the inverse of :func:`flatten`)."""

    def dec(v: Any) -> Any:
        if isinstance(v, list):
            return [dec(x) for x in v]
        if isinstance(v, dict):
            if len(v) == 1:
                ((k, x),) = v.items()
                if k == _TENSOR:
                    return tensors[x]
                if k == _NDARRAY:
                    return tensors[x].numpy()
                if k == _TUPLE:
                    return tuple(dec(y) for y in x)
                if k == _DICT:
                    return {dec(a): dec(b) for a, b in x}
                if k == _BYTES:
                    return base64.b64decode(x)
            return {k: dec(x) for k, x in v.items()}
        return v

    return dec(skeleton)


def model_fingerprint(state: Any) -> list[list[Any]] | None:
    """[name, dtype, shape] of every tensor in ``state["model"]`` (sorted), or None without a model."""
    model = state.get("model") if isinstance(state, Mapping) else None
    if not isinstance(model, Mapping):
        return None
    out = []
    for name, t in model.items():
        if isinstance(t, torch.Tensor):
            out.append([str(name), str(t.dtype).removeprefix("torch."), list(t.shape)])
    return sorted(out)


def fingerprint_from_specs(specs: tuple[TensorSpec, ...] | list[TensorSpec]) -> list[list[Any]]:
    """The model fingerprint of a flattened state, from the specs under ``model/``."""
    out = [[s.path[len("/model/") :], s.dtype, list(s.shape)] for s in specs if s.path.startswith("/model/")]
    return sorted(out)


def describe_mismatch(saved: list[list[Any]], current: list[list[Any]]) -> str | None:
    """One line naming how two model fingerprints differ, or None when they match."""
    a = {n: (d, tuple(s)) for n, d, s in saved}
    b = {n: (d, tuple(s)) for n, d, s in current}
    if a == b:
        return None
    missing = sorted(set(b) - set(a))
    extra = sorted(set(a) - set(b))
    parts = []
    if missing:
        parts.append(f"{len(missing)} parameter(s) missing (e.g. {missing[0]!r})")
    if extra:
        parts.append(f"{len(extra)} unexpected (e.g. {extra[0]!r})")
    for n in sorted(set(a) & set(b)):
        if a[n] != b[n]:
            (d1, s1), (d2, s2) = a[n], b[n]
            parts.append(f"{n!r} is {d1}{list(s1)} in the checkpoint but {d2}{list(s2)} in the model")
            break
    return "; ".join(parts)
