"""A snapshot whose structure is planned once: each later step only reads what changes.

Building a training state's dicts and flattening them (a skeleton, a spec per tensor, their layout) is the
same work at every step for a state whose structure never changes, and at ~100+ tensors it costs the loop
about a millisecond of Python per step. A :class:`Planner` walks a state in which the bulky parts (the
model's tensors, the optimizer's per-parameter state) are :class:`Fixed`: their owner hands over the live
tensors and a *key* that it changes whenever the part's structure changes. While every key and every other
tensor's place is what it was, the previous step's specs, layout and skeleton of those parts are reused as
they are: the step costs a walk over the small values (step, data cursor, RNG states, hyper-parameters),
which change, and the list of tensors to copy. Anything else (a new key, a new param group, an optimizer
buffer that appears, a scheduler whose state grows) builds a new plan from the parts' full state dicts.

A :class:`Fixed` part's full state is also walked when it is first seen, and it is only cached when the
tensors its owner hands over are exactly the ones its state dict holds (same storage, shape and dtype, in
order); otherwise the part is read from its state dict every step. A wrong key therefore costs speed, and
only a key that stays equal while the structure changes could place a tensor wrongly: owners derive their
keys from identities, data pointers, shapes and dtypes (see ``elastic_train/train/state.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from elastic_train.checkpoint.codec import PLAIN, STR, Flat, Walker
from elastic_train.checkpoint.specs import MARKERS, TensorSpec, layout_key
from elastic_train.log import get_logger

log = get_logger(__name__)


@dataclass(frozen=True, slots=True, eq=False)
class Fixed:
    """A part of a state whose structure its owner vouches for.

    Equal ``key``s (``==``) promise the same skeleton and the same tensors in ``tensors`` (same objects or
    storage, order, shapes, dtypes): only their values change between steps. A part without tensors
    (small values that rarely change: param groups' hyper-parameters) uses the values themselves, with
    their types, as its key: its skeleton is then encoded once per change, not per step.

    A part whose tensors are handed over anew at each step (the RNG states: each read is a new tensor)
    but keep their paths, shapes and dtypes gives those as its ``layout``: while the layout is equal the
    part's tensors keep their places in the plan, and a new key (its small values changed) only walks the
    part again, without a new plan.
    """

    key: Any
    tensors: Sequence[torch.Tensor]
    """The part's tensors in the order its state dict holds them (detached: nothing records autograd)."""
    build: Callable[[], Any]
    """The part's full state (its ``state_dict()``), walked when the part is planned."""
    layout: Any = None
    """Equal layouts promise the same paths, dtypes and shapes of ``tensors`` (not their storage); None:
    the key decides the layout too."""


@dataclass(frozen=True, slots=True)
class Planned(Flat):
    """A planned snapshot whose structure was checked only cheaply when it was taken.

    ``verify`` completes the check (every tensor's identity, storage, shape and dtype against the plan) and
    returns whether the snapshot's plan still describes the state. A consumer calls it before it publishes
    what it copied (the memory tier on its copier thread, before the seal; a durable write before it
    starts): False means the copy may be wrong, and the state's owner re-plans its next snapshot.
    """

    verify: Callable[[], bool] | None = None


@dataclass(frozen=True, slots=True)
class _Part:
    key: Any
    layout: Any
    base: int
    skeleton: Any
    places: list[tuple[str, str, tuple[int, ...], int]]
    mark: tuple[str, Any, int]
    """The part's entry in the plan's signature: (path, layout or None without tensors, base)."""
    nested: dict[str, _Part]
    """The parts met inside this one's full state when it was walked: kept while this one is reused."""


@dataclass(frozen=True, slots=True)
class _Plan:
    signature: list[Any]
    specs: tuple[TensorSpec, ...]
    nbytes: int
    layout: str


class _PlanWalker(Walker):
    __slots__ = ("fresh", "parts", "signature")

    def __init__(self, parts: dict[str, _Part]) -> None:
        self.tensors = []  # Walker's attributes, without its call (every step)
        self.places = []
        self.offset = 0
        self.parts = parts
        #: Per Fixed part (path, key, first tensor index), per other tensor its place: equal signatures,
        #: equal layouts.
        self.signature: list[Any] = []
        self.fresh: dict[str, _Part] = {}

    def enc(self, v: Any, path: str) -> Any:
        # As Walker.enc, with the cases of a step's small values short-cut: a dict with str keys whose plain
        # values are taken as they are (no path built for them), a dict of only such values copied in C (the
        # data cursor), a Fixed part straight to other(). One loop, no call per value of those kinds: each
        # Python frame costs microseconds with the caches cold after a training step.
        kind = type(v)
        if kind in PLAIN:
            return v
        if kind is dict and STR.issuperset(map(type, v)) and MARKERS.isdisjoint(v):
            if PLAIN.issuperset(map(type, v.values())):
                return dict(v)
            out = {}
            for k, x in v.items():
                kind = type(x)
                if kind in PLAIN:
                    out[k] = x
                elif kind is Fixed:
                    out[k] = self.other(x, f"{path}/{k}")
                elif (
                    kind is dict
                    and STR.issuperset(map(type, x))
                    and MARKERS.isdisjoint(x)
                    and PLAIN.issuperset(map(type, x.values()))
                ):
                    out[k] = dict(x)
                else:
                    out[k] = self.enc(x, f"{path}/{k}")
            return out
        if kind is Fixed:
            return self.other(v, path)
        return super().enc(v, path)

    def add(self, t: torch.Tensor, path: str) -> int:
        i = super().add(t, path)
        self.signature.append((*self.places[-1], t.is_cuda))  # the copy is routed by device, once per plan
        return i

    def other(self, v: Any, path: str) -> Any:
        if type(v) is not Fixed:
            return super().other(v, path)
        tensors = self.tensors
        base = len(tensors)
        part = self.parts.get(path)
        layout = v.key if v.layout is None else v.layout
        if (
            part is not None
            and (part.key is v.key or part.key == v.key)
            and part.base == base
            and (part.layout is layout or part.layout == layout)
            and len(v.tensors) == len(part.places)
        ):
            if part.places:
                tensors.extend(v.tensors)
                self.places.extend(part.places)
            self.signature.append(part.mark)
            self.fresh[path] = part
            if part.nested:
                self.fresh.update(part.nested)
            return part.skeleton
        # Planned from the full state; the owner's tensors must be exactly the ones it holds.
        mark = len(self.signature)
        skeleton = self.enc(v.build(), path)
        built = tensors[base:]
        if len(built) == len(v.tensors) and all(
            a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype
            for a, b in zip(built, v.tensors, strict=True)
        ):
            del self.signature[mark:]
            places = self.places[base:]
            # A part without tensors (small values whose key is the values) changes no layout.
            entry = (path, layout if v.tensors else None, base)
            self.signature.append(entry)
            if part is not None and part.mark == entry and part.places != places:
                # A layout its tensors' places belie: they decide this plan (a new one), not the layout.
                self.signature.extend(places)
            inner = path + "/"
            nested = {k: p for k, p in self.fresh.items() if k.startswith(inner)}
            self.fresh[path] = _Part(v.key, layout, base, skeleton, places, entry, nested)
        else:  # read from its state dict at every step (its places are in the signature)
            log.debug("snapshot_part_unplanned", path=path)
        return skeleton


class Planner:
    """Flattens a state containing :class:`Fixed` parts, reusing the last plan while the structure holds.

    Not thread-safe: one training loop uses it.
    """

    def __init__(self) -> None:
        self._parts: dict[str, _Part] = {}
        self._plan: _Plan | None = None
        #: Plans built so far (the first snapshot's included).
        self.plans = 0

    def flat(self, state: Any, verify: Callable[[], bool] | None = None) -> Planned:
        """``state`` flattened: the same skeleton, specs and tensors as :func:`~codec.flatten` of the state
        with each :class:`Fixed` part replaced by its ``build()``; ``verify`` is handed over with it (see
        :class:`Planned`).

        Raises:
            CheckpointError: a value cannot be checkpointed (the message names its path).
        """
        walker = _PlanWalker(self._parts)
        skeleton = walker.enc(state, "")
        self._parts = walker.fresh
        plan = self._plan
        if plan is None or walker.signature != plan.signature:
            specs = walker.specs()
            plan = self._plan = _Plan(walker.signature, specs, walker.offset, layout_key(specs))
            self.plans += 1
            log.debug("snapshot_planned", tensors=len(specs), bytes=plan.nbytes, plans=self.plans)
        return Planned(skeleton, plan.specs, tuple(walker.tensors), plan.nbytes, plan.layout, verify)
