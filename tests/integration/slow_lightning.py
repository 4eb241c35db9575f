"""examples/lightning_train.py with every step slowed down, so a test can kill and add nodes while it trains.

    python tests/integration/slow_lightning.py SECONDS [lightning_train.py's arguments ...]

The delay is a step hook given to the script's ``ElasticStrategy`` (its public ``hooks`` argument): the
script's code and the numbers it computes are unchanged.
"""

from __future__ import annotations

import runpy
import sys
import time
from pathlib import Path
from typing import Any

from elastic_train import lightning

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lightning_train.py"


def main() -> None:
    delay = float(sys.argv.pop(1))

    class SlowStrategy(lightning.ElasticStrategy):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("hooks", [lambda step: time.sleep(delay)])
            super().__init__(*args, **kwargs)

    lightning.ElasticStrategy = SlowStrategy  # type: ignore[misc]  # what the example imports
    sys.argv[0] = str(EXAMPLE)
    runpy.run_path(str(EXAMPLE), run_name="__main__")


if __name__ == "__main__":
    main()
