"""The charlm task plus a frozen "ballast" parameter: a state of any size at the charlm step cost.

The ballast (``ballast_mb`` MiB of float32, ``requires_grad=False``) is in the model's state dict — so the
memory tier snapshots it every step, a restore broadcasts it and a checkpoint writes it — but it takes part
in no forward, backward or optimizer step: recovery benchmarks can scale the state to gigabytes without
scaling the training compute.

    PYTHONPATH=benchmarks elastic-train local --task recovery_task:build --set train.task_args.ballast_mb=100
"""

from __future__ import annotations

import torch

from elastic_train.train.api import Task
from elastic_train.train.tasks import charlm


def build(*, ballast_mb: float = 0.0, **charlm_args: object) -> Task:
    task = charlm.build(**charlm_args)  # type: ignore[arg-type]
    n = int(ballast_mb * (1 << 20)) // 4
    # Random, not zeros: a restore must move real bytes (no page of zeros shared by the kernel).
    ballast = torch.nn.Parameter(torch.rand(n), requires_grad=False)
    task.model.register_parameter("ballast", ballast)
    return task
