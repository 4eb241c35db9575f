"""Task module the chaos workers import (``train.task: chaos_task:build``).

Importing it registers the ``flaky://`` fsspec filesystem: local files, except that every write fails while
the file named by ``CHAOS_STORAGE_FLAG`` exists — a storage outage the chaos suite switches on and off.
The task is the built-in regression task with a small per-step delay so that faults keyed by step land
while the job is running rather than after it finished.
"""

from __future__ import annotations

import os
import time
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from elastic_train.train.api import Task
from elastic_train.train.tasks import regression

ENV_FLAG = "CHAOS_STORAGE_FLAG"


class FlakyFileSystem(LocalFileSystem):
    """Local filesystem whose writes raise ``OSError`` during an injected outage."""

    protocol = ("flaky",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("auto_mkdir", True)
        super().__init__(*args, **kwargs)

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, str) and path.startswith("flaky://"):
            path = path[len("flaky://") :]
        return super()._strip_protocol(path)

    @staticmethod
    def outage() -> bool:
        flag = os.environ.get(ENV_FLAG)
        return bool(flag) and os.path.exists(flag)

    def _open(self, path: Any, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        if any(c in mode for c in "wax+") and self.outage():
            raise OSError(f"injected storage outage writing {path}")
        return super()._open(path, mode, *args, **kwargs)

    def pipe_file(self, path: Any, value: Any, *args: Any, **kwargs: Any) -> None:
        if self.outage():
            raise OSError(f"injected storage outage writing {path}")
        super().pipe_file(path, value, *args, **kwargs)


fsspec.register_implementation("flaky", FlakyFileSystem, clobber=True)


def build(*, step_delay: float = 0.03, **kwargs: Any) -> Task:
    task = regression.build(**kwargs)
    inner = task.loss_fn

    def slow_loss(model: Any, batch: Any) -> Any:
        time.sleep(step_delay)
        return inner(model, batch)

    task.loss_fn = slow_loss
    return task
