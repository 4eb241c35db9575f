"""Test-only fault injection: a worker kills itself at a given (rank, step).

``ELASTIC_TRAIN_TEST_FAULT="RANK@STEP[:RESTART][,...]"`` makes global rank ``RANK`` exit abruptly
(``os._exit(FAULT_EXIT_CODE)``, no clean-up, like a crash) right before the optimizer step of ``STEP``,
but only in the worker generation whose ``TORCHELASTIC_RESTART_COUNT`` is ``RESTART`` (default 0), so
the restarted worker does not die again. ``ELASTIC_TRAIN_TEST_STEP_DELAY=SECONDS`` slows every step down so a
test can act on a job while it trains.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from elastic_train.errors import ConfigError

#: Environment variable holding the planned faults.
ENV_FAULT = "ELASTIC_TRAIN_TEST_FAULT"
#: Environment variable: seconds every step sleeps (tests that kill or add nodes mid-training).
ENV_STEP_DELAY = "ELASTIC_TRAIN_TEST_STEP_DELAY"
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
        ConfigError: an item is malformed.
    """
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            rank, _, rest = item.partition("@")
            step, _, restart = rest.partition(":")
            faults.append(PlannedFault(int(rank), int(step), int(restart) if restart else 0))
        except ValueError as exc:
            raise ConfigError(f"{ENV_FAULT}: {item!r} is not RANK@STEP[:RESTART]") from exc
    return faults


def fault_hook(text: str | None, *, rank: int, restart_count: int) -> Callable[[int], None] | None:
    """A step hook that exits at the planned steps of this rank and restart, or ``None`` if none apply."""
    steps = {f.step for f in parse_faults(text or "") if f.rank == rank and f.restart == restart_count}
    if not steps:
        return None

    def hook(step: int) -> None:
        if step in steps:
            sys.stderr.write(f"elastic_train.worker: planned fault: rank {rank} exits at step {step}\n")
            sys.stderr.flush()
            os._exit(FAULT_EXIT_CODE)

    return hook


def delay_hook(text: str | None) -> Callable[[int], None] | None:
    """A step hook that sleeps ``float(text)`` seconds, or ``None`` when unset.

    Raises:
        ConfigError: the value is not a number.
    """
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError as exc:
        raise ConfigError(f"{ENV_STEP_DELAY}={text!r}: expected seconds") from exc
    return lambda step: time.sleep(seconds)
