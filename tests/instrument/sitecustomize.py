"""A hold gate for the examples as shipped: the tests run their documented commands, unchanged, with this
folder on ``PYTHONPATH``.

With :data:`GATE` naming a file, every ``Checkpointer`` (the own-loop API's, and the one ``ElasticStrategy``
builds) gets one more step hook: while a line of the file says ``WORLD STEP``, a worker of a group of
``WORLD`` waits at step ``STEP`` (before saving it) until the file changes or goes away, its group is about
to re-form in-process, or its agent stops it (at most :data:`HOLD_LIMIT_S`). A group that re-formed past
``STEP`` is not held by that line. A test thus keeps a job at a step until a fault has landed or a joining
node is in, however slowly that node starts on a loaded machine, without changing the script, its command
line or the numbers it computes. Without :data:`GATE` this module does nothing.

Python imports ``sitecustomize`` at start-up from ``sys.path``: the hook is added when
``elastic_train.train.checkpointer`` is first imported, in whatever process (a fork server's workers inherit
it).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import time
from types import ModuleType
from typing import Any

#: Environment variable naming the gate file.
GATE = "ELASTIC_TRAIN_TEST_HOLD"
#: Most seconds one step waits at the gate.
HOLD_LIMIT_S = 300.0
TARGET = "elastic_train.train.checkpointer"


def held(path: str, *, world_size: int, step: int) -> bool:
    """Whether the gate at ``path`` (lines of ``WORLD STEP``) holds a ``world_size`` group's worker at
    ``step``."""
    try:
        with open(path) as f:
            rules = [tuple(int(x) for x in line.split()) for line in f if line.strip()]
    except (OSError, ValueError):
        return False  # no gate, or one being written: the next look decides
    return (world_size, step) in rules


def _hold(path: str, step: int) -> None:
    import torch.distributed as dist

    from elastic_train.train.hot import change_pending

    world = dist.get_world_size() if dist.is_initialized() else 1
    deadline = time.monotonic() + HOLD_LIMIT_S
    while held(path, world_size=world, step=step) and not change_pending() and time.monotonic() < deadline:
        time.sleep(0.05)


def _instrument(module: ModuleType) -> None:
    """Every Checkpointer of ``module`` made from now on also calls the gate."""
    path = os.environ[GATE]
    cls: Any = module.Checkpointer
    init = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.hooks.append(lambda step: _hold(path, step))

    cls.__init__ = __init__


class _Finder(importlib.abc.MetaPathFinder):
    """Finds :data:`TARGET` the usual way and instruments it once executed."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.loader is not None, name
        execute = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            _instrument(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.get(GATE):
    sys.meta_path.insert(0, _Finder())
