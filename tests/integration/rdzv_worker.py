"""A tiny gloo DDP worker for rendezvous tests: trains a linear model, appends one JSON line per step.

Env: RDZV_WORKER_OUT (file to append to; global rank 0 writes ``{"round", "world_size", "step", "time",
"rank"}``), RDZV_WORKER_STEPS (default 1000000), RDZV_WORKER_STEP_S (sleep per step, default 0.05),
RDZV_WORKER_CRASH_AT (exit 1 after that many steps; 0: never). Each step is counted for the agent's fence
(the step beat of :mod:`elastic_train.node`), and the round is the one in the agent's assignment.
"""

from __future__ import annotations

import gc
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastic_train.node import Beat, WorkerChannel


def main() -> None:
    channel = WorkerChannel.from_environ(os.environ)
    assignment = channel.assignment() if channel is not None else None  # the round torchrun started it in
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out = os.environ.get("RDZV_WORKER_OUT")
    steps = int(os.environ.get("RDZV_WORKER_STEPS", "1000000"))
    crash_at = int(os.environ.get("RDZV_WORKER_CRASH_AT", "0"))
    pause = float(os.environ.get("RDZV_WORKER_STEP_S", "0.05"))
    rdzv_round = (
        assignment.round if assignment is not None else int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    )
    beat = Beat(channel.directory if channel is not None else None)  # for the agent's fence, as a loop does
    for step in range(steps):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and out:
            line = json.dumps(
                {"round": rdzv_round, "world_size": world, "step": step, "time": time.time(), "rank": rank}
            )
            fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, (line + "\n").encode())
            finally:
                os.close(fd)
        beat.step()
        if step + 1 == crash_at:
            raise SystemExit(f"rdzv_worker: injected crash at step {step}")
        time.sleep(pause)
    del model, opt  # DDP's reducer must go before the process group does
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
