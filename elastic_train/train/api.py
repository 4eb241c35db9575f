"""The user task API: what a job trains.

A task is a factory ``module:function`` (or a built-in name) that returns a :class:`Task`. The factory is
called with ``train.task_args`` as keyword arguments after the global RNGs are seeded with ``train.seed``, so
the model initialisation is the same on every rank and at every world size::

    def build(*, hidden: int = 64) -> Task:
        model = MyModel(hidden)
        return Task(
            model=model,
            optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
            dataset=my_dataset,
            loss_fn=lambda model, batch: F.cross_entropy(model(batch[0]), batch[1], reduction="none"),
        )

``loss_fn`` returns **per-sample** losses (shape ``[n]``); the loop sums and weights them so the update
equals the gradient of the mean loss over the whole global batch at any world size.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from elastic_train.train.errors import TaskError

#: Built-in task names and their factories.
BUILTIN_TASKS: dict[str, str] = {
    "regression": "elastic_train.train.tasks.regression:build",
    "charlm": "elastic_train.train.tasks.charlm:build",
}


class Dataset(Protocol):
    """Anything with a length and integer indexing (a ``torch.utils.data.Dataset`` with ``__len__``)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]
"""``(model, batch) -> per-sample losses`` of shape ``[len(batch)]``; ``model`` is the DDP-wrapped module."""
BatchFn = Callable[[Sequence[int]], Any]
"""``indices -> batch`` (tensors, or tuples/lists/dicts of tensors); must accept an empty list."""


@dataclass(kw_only=True, slots=True)
class Task:
    """Model, optimizer, data and loss of one training job."""

    model: torch.nn.Module
    """The model on the CPU; the loop moves it to the worker's device and wraps it in DDP."""
    optimizer: torch.optim.Optimizer
    """Optimizer over ``model.parameters()``."""
    dataset: Dataset
    """The training samples; only ``len(dataset)`` is used when ``batch_fn`` is given."""
    loss_fn: LossFn
    """Per-sample losses of a batch (shape ``[n]``); the loop weights them by sample count."""
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    """Optional learning-rate scheduler, stepped once per optimizer step."""
    batch_fn: BatchFn | None = None
    """Builds a batch from dataset indices (default: ``default_collate`` of ``dataset[i]``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, torch.nn.Module):
            raise TaskError(f"task model is a {type(self.model).__name__}, not a torch.nn.Module")
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TaskError(f"task optimizer is a {type(self.optimizer).__name__}, not a torch Optimizer")
        if len(self.dataset) < 1:
            raise TaskError("task dataset is empty")

    def make_batch(self, indices: Sequence[int]) -> Any:
        """The batch for ``indices`` (through ``batch_fn`` or the default collation)."""
        if self.batch_fn is not None:
            return self.batch_fn(indices)
        from torch.utils.data import default_collate

        return default_collate([self.dataset[i] for i in indices])


def resolve_factory(spec: str) -> Callable[..., Task]:
    """Import the task factory named by ``spec`` (a built-in name or ``module:function``).

    Raises:
        TaskError: unknown name, module not importable, or function missing.
    """
    target = BUILTIN_TASKS.get(spec, spec)
    module_name, sep, func_name = target.partition(":")
    if not sep or not module_name or not func_name:
        builtins = ", ".join(sorted(BUILTIN_TASKS))
        raise TaskError(f"train.task: {spec!r} is neither a built-in task ({builtins}) nor module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TaskError(f"train.task: cannot import module {module_name!r} ({exc})") from exc
    factory = getattr(module, func_name, None)
    if not callable(factory):
        raise TaskError(f"train.task: {module_name!r} has no function {func_name!r}")
    return factory


def load_task(spec: str, args: Mapping[str, Any] | None = None) -> Task:
    """Call the task factory ``spec`` with ``args`` and check that it returned a :class:`Task`.

    Seed the global RNGs before calling this so the model initialisation is reproducible.

    Raises:
        TaskError: the factory cannot be found, rejects the arguments or returns something else.
    """
    factory = resolve_factory(spec)
    try:
        task = factory(**dict(args or {}))
    except TypeError as exc:
        raise TaskError(f"train.task_args: {spec} rejected the arguments ({exc})") from exc
    if not isinstance(task, Task):
        raise TaskError(f"train.task: {spec} returned a {type(task).__name__}, not an elastic_train Task")
    return task
