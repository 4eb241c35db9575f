"""Optimizers attached to a checkpoint manager: what a snapshot may copy after ``save`` returns; the fence.

Both managers (replicated and sharded) let their memory tier copy an attached optimizer's parameters and
state on the copier thread while the next forward and backward run, which only read them. Each attachment
registers an optimizer step pre-hook that calls the manager's ``fence`` (it waits for that copy) before the
optimizer changes them; :meth:`Attachments.deferrable` says which tensors of a flattened state are those. A
sharded state's tensors are the local shards of DTensors: an optimizer's DTensor is matched by its local
tensor's storage.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from elastic_train.checkpoint.codec import Flat


class Attachment:
    """An optimizer attached to a manager (see :meth:`Attachments.add`)."""

    def __init__(self, owner: Attachments, optimizer: torch.optim.Optimizer, hook: Any) -> None:
        self.optimizer, self._owner, self._hook = optimizer, owner, hook

    def remove(self) -> None:
        """Detach: wait for a copy in flight, drop the step pre-hook."""
        self._owner.remove(self)


class Attachments:
    """The optimizers attached to one manager.

    Args:
        fence: the manager's fence (waits until the snapshot no longer reads the optimizer's tensors).
        idle: waits until the snapshot in flight is done (before an optimizer is detached).
        parameters: the model's parameters, when the manager knows its model: deferred too while an optimizer
            is attached (frozen ones included: a parameter changes only in an optimizer step, or after a
            ``fence`` by whoever changes it in place, which is :meth:`add`'s contract).
    """

    def __init__(
        self,
        fence: Callable[[], None],
        idle: Callable[[], None],
        parameters: Callable[[], Iterable[torch.Tensor]] | None = None,
    ) -> None:
        self._fence, self._idle, self._parameters = fence, idle, parameters
        self._items: list[Attachment] = []
        self._cache: tuple[Any, int, frozenset[int], frozenset[int]] | None = None

    def __iter__(self) -> Iterator[Attachment]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def add(self, optimizer: torch.optim.Optimizer) -> Attachment:
        """Attach ``optimizer``: its step pre-hook fences."""
        attachment = Attachment(self, optimizer, optimizer.register_step_pre_hook(self._hook))
        self._items.append(attachment)
        return attachment

    def _hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._fence()

    def remove(self, attachment: Attachment) -> None:
        if attachment in self._items:
            self._idle()
            self._items.remove(attachment)
            attachment._hook.remove()

    def remove_all(self) -> None:
        for attachment in list(self._items):
            attachment.remove()

    def deferrable(self, flat: Flat) -> frozenset[int]:
        return self.split(flat)[0]

    def split(self, flat: Flat) -> tuple[frozenset[int], frozenset[int]]:
        """Indices of the tensors of ``flat`` that only an attached optimizer's step changes (and the model's
        parameters, see ``parameters``), and those of them that no attached optimizer owns (frozen
        parameters: the step pre-hook need not wait for their copy). Kept for the specs of ``flat``: reused
        while a planned snapshot hands over the same ones."""
        cached = self._cache
        if cached is not None and cached[0] is flat.specs and cached[1] == len(self._items):
            return cached[2], cached[3]
        if not self._items:
            return frozenset(), frozenset()
        # No DTensor exists unless its module was imported (importing it here would cost a replicated job).
        dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)

        def storage(t: torch.Tensor) -> int:
            # a sharded state holds a DTensor's local tensor: its bytes are where the DTensor's are
            return int((t.to_local() if dtensor is not None and isinstance(t, dtensor) else t).data_ptr())

        owned: set[int] = set()
        model: set[int] = set()
        with torch.no_grad():
            if self._parameters is not None:
                model.update(storage(p) for p in self._parameters())
            for opt in (a.optimizer for a in self._items):
                for group in opt.param_groups:
                    owned.update(storage(p) for p in group["params"])
                for per_param in opt.state.values():
                    owned.update(storage(v) for v in per_param.values() if isinstance(v, torch.Tensor))
        ptrs = [t.data_ptr() for t in flat.tensors]
        defer = frozenset(i for i, p in enumerate(ptrs) if p in owned or p in model)
        unfenced = frozenset(i for i in defer if ptrs[i] not in owned)
        self._cache = (flat.specs, len(self._items), defer, unfenced)
        return defer, unfenced
