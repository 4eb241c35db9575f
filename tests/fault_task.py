"""Task module for tests that crash or slow down the built-in worker (``train.task: tests.fault_task:build``).

It is the built-in regression task plus an optimizer step pre-hook that acts right before the optimizer step
of a step:

- ``faults="RANK@STEP[:RESTART][,...]"``: global rank ``RANK`` exits abruptly (``os._exit(FAULT_EXIT_CODE)``,
  no clean-up, like a crash) before the optimizer step of ``STEP``, but only in the worker generation whose
  ``TORCHELASTIC_RESTART_COUNT`` is ``RESTART`` (default 0), so the restarted worker does not die again;
- ``step_delay=SECONDS``: every step sleeps that long, so a test can act on a job while it trains;
- the environment variable :data:`BUILD_DELAY` (seconds): the task's build sleeps that long, as a large
  model's would (a test makes one node's workers slow to build without changing the job's settings);
- the environment variable :data:`BUILD_FAIL` (a message): the task's build raises ``RuntimeError`` with it
  after that sleep, as a script that cannot build on one node would;
- ``hold=PATH``: a gate a test opens and closes while the job runs. While ``PATH`` holds ``WORLD STEP``, a
  worker of a group of ``WORLD`` workers waits before the optimizer step of any step past ``STEP`` until the
  file changes or goes away (or its group is stopped). A test thus keeps a shrunk job from finishing before
  a joiner arrives, however slowly the joiner starts on a loaded machine, without changing what is trained.
  The gate opens when the node's agent announces an in-process re-formation (hot recovery): the step then
  reaches its boundary, where the group re-forms.

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
from elastic_train.train.hot import change_pending
from elastic_train.train.tasks import regression

#: Exit code of a worker killed by a planned fault.
FAULT_EXIT_CODE = 86
#: Environment variable: seconds the task's build sleeps.
BUILD_DELAY = "FAULT_TASK_BUILD_DELAY"
#: Environment variable: the build fails with this message.
BUILD_FAIL = "FAULT_TASK_BUILD_FAIL"


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


def current_rank(env: WorkerEnv) -> int:
    """The rank of the worker in the process group it trains in now (the launch environment's if none: a
    worker started on standby learns its rank only when it is admitted)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else env.rank


def current_world_size(env: WorkerEnv) -> int:
    """The size of the process group the worker trains in now (the launch environment's if none)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else env.world_size


def held(path: str, *, world_size: int, step: int) -> bool:
    """Whether the gate at ``path`` (``WORLD STEP``) holds a ``world_size`` group's worker before ``step``."""
    try:
        with open(path) as f:
            world, limit = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return False  # no gate, or one being written: the next look decides
    return world == world_size and step > limit


def build(*, faults: str = "", step_delay: float = 0.0, hold: str = "", **kwargs: Any) -> Task:
    """The regression task (``kwargs``) whose workers crash at ``faults``, sleep ``step_delay`` a step and
    wait at the gate ``hold``."""
    task = regression.build(**kwargs)
    time.sleep(float(os.environ.get(BUILD_DELAY) or 0))
    if os.environ.get(BUILD_FAIL):
        raise RuntimeError(os.environ[BUILD_FAIL])
    env = WorkerEnv.from_environ(os.environ)
    planned = parse_faults(faults)
    scheduler = task.scheduler
    assert scheduler is not None, "the regression task has a scheduler: it counts the steps"

    def before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        step = scheduler.last_epoch + 1
        if any(f.step == step and f.restart == env.restart_count for f in planned):
            rank = current_rank(env)
            if step in planned_steps(faults, rank=rank, restart_count=env.restart_count):
                crash(rank, step)
        if step_delay:
            time.sleep(step_delay)
        while hold and held(hold, world_size=current_world_size(env), step=step) and not change_pending():
            time.sleep(0.05)

    if planned or step_delay or hold:
        task.optimizer.register_step_pre_hook(before_step)
    return task
