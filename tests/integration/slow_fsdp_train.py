"""examples/fsdp_train.py with every step slowed down (the hook and gate of slow_own_loop.py), so a test can
kill and add nodes while it trains, and optionally with a worker dying in the middle of a reshard.

    python tests/integration/slow_fsdp_train.py SECONDS [fsdp_train.py's arguments ...]

With ``RESHARD_FAULT`` set to a world size W, the first worker process to reshard the state into a world of
W ranks from a world of another size exits abruptly (status 86) as its transfers begin, in the worker
generation its agent started first: the other ranks' transfers fail, and the job must converge anyway.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from elastic_train.checkpoint.sharded import move
from tests.integration import slow_own_loop

#: Environment variable: the world size whose first reshard a worker dies in.
RESHARD_FAULT = "RESHARD_FAULT"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fsdp_train.py"


def arm_reshard_fault(world_size: int) -> None:
    execute = move.execute

    def dying(plan: Any, me: int, **kwargs: Any) -> Any:
        first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first and plan.new.world_size == world_size and plan.old.world_size != world_size and me == 0:
            sys.stderr.write(f"reshard fault: rank {me} exits in the reshard to world {world_size}\n")
            sys.stderr.flush()
            os._exit(86)
        return execute(plan, me, **kwargs)

    move.execute = dying  # type: ignore[assignment]


def main() -> None:
    fault = os.environ.get(RESHARD_FAULT)
    if fault:
        arm_reshard_fault(int(fault))
    slow_own_loop.EXAMPLE = EXAMPLE
    slow_own_loop.main()


if __name__ == "__main__":
    main()
