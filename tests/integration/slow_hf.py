"""examples/hf_train.py with every step slowed down, so a test can kill and add nodes while it trains.

    python tests/integration/slow_hf.py SECONDS[:HOLD_STEP:WORLD] [hf_train.py's arguments ...]

The delay is a step hook given to the script's ``ElasticTrainer`` (its public ``hooks`` argument): the
script's code and the numbers it computes are unchanged. With ``HOLD_STEP:WORLD``, a group smaller than
``WORLD`` waits at step ``HOLD_STEP`` (before saving it) until it is stopped for a larger one, at most 300 s:
a joining node is in before training ends however slowly it starts on a loaded machine.

With ``PRELOAD_PROBE`` set to a path, each process appends a line there saying whether it found
transformers' Trainer imported when it started (a fork server preloading ``elastic_train.hf``).
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any

#: Environment variable naming the file each process reports its start to.
PRELOAD_PROBE = "PRELOAD_PROBE"

if os.environ.get(PRELOAD_PROBE):
    with open(os.environ[PRELOAD_PROBE], "a") as probe:
        probe.write(f"{os.getpid()} {'transformers.trainer' in sys.modules}\n")

from elastic_train import hf  # noqa: E402
from elastic_train.train import hot  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_train.py"
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
            while dist.get_world_size() < world and not hot.change_pending() and time.monotonic() < deadline:
                time.sleep(0.1)

    class SlowTrainer(hf.ElasticTrainer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("hooks", [slow])
            super().__init__(*args, **kwargs)

    hf.ElasticTrainer = SlowTrainer  # type: ignore[misc]  # what the example imports
    sys.argv[0] = str(EXAMPLE)
    runpy.run_path(str(EXAMPLE), run_name="__main__")


if __name__ == "__main__":
    main()
