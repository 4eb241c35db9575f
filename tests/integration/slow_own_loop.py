"""examples/own_loop.py with every step slowed down, so a test can kill and add nodes while it trains.

    python tests/integration/slow_own_loop.py SECONDS [own_loop.py's arguments ...]

The delay is a step hook given to the script's ``Checkpointer`` (the public ``hooks`` argument): the
script's code and the numbers it computes are unchanged. With ``HOLD`` set to a path, the hook also waits at
that file gate (``WORLD STEP``, see ``tests/fault_task.py``, which opens when the group re-forms in-process)
after each step. With ``SLOW_BUILD`` set to
seconds, the script sleeps that long before it calls ``et.run`` (after it built model, optimizer and data),
as a script with a large model would build it. With ``LINGER`` set to seconds, each rank appends its rank to
the file ``LINGER_MARK`` names once its ``finalize()`` returned, then waits that long before it exits (a
script that tears down slowly).
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
from elastic_train.train.hot import change_pending
from tests.fault_task import held

#: Environment variable naming the file gate the hook waits at.
HOLD = "HOLD"
#: Environment variable: seconds the script's build takes longer.
SLOW_BUILD = "SLOW_BUILD"
#: Environment variables: seconds a rank waits after its final checkpoint, and the file it marks then.
LINGER, LINGER_MARK = "LINGER", "LINGER_MARK"

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_loop.py"


def main() -> None:
    delay = float(sys.argv.pop(1))
    gate = os.environ.get(HOLD, "")

    def slow(step: int) -> None:
        time.sleep(delay)
        world_size = torch.distributed.get_world_size()
        while gate and held(gate, world_size=world_size, step=step + 1) and not change_pending():
            time.sleep(0.05)  # open when the group re-forms in-process (it does so at this step's end)

    linger = float(os.environ.get(LINGER) or 0)

    class SlowCheckpointer(elastic.Checkpointer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("hooks", [slow])
            super().__init__(*args, **kwargs)

        def finalize(self) -> Any:
            committed = super().finalize()
            if linger > 0:
                with open(os.environ[LINGER_MARK], "a") as f:
                    f.write(f"{torch.distributed.get_rank()}\n")
                time.sleep(linger)
            return committed

    elastic.Checkpointer = SlowCheckpointer  # type: ignore[misc]  # what `et.Checkpointer` resolves to
    build_delay = float(os.environ.get(SLOW_BUILD) or 0)
    run = elastic.run

    def slow_run(*args: Any, **kwargs: Any) -> Any:
        time.sleep(build_delay)
        return run(*args, **kwargs)

    elastic.run = slow_run  # type: ignore[assignment]  # what `et.run` resolves to
    sys.argv[0] = str(EXAMPLE)
    runpy.run_path(str(EXAMPLE), run_name="__main__")


if __name__ == "__main__":
    main()
