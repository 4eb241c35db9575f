"""Tiny gloo DDP worker that the benchmark harness runs under torchrun.

It forms the process group from torchrun's environment, then does small DDP steps at a fixed cadence and
appends one JSON line per event to its own file in ``$BENCH_PROGRESS_DIR`` (one file per process, one
``os.write`` per line, so readers never see a torn line)::

    {"event": "start"|"imported"|"pg"|"step", "time": unix_s, "step": int, "world_size": int, "rank": int,
     "node": str, "round": int, "pid": int}

``start`` marks the process start, ``imported`` the end of importing torch, ``pg`` that the process group
and DDP model exist, ``step`` the end of every optimizer step (the all-reduce inside ``backward`` has
completed, so every rank of the group is past it).
Rank 0 keeps the last step number in ``$BENCH_STATE_FILE`` so a restarted group continues the numbering.

Environment:
    BENCH_PROGRESS_DIR: directory for the progress files (required).
    BENCH_STEP_INTERVAL: seconds between step starts (default 0.1).
    BENCH_NODE: node label the harness gave this agent (default: the agent's ``GROUP_RANK``).
    BENCH_STATE_FILE: tiny file holding the last step (optional).
    BENCH_MAX_STEPS: exit 0 after this many steps of this group (default: run until killed).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

ENV_PROGRESS_DIR = "BENCH_PROGRESS_DIR"
ENV_STEP_INTERVAL = "BENCH_STEP_INTERVAL"
ENV_NODE = "BENCH_NODE"
ENV_STATE_FILE = "BENCH_STATE_FILE"
ENV_MAX_STEPS = "BENCH_MAX_STEPS"


class Progress:
    """Appends JSON lines to this process's own progress file."""

    def __init__(self, directory: str, node: str, rank: int, world_size: int, round_: int) -> None:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"node{node}-pid{os.getpid()}.jsonl")
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._base = {
            "node": node,
            "rank": rank,
            "world_size": world_size,
            "round": round_,
            "pid": os.getpid(),
        }

    def emit(self, event: str, step: int, at: float | None = None) -> None:
        record = {"event": event, "time": time.time() if at is None else at, "step": step, **self._base}
        os.write(self._fd, (json.dumps(record) + "\n").encode())


def _read_step(path: str | None) -> int:
    if not path:
        return 0
    try:
        with open(path, encoding="utf-8") as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def _write_step(path: str | None, step: int) -> None:
    if not path:
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(str(step))
    os.replace(tmp, path)


def main() -> int:
    started = time.time()
    import torch  # the import is a large part of a worker restart: "imported" marks its end
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    directory = os.environ[ENV_PROGRESS_DIR]
    interval = float(os.environ.get(ENV_STEP_INTERVAL, "0.1"))
    state_file = os.environ.get(ENV_STATE_FILE)
    max_steps = int(os.environ.get(ENV_MAX_STEPS, "0"))
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    node = os.environ.get(ENV_NODE, os.environ.get("GROUP_RANK", "?"))
    from elastic_train.node import WorkerChannel

    channel = WorkerChannel.from_environ(os.environ)
    assignment = channel.assignment() if channel is not None else None
    round_ = (
        assignment.round if assignment is not None else int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    )

    progress = Progress(directory, node, rank, world_size, round_)
    progress.emit("start", 0, at=started)
    progress.emit("imported", 0)

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(16, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = _read_step(state_file)
    progress.emit("pg", step)

    done = 0
    next_at = time.monotonic()
    while not max_steps or done < max_steps:
        x = torch.randn(8, 16)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        done += 1
        progress.emit("step", step)
        if rank == 0:
            _write_step(state_file, step)
        next_at += interval
        delay = next_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        else:
            next_at = time.monotonic()
    del model, opt  # DDP's reducer must go before the process group does
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
