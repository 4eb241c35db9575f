"""Nested state ⇄ a flat byte layout plus a JSON skeleton (no pickle anywhere).

A state is a nested structure of dicts (any JSON-able keys, int keys included), lists, tuples, tensors,
numpy arrays and plain values. :func:`flatten` replaces every tensor by ``{"__tensor__": i}`` in a JSON
skeleton and describes tensor ``i`` by a :class:`TensorSpec` (path, dtype, shape, byte offset and length in
one flat buffer, 64-byte aligned). The same layout serves the shared-memory tier, the durable shares and the
broadcast at restore; :func:`unflatten` rebuilds the state from a skeleton, specs and bytes.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from elastic_train.checkpoint.errors import CheckpointCorrupt, CheckpointError
from elastic_train.checkpoint.specs import (
    BYTES,
    DICT,
    DTYPE_SIZES,
    MARKERS,
    NDARRAY,
    TENSOR,
    TUPLE,
    TensorSpec,
    layout_key,
)

ALIGN = 64
PLAIN = frozenset({int, float, str, bool, type(None)})
"""The exact types stored as they are; a list or tuple of only these is stored without a per-element walk."""
STR = frozenset({str})
"""The key types of a dict that is walked as it is (``STR.issuperset(map(type, d))``: its keys are str)."""

_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_SIZES}
_NAMES = {d: n for n, d in _DTYPES.items()}


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
            return {TENSOR: self.add(v, path)}
        if isinstance(v, np.ndarray):
            return {NDARRAY: self.add(torch.from_numpy(np.ascontiguousarray(v)), path)}
        if isinstance(v, np.generic):
            return v.item()
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, (bytes, bytearray)):
            return {BYTES: base64.b64encode(bytes(v)).decode()}
        enc = self.enc
        if isinstance(v, tuple):
            if PLAIN.issuperset(map(type, v)):  # e.g. Python's RNG state: 625 ints, every step
                return {TUPLE: list(v)}
            return {TUPLE: [enc(x, f"{path}/{i}") for i, x in enumerate(v)]}
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
            return {DICT: pairs}
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
                if k == TENSOR:
                    return tensors[x]
                if k == NDARRAY:
                    return tensors[x].numpy()
                if k == TUPLE:
                    return tuple(dec(y) for y in x)
                if k == DICT:
                    return {dec(a): dec(b) for a, b in x}
                if k == BYTES:
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
