"""examples/lightning_train.py with every step slowed down, so a test can kill and add nodes while it trains.

    python tests/integration/slow_lightning.py SECONDS[:HOLD_STEP:WORLD] [lightning_train.py's arguments ...]

The delay is a step hook given to the script's ``ElasticStrategy`` (its public ``hooks`` argument): the
script's code and the numbers it computes are unchanged. With ``HOLD_STEP:WORLD``, a group smaller than
``WORLD`` waits at step ``HOLD_STEP`` (before saving it) until it is stopped for a larger one, at most 300 s:
a joining node is in before training ends however slowly it starts on a loaded machine.
"""

from __future__ import annotations

import runpy
import sys
import time
from pathlib import Path
from typing import Any

from elastic_train import lightning

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lightning_train.py"
HOLD_LIMIT_S = 300.0


def main() -> None:
    delay_s, _, hold = sys.argv.pop(1).partition(":")
    delay = float(delay_s)
    hold_step, world = (int(v) for v in hold.split(":")) if hold else (0, 0)

    def slow(step: int) -> None:
        time.sleep(delay)
        if hold and step == hold_step:
            import torch.distributed as dist

            deadline = time.monotonic() + HOLD_LIMIT_S
            while dist.get_world_size() < world and time.monotonic() < deadline:
                time.sleep(0.5)

    class SlowStrategy(lightning.ElasticStrategy):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("hooks", [slow])
            super().__init__(*args, **kwargs)

    lightning.ElasticStrategy = SlowStrategy  # type: ignore[misc]  # what the example imports
    sys.argv[0] = str(EXAMPLE)
    runpy.run_path(str(EXAMPLE), run_name="__main__")


if __name__ == "__main__":
    main()
