"""The regression task on a simulated accelerator: each rank's step costs device time per sample.

A rank's forward waits ``per_sample_s`` seconds for each sample of its micro-batch, as a step on a GPU of
fixed throughput does, without using the CPU (the 2-core machine runs 3 nodes: compute that contends for
cores would make a smaller world faster per sample and flatter any comparison). The device time advances
only while the process runs, in chunks of at most :data:`CHUNK_S`: a node held stopped (the ``slow-node``
fault, SIGSTOP/SIGCONT) for half the time takes twice as long, as a throttled device would.

    PYTHONPATH=benchmarks elastic-train local --task straggler_task:build --steps 50
"""

from __future__ import annotations

import time
from typing import Any

from elastic_train.train.api import Task
from elastic_train.train.tasks import regression

#: Longest sleep between two looks at the clock; a gap longer than twice this was a stop, not device time.
CHUNK_S = 0.002


def device_time(seconds: float) -> None:
    """Wait ``seconds`` of time during which this process ran."""
    done = 0.0
    last = time.monotonic()
    while done < seconds:
        time.sleep(min(CHUNK_S, seconds - done))
        now = time.monotonic()
        done += min(now - last, 2 * CHUNK_S)
        last = now


def build(*, per_sample_s: float = 0.008, **kwargs: Any) -> Task:
    task = regression.build(**kwargs)
    inner = task.loss_fn

    def on_device(model: Any, batch: Any) -> Any:
        device_time(per_sample_s * len(batch[0]))
        return inner(model, batch)

    task.loss_fn = on_device
    return task
