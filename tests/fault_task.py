"""Task module for tests that crash or slow down the built-in worker (``train.task: tests.fault_task:build``).

It is the built-in regression task plus an optimizer step pre-hook that acts right before the optimizer step
of a step:

- ``faults="RANK@STEP[:RESTART][,...]"``: global rank ``RANK`` exits abruptly (``os._exit(FAULT_EXIT_CODE)``,
  no clean-up, like a crash) before the optimizer step of ``STEP``, but only in the worker generation whose
  ``TORCHELASTIC_RESTART_COUNT`` is ``RESTART`` (default 0), so the restarted worker does not die again;
- ``step_delay=SECONDS``: every step sleeps that long, so a test can act on a job while it trains.

The step number is read from the task's learning-rate scheduler, which the loop steps once per optimizer step
and which is restored with every checkpoint: before the optimizer step of step ``S`` its ``last_epoch`` is
``S - 1``. The hook computes nothing the training uses, so the weights are bit-identical to the regression
task's with the same arguments. Workers import this module, so the tests put the repository on their
``PYTHONPATH``.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from elastic_train.train.api import Task
from elastic_train.train.env import WorkerEnv
from elastic_train.train.tasks import regression

#: Exit code of a worker killed by a planned fault.
FAULT_EXIT_CODE = 86


@dataclass(frozen=True, slots=True)
class PlannedFault:
    rank: int
    step: int
    restart: int = 0


def parse_faults(text: str) -> list[PlannedFault]:
    """Parse ``RANK@STEP[:RESTART]`` items separated by commas.

    Raises:
        ValueError: an item is malformed.
    """
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            rank, _, rest = item.partition("@")
            step, _, restart = rest.partition(":")
            faults.append(PlannedFault(int(rank), int(step), int(restart) if restart else 0))
        except ValueError:
            raise ValueError(f"faults: {item!r} is not RANK@STEP[:RESTART]") from None
    return faults


def planned_steps(text: str, *, rank: int, restart_count: int) -> set[int]:
    """The steps before whose optimizer step this rank, in this worker generation, exits."""
    return {f.step for f in parse_faults(text) if f.rank == rank and f.restart == restart_count}


def crash(rank: int, step: int) -> None:
    """Exit at once, like a crashed process (no clean-up, no exception handlers)."""
    sys.stderr.write(f"tests.fault_task: planned fault: rank {rank} exits at step {step}\n")
    sys.stderr.flush()
    os._exit(FAULT_EXIT_CODE)


def build(*, faults: str = "", step_delay: float = 0.0, **kwargs: Any) -> Task:
    """The regression task (``kwargs``) whose workers crash at ``faults`` and sleep ``step_delay`` a step."""
    task = regression.build(**kwargs)
    env = WorkerEnv.from_environ(os.environ)
    steps = planned_steps(faults, rank=env.rank, restart_count=env.restart_count)
    scheduler = task.scheduler
    assert scheduler is not None, "the regression task has a scheduler: it counts the steps"

    def before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        step = scheduler.last_epoch + 1
        if step in steps:
            crash(env.rank, step)
        if step_delay:
            time.sleep(step_delay)

    if steps or step_delay:
        task.optimizer.register_step_pre_hook(before_step)
    return task
