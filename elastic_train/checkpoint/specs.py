"""The flat layout of a state described without torch: tensor specs, dtype names and sizes, the skeleton's
markers and model fingerprints.

What a manifest says about a state's bytes is checked (``schema``), listed and verified (``elastic-train
ckpt``) from this module alone, so reading checkpoints does not load torch; :mod:`codec` turns the same
layout into tensors and back.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

TENSOR, NDARRAY, DICT, TUPLE, BYTES = "__tensor__", "__ndarray__", "__dict__", "__tuple__", "__bytes__"
MARKERS = frozenset((TENSOR, NDARRAY, DICT, TUPLE, BYTES))
"""Keys of the one-key dicts that stand for a tensor, a numpy array, a dict, a tuple or bytes."""

DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "complex64": 8,
    "complex128": 16,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
}
"""Bytes per element of every dtype a checkpoint may hold (torch's dtype names without ``torch.``)."""
NUMPY_DTYPES = frozenset(n for n in DTYPE_SIZES if n != "bfloat16" and not n.startswith("float8"))
"""Dtypes a tensor can be handed out in as a numpy array."""


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


def layout_key(specs: tuple[TensorSpec, ...] | list[TensorSpec]) -> str:
    h = hashlib.sha256()
    for s in specs:
        h.update(f"{s.path}|{s.dtype}|{s.shape}|{s.offset}|{s.nbytes};".encode())
    return h.hexdigest()[:32]


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
