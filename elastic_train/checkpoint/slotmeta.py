"""A snapshot slot's metadata, ``{"specs":[…],"skeleton":…}``, encoded with as little work per step as can be.

The specs only change with the layout: their JSON is built once per layout (and written once per slot).
The skeleton changes every step, but its big parts (a planned snapshot's model and optimizer state, param
groups, Python's RNG state) are the very same objects step after step: their text is reused, the rest
encoded.
"""

from __future__ import annotations

import json
from typing import Any

from elastic_train.checkpoint.codec import PLAIN, Flat
from elastic_train.checkpoint.specs import TensorSpec

#: One encoder for every step's skeleton pieces: ``json.dumps`` with non-default settings builds a new
#: encoder per call, which costs more than encoding the small values of a step.
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=True)
_quote = json.encoder.encode_basestring_ascii  # what the encoder does to a str (ensure_ascii)
_CONSTANTS = {None: b"null", True: b"true", False: b"false"}


def _dumps(v: Any) -> bytes:
    """``v``'s compact JSON (as ``json.dumps``), with the scalars of a step's skeleton short-cut."""
    kind = type(v)
    if kind is str:
        return _quote(v).encode()
    if kind is int:
        return b"%d" % v
    if v is None or kind is bool:
        return _CONSTANTS[v]
    return _ENCODER.encode(v).encode()


class _SkeletonJson:
    """The JSON of skeletons whose big parts are the same objects step after step: the text of a dict or
    list seen at the previous step is reused, the rest encoded. Skeletons are never changed in place once
    handed to a save."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[Any, bytes]] = {}
        self._now: dict[int, tuple[Any, bytes]] = {}

    def dumps(self, skeleton: Any) -> bytes:
        self._now = {}
        text = self._enc(skeleton, 0)
        self._last = self._now
        return text

    def _enc(self, v: Any, depth: int) -> bytes:
        kind = type(v)
        if kind is not dict and kind is not list:
            return _dumps(v)
        hit = self._last.get(id(v))
        if hit is not None and hit[0] is v:
            self._now[id(v)] = hit
            return hit[1]
        if depth < 2 and kind is dict and not PLAIN.issuperset(map(type, v.values())):
            # the top level and the parts (optimizer → state, rng → python): where cached pieces are
            text = b"{" + b",".join(_dumps(k) + b":" + self._enc(x, depth + 1) for k, x in v.items()) + b"}"
        else:
            text = _dumps(v)
        self._now[id(v)] = (v, text)
        return text


class SlotMeta:
    """The metadata encoder of one snapshot file (one training loop uses it)."""

    def __init__(self) -> None:
        #: The layout key, the start of the slots' metadata (the specs' JSON) and the specs it encodes.
        self._specs_json: tuple[str, bytes, tuple[TensorSpec, ...]] = ("", b"", ())
        self._skeleton_json = _SkeletonJson()

    def parts(self, flat: Flat, key: str) -> tuple[bytes, bytes]:
        """The metadata of ``flat`` (of layout ``key``) as (prefix, rest), cut after the specs."""
        if self._specs_json[0] != key:
            specs = json.dumps([s.to_json() for s in flat.specs], separators=(",", ":"))
            self._specs_json = (key, b'{"specs":' + specs.encode() + b',"skeleton":', tuple(flat.specs))
        return self._specs_json[1], self._skeleton_json.dumps(flat.skeleton) + b"}"

    def encode(self, flat: Flat, key: str) -> bytes:
        """The whole metadata of ``flat``."""
        prefix, rest = self.parts(flat, key)
        return prefix + rest

    @property
    def known(self) -> tuple[bytes, tuple[TensorSpec, ...]] | None:
        """The start of the last metadata encoded here (the specs' JSON) and those specs, or None: a lookup
        parses only the skeleton of a slot whose metadata starts with these bytes."""
        _, prefix, specs = self._specs_json
        return (prefix, specs) if prefix else None
