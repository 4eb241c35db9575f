"""A tiny replicated training worker used by the checkpoint integration tests (one process per rank).

Environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (gloo on loopback when WORLD_SIZE > 1).
Every rank computes the same deterministic update (the state is replicated like under DDP), saves after
each step, and writes a JSON result line to ``--out``/rank-N.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from elastic_train.checkpoint import CheckpointConfig, CheckpointManager


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    # ~64 kB of model + Adam state: enough pages for every rank of a world of 4 to write a share.
    model = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.Tanh(), torch.nn.Linear(256, 4))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "sampler": {"epoch": 0, "cursor": step * 8, "seed": 0},
        "step": step,
        "extra": {"note": "ckpt-test", 7: (step, "x")},
    }


def param_sum(model: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def reference(steps: int) -> float:
    """The parameter sum after ``steps`` uninterrupted steps."""
    model, opt = build()
    for s in range(1, steps + 1):
        train_step(model, opt, s)
    return param_sum(model)


def _stall_share_writes(step: int) -> None:
    """Make the durable write of ``step`` tear: write half a share, announce it, hang (to be kill -9'd)."""
    from elastic_train.checkpoint import storage

    original = storage.LocalStorage.write_chunks

    def torn(self, path, chunks):  # type: ignore[no-untyped-def]
        if f"step-{step:08d}" not in path:
            return original(self, path, chunks)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # Like the real writer: a claimed (recycled) file is overwritten in place and keeps its size.
        with open(path, "r+b" if os.path.exists(path) else "wb") as f:
            f.write(chunks[0][: max(1, chunks[0].nbytes // 2)])
        print("MIDWRITE", flush=True)
        time.sleep(600)
        raise AssertionError("unreachable")

    storage.LocalStorage.write_chunks = torn  # type: ignore[method-assign]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--run", default="run")
    ap.add_argument("--memdir", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--every", type=int, default=0)
    ap.add_argument("--mem-every", type=int, default=1)
    ap.add_argument("--finish", choices=["finalize", "close", "hang"], default="finalize")
    ap.add_argument("--tear-step", type=int, default=0)
    ap.add_argument("--keep-last", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    group = None
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        group = dist.group.WORLD
    if args.tear_step:
        _stall_share_writes(args.tear_step)
    cfg = CheckpointConfig(
        url=args.url,
        every_steps=args.every,
        memory=args.mem_every > 0,
        memory_every_steps=max(args.mem_every, 1),
        memory_dir=args.memdir,
        keep_last=args.keep_last,
    )
    mgr = CheckpointManager(
        cfg,
        args.run,
        rank=rank,
        world_size=world,
        local_rank=int(os.environ.get("LOCAL_RANK", rank)),
        group=group,
    )
    model, opt = build()
    restored = mgr.restore(model=model.state_dict())
    start = 1
    info = None
    if restored is not None:
        model.load_state_dict(restored.state["model"])
        opt.load_state_dict(restored.state["optimizer"])
        assert restored.state["sampler"]["cursor"] == restored.step * 8
        assert restored.state["extra"][7] == (restored.step, "x")
        start = restored.step + 1
        info = {"step": restored.step, "source": restored.source, "holder": restored.holder_rank}
    for step in range(start, args.steps + 1):
        train_step(model, opt, step)
        mgr.save(step, state_of(model, opt, step))
    result = {"rank": rank, "world": world, "restored": info, "sum": param_sum(model), "step": args.steps}
    if args.finish == "finalize":
        mgr.finalize(args.steps, state_of(model, opt, args.steps))
    elif args.finish == "close":
        mgr.close()
    with open(os.path.join(args.out, f"rank-{rank}.json"), "w") as f:
        json.dump(result, f)
    if args.finish == "hang":
        mgr.wait()
        if mgr.memory is not None:
            mgr.memory.wait_idle()
        print("READY", flush=True)
        time.sleep(600)
    if group is not None:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
