"""A training script on a simulated accelerator: each rank's loss costs device time per row of its input.

    python benchmarks/on_device.py SCRIPT PER_ROW_S [the script's arguments ...]

For examples/own_loop.py and examples/lightning_train.py (a loss of ``F.mse_loss``: a row is a sample) and
examples/hf_train.py (a causal LM's loss, ``F.cross_entropy`` over its tokens: a row is a token), in
tests/integration/test_speed_shares.py and ``benchmarks/stragglers.py goodput --hf``.

The wait (``device_time`` of benchmarks/straggler_task.py: it advances only while the process runs, so a
node held stopped by the ``slow-node`` fault is slowed as a throttled device would be) is added where the
script computes its loss (``torch.nn.functional.mse_loss`` / ``cross_entropy``, looked up on the module at
each call, as ``F.mse_loss`` in a script and transformers' ``nn.functional.cross_entropy`` are): the
script's code and the numbers it computes are unchanged.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent


def main() -> None:
    sys.path.insert(0, str(HERE))
    from straggler_task import device_time

    script = sys.argv.pop(1)
    per_row_s = float(sys.argv.pop(1))

    def on_device(loss: Any) -> Any:
        def timed(input: torch.Tensor, target: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            device_time(per_row_s * len(input))
            return loss(input, target, *args, **kwargs)

        return timed

    F.mse_loss = on_device(F.mse_loss)  # what the script's ``F.mse_loss`` resolves to
    F.cross_entropy = on_device(F.cross_entropy)
    sys.argv[0] = script
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
