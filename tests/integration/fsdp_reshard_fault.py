"""examples/fsdp_train.py, unchanged, with a worker that dies in the middle of a reshard.

    python tests/integration/fsdp_reshard_fault.py [fsdp_train.py's arguments ...]

With ``RESHARD_FAULT`` set to a world size W, a worker of its agent's first generation exits abruptly
(status 86) as its transfers begin when it is rank 0 of a reshard into a world of W ranks from a world of
another size: the other ranks' transfers fail, its agent starts a new worker, and the job must converge.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path
from typing import Any

from elastic_train.checkpoint.sharded import move

#: Environment variable: the world size whose reshard rank 0 dies in.
RESHARD_FAULT = "RESHARD_FAULT"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fsdp_train.py"


def arm(world_size: int) -> None:
    execute = move.execute

    def dying(plan: Any, me: int, **kwargs: Any) -> Any:
        first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first and me == 0 and plan.new.world_size == world_size != plan.old.world_size:
            sys.stderr.write(f"reshard fault: rank {me} exits in the reshard to world {world_size}\n")
            sys.stderr.flush()
            os._exit(86)
        return execute(plan, me, **kwargs)

    move.execute = dying  # type: ignore[assignment]


if __name__ == "__main__":
    if os.environ.get(RESHARD_FAULT):
        arm(int(os.environ[RESHARD_FAULT]))
    sys.argv[0] = str(EXAMPLE)
    runpy.run_path(str(EXAMPLE), run_name="__main__")
