"""A worker of the NCCL hot-recovery tests (tests/gpu/test_hot_nccl.py): one process on one GPU, its own
loop on the worker side of hot recovery (:class:`~elastic_train.train.hot.Reformer`), the test playing the
node's agent through the re-formation channel.

Each step all-reduces a one on the device and prints one JSON line: the step, the pid, the world size the
sum says, the round, and where the model's weight lives (device and pointer: a re-formation must keep it).
``--poison STEP`` makes rank 0 fail at that step with a device-side assertion, an error that leaves the CUDA
context unusable.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from elastic_train.train import group
from elastic_train.train.hot import Reformer, group_failure
from elastic_train.train.link import process_link, worker_env


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--poison", type=int, default=-1)
    parser.add_argument(
        "--backend", default="nccl"
    )  # gloo: the same loop on the CPU (a check of the harness)
    args = parser.parse_args()
    env = worker_env()
    reformer = Reformer.of(process_link(), env, args.backend)
    assert reformer is not None, "no re-formation channel"
    world = group.init(args.backend, env=env)
    reformer.register(world)
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256, device=world.device)
    step = 0
    while step < args.steps:
        try:
            if world.rank == 0 and step == args.poison:
                x = torch.zeros(4, device=world.device)
                x[torch.tensor([1 << 20], device=world.device)] = 1.0  # out of bounds: device-side assert
                torch.cuda.synchronize()
            one = torch.ones(1, device=world.device)
            dist.all_reduce(one)
            size = int(one.item())
            w = model.weight.detach()
            line = {"step": step, "pid": os.getpid(), "world": size, "round": world.round,
                    "device": str(w.device), "ptr": w.data_ptr(), "sum": float(w.sum())}  # fmt: skip
            print(json.dumps(line), flush=True)
            step += 1
            time.sleep(0.05)
        except Exception as exc:
            reason = group_failure(exc)
            if reason is None:
                raise
            reformer.reform(reason)
            world = group.current_world()
    group.shutdown()


if __name__ == "__main__":
    main()
