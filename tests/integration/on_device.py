"""A training script on a simulated accelerator: each rank's loss costs device time per sample.

    python tests/integration/on_device.py SCRIPT PER_SAMPLE_S [the script's arguments ...]

For examples/own_loop.py and examples/lightning_train.py (any script whose loss is ``F.mse_loss``).

The wait (``device_time`` of benchmarks/straggler_task.py: it advances only while the process runs, so a
node held stopped by the ``slow-node`` fault is slowed as a throttled device would be) is added where the
script computes its loss (``torch.nn.functional.mse_loss``, which it calls as ``F.mse_loss``): the script's
code and the numbers it computes are unchanged.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from straggler_task import device_time

    script = sys.argv.pop(1)
    per_sample_s = float(sys.argv.pop(1))
    mse = F.mse_loss

    def on_device(input: torch.Tensor, target: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        device_time(per_sample_s * len(input))
        return mse(input, target, *args, **kwargs)

    F.mse_loss = on_device  # what the script's ``F.mse_loss`` resolves to
    sys.argv[0] = script
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
