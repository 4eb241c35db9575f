"""What one memory-tier snapshot costs the training thread, with and without the copy off the critical path.

One process, charlm at three sizes, one torch thread: after each optimizer step ``CheckpointManager.save``
snapshots the state into shared memory, once with the optimizer attached (parameters and optimizer state
copied by the background copier, fenced by the next optimizer step) and once without (everything copied
before ``save`` returns). Prints the median CPU time of the calling thread per ``save`` (``thread_time``: it
does not count time spent waiting for a core, so it holds on a busy machine) and the median wall time.

    PYTHONPATH=. .venv/bin/python benchmarks/save_cost.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from typing import Any

SIZES = ({}, {"width": 256, "layers": 4}, {"width": 512, "layers": 4})


def measure(task_args: dict[str, Any], attach: bool, steps: int) -> dict[str, float]:
    import torch

    from elastic_train.checkpoint import CheckpointConfig, CheckpointManager
    from elastic_train.checkpoint.codec import flatten
    from elastic_train.train import rng
    from elastic_train.train.api import load_task

    rng.seed_all(0)
    task = load_task("charlm", task_args)
    model, opt = task.model, task.optimizer
    batch = task.make_batch(list(range(16)))

    def step() -> None:
        task.loss_fn(model, batch).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": rng.capture(), "step": 0}

    step()
    with tempfile.TemporaryDirectory() as url, tempfile.TemporaryDirectory(dir="/dev/shm") as memdir:
        cfg = CheckpointConfig(url=url, every_steps=0, memory_dir=memdir)
        mgr = CheckpointManager(cfg, "save-cost", rank=0, world_size=1, local_rank=0)
        if attach:
            mgr.attach(opt)
        cpu, wall = [], []
        for n in range(1, steps + 1):
            step()
            w, c = time.perf_counter(), time.thread_time()
            mgr.save(n, state)
            cpu.append(time.thread_time() - c)
            wall.append(time.perf_counter() - w)
        mgr.close(release_memory=True)
    del torch
    return {
        "state_mb": flatten(state()).nbytes / 1e6,
        "cpu_ms": statistics.median(cpu[3:]) * 1e3,
        "wall_ms": statistics.median(wall[3:]) * 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    rows = []
    for task_args in SIZES:
        for attach in (False, True):
            r = measure(task_args, attach, args.steps)
            r.update(task_args=json.dumps(task_args), copy="background (attached)" if attach else "in save")
            rows.append(r)
            print(
                f"{r['task_args']:<28} {r['state_mb']:7.1f} MB  copy {r['copy']:<22} "
                f"save(): thread CPU {r['cpu_ms']:6.2f} ms, wall {r['wall_ms']:7.2f} ms",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "save_cost", "figures": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
