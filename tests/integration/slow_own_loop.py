"""examples/own_loop.py with every step slowed down, so a test can kill and add nodes while it trains.

    python tests/integration/slow_own_loop.py SECONDS [own_loop.py's arguments ...]

The delay is a step hook given to the script's ``Checkpointer`` (the public ``hooks`` argument): the
script's code and the numbers it computes are unchanged. With ``HOLD`` set to a path, the hook also waits at
that file gate (``WORLD STEP``, see ``tests/fault_task.py``) after each step.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed

from elastic_train import elastic
from tests.fault_task import held

#: Environment variable naming the file gate the hook waits at.
HOLD = "HOLD"

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_loop.py"


def main() -> None:
    delay = float(sys.argv.pop(1))
    gate = os.environ.get(HOLD, "")

    def slow(step: int) -> None:
        time.sleep(delay)
        while gate and held(gate, world_size=torch.distributed.get_world_size(), step=step + 1):
            time.sleep(0.05)

    class SlowCheckpointer(elastic.Checkpointer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("hooks", [slow])
            super().__init__(*args, **kwargs)

    elastic.Checkpointer = SlowCheckpointer  # type: ignore[misc]  # what `et.Checkpointer` resolves to
    sys.argv[0] = str(EXAMPLE)
    runpy.run_path(str(EXAMPLE), run_name="__main__")


if __name__ == "__main__":
    main()
