"""Overhead of elastic_train's training loop over a plain DDP loop on the same task and world size.

Both loops train the same task (built from the same seed) in the same gloo process group, in interleaved
blocks of steps so that load from other processes on the machine hits both alike. The plain loop is what a
user would write: a fixed shuffled order split over the ranks, ``loss.mean().backward()``,
``optimizer.step()``; its DDP wrapper uses the same settings as ours (no per-forward buffer broadcast), so the
ratio measures the loop, not a DDP option. Ours is :meth:`elastic_train.train.loop.Trainer.train_step`
(global cursor, sample-count weighting, micro-batch accounting, RNG seeding, the loss summed over ranks)
plus the checkpointer call; with ``--with-memory-tier`` the real CheckpointManager builds the state dict and
copies it into shared memory every step.

Prints the median seconds per step of each and the median over adjacent (plain, ours) block pairs of
ours / plain (target <= 1.03).

``--own-loop`` measures the public API (:mod:`elastic_train.elastic`) inside a plain loop instead: the same
DataLoader + DDP loop with and without the API's lines (see :func:`own_loop_main`).

    .venv/bin/python benchmarks/overhead.py --quick --json overhead.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _NoCheckpoint:
    def restore(self, model: Any = None) -> None:
        return None

    def save(self, step: int, state: Any) -> None:
        pass

    def finalize(self, step: int, state: Any) -> None:
        pass

    def close(self) -> None:
        pass


def _worker(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from elastic_train.train import rng
    from elastic_train.train.api import load_task
    from elastic_train.train.config import TrainConfig
    from elastic_train.train.events import EventWriter
    from elastic_train.train.loop import Trainer
    from elastic_train.train.sampler import epoch_permutation, share_bounds

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world)
    world, g = args.world, args.global_batch
    task_args = json.loads(args.task_args)

    # -- plain DDP ------------------------------------------------------------------------------------------
    rng.seed_all(0)
    plain = load_task(args.task, task_args)
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    key = "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
    held = {"plain": DistributedDataParallel(plain.model, **{key: False})}  # cleared before the group goes
    perm = epoch_permutation(0, 0, len(plain.dataset)).tolist()
    cursor = 0

    def plain_step() -> None:
        nonlocal cursor
        if cursor + g > len(perm):
            cursor = 0
        lo, hi = share_bounds(g, world, rank)
        batch = plain.make_batch(perm[cursor + lo : cursor + hi])
        cursor += g
        loss = plain.loss_fn(held["plain"], batch).mean()
        loss.backward()
        plain.optimizer.step()
        plain.optimizer.zero_grad(set_to_none=True)
        if plain.scheduler is not None:
            plain.scheduler.step()

    # -- ours -----------------------------------------------------------------------------------------------
    rng.seed_all(0)
    cfg = TrainConfig(task=args.task, steps=10**9, global_batch=g, micro_batch=0, seed=0)
    checkpointer: Any = _NoCheckpoint()
    if args.with_memory_tier:
        from elastic_train.checkpoint import CheckpointConfig, CheckpointManager

        checkpointer = CheckpointManager(
            CheckpointConfig(url=tempfile.mkdtemp(), every_steps=0, memory_every_steps=1),
            f"overhead-{os.getpid()}",
            rank=rank,
            world_size=world,
            local_rank=rank,
            group=dist.group.WORLD,
        )
    trainer = Trainer(
        cfg,
        load_task(args.task, task_args),
        rank=rank,
        world_size=world,
        round=0,
        device=torch.device("cpu"),
        checkpointer=checkpointer,
        events=EventWriter(None, round=0, world_size=world),
    )
    trainer.wrap()

    def our_step() -> None:
        trainer.train_step()
        checkpointer.save(trainer.step, trainer.state)  # as Trainer.run: the state is built when due

    times: dict[str, list[float]] = {"plain": [], "ours": []}
    for _ in range(args.warmup):
        plain_step()
        our_step()
    for block in range(args.blocks):
        order = [("plain", plain_step), ("ours", our_step)]
        for name, fn in order if block % 2 == 0 else reversed(order):
            dist.barrier()
            t = time.perf_counter()
            for _ in range(args.block_steps):
                fn()
            dist.barrier()
            times[name].append((time.perf_counter() - t) / args.block_steps)
    if args.with_memory_tier:
        checkpointer.close(release_memory=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    held.clear()  # DDP's reducers must go before the process group does
    trainer.unwrap()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="charlm", help="built-in task or module:function (default charlm)")
    p.add_argument("--task-args", default="{}", help="JSON keyword arguments of the task factory")
    p.add_argument("--world", type=int, default=2, help="world size (processes on this machine)")
    p.add_argument("--global-batch", type=int, default=48)
    # The (plain, ours) ratio of one pair of blocks varies by about 15% on a shared 2-core machine (one
    # 10-step block is 0.17 s); 120 pairs of 20 steps put the median within about 1% (30 pairs of 10
    # steps: about 3.5%, as wide as the target's margin).
    p.add_argument("--blocks", type=int, default=120, help="interleaved measurement blocks per loop")
    p.add_argument("--block-steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument(
        "--with-memory-tier", action="store_true", help="also copy state to shared memory per step"
    )
    p.add_argument("--quick", action="store_true", help="fewer blocks (under a minute)")
    p.add_argument("--own-loop", action="store_true", help="the API in a plain loop vs the loop without it")
    p.add_argument("--json", metavar="FILE", help="write the results here")
    args = p.parse_args(argv)
    if args.own_loop:
        return own_loop_main(args)
    if args.quick:
        args.blocks, args.block_steps, args.warmup = 4, 6, 3
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        mp.spawn(_worker, args=(args, _free_port(), out), nprocs=args.world, join=True)
        with open(out) as f:
            times = json.load(f)
    plain, ours = statistics.median(times["plain"]), statistics.median(times["ours"])
    # Each block of ours runs right next to a block of plain (their order alternates), so the ratio of a
    # pair sees the same machine load; the median over pairs is the figure the target is checked on.
    pairs = [o / p for p, o in zip(times["plain"], times["ours"], strict=True)]
    ratio = statistics.median(pairs)
    label = "ours+memory tier" if args.with_memory_tier else "ours"
    blocks = f"{args.blocks}x{args.block_steps}"
    print(f"task={args.task} world={args.world} global_batch={args.global_batch} blocks={blocks}")
    print(f"plain DDP step   : {plain * 1e3:8.2f} ms (median of blocks)")
    print(f"{label:<17}: {ours * 1e3:8.2f} ms")
    print(f"ratio            : {ratio:8.4f}  ({(ratio - 1) * 100:+.2f}% overhead; target <= +3%; median of "
          f"{len(pairs)} paired blocks, ratio of medians {ours / plain:.4f})")  # fmt: skip
    if args.json:
        result = {
            "benchmark": "overhead",
            "task": args.task,
            "world_size": args.world,
            "global_batch": args.global_batch,
            "memory_tier": args.with_memory_tier,
            "plain_step_s": plain,
            "ours_step_s": ours,
            "ratio": ratio,
            "ratio_of_medians": ours / plain,
            "pair_ratios": pairs,
            "target_ratio": 1.03,
            "blocks": times,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


# -- the own-loop API inside a plain loop -------------------------------------------------------------------

#: Blocks x steps of the own-loop comparison (quick: 4 x 6).
OWN_LOOP_BLOCKS, OWN_LOOP_BLOCK_STEPS = 60, 20
#: The loops compared: without the API, with it, with it but no memory snapshots.
OWN_LOOPS = ("plain", "api", "api-no-snapshot")


def _own_loop_worker(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    """Two copies of one plain DataLoader + DDP loop; one with the API's lines added (as in docs/own-loop.md).

    ``plain``: a fixed shuffled order cut into per-rank batches, ``loss.mean().backward()``, step. ``api``:
    :class:`ElasticBatchSampler`, ``loss * sampler.loss_weight()``, :meth:`Checkpointer.commit` after each
    step (state dict + RNG capture + copy into the shared-memory tier every step; durable checkpoints off).
    ``api-no-snapshot``: the same with the memory tier off, which leaves the API's own bookkeeping.
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    import elastic_train as et
    from elastic_train.checkpoint import CheckpointConfig
    from elastic_train.train import rng
    from elastic_train.train.api import load_task
    from elastic_train.train.sampler import epoch_permutation, share_bounds

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world)
    world, g = args.world, args.global_batch
    task_args = json.loads(args.task_args or "{}")

    def plain_batches(n: int) -> list[list[int]]:
        perm = epoch_permutation(0, 0, n).tolist()
        lo, hi = share_bounds(g, world, rank)
        return [perm[c + lo : c + hi] for c in range(0, n - g + 1, g)]

    loops: dict[str, Any] = {}
    for name in OWN_LOOPS:
        rng.seed_all(0)
        task = load_task(args.task, task_args)
        n = len(task.dataset)
        sampler: Any = plain_batches(n) if name == "plain" else et.ElasticBatchSampler(n, g, seed=0)
        loader = DataLoader(range(n), batch_sampler=sampler, collate_fn=task.make_batch)
        ckpt = None
        if name != "plain":
            state = et.TrainState(model=task.model, optimizer=task.optimizer, sampler=sampler)
            every = 1 if name == "api" else 0
            cfg = CheckpointConfig(url=tempfile.mkdtemp(), every_steps=0, memory_every_steps=every)
            ckpt = et.Checkpointer(state, config=cfg, run_id=f"overhead-own-{name}-{port}")
            ckpt.restore()
        loops[name] = {"task": task, "loader": loader, "it": iter(loader), "sampler": sampler, "ckpt": ckpt,
                       "ddp": DistributedDataParallel(task.model)}  # fmt: skip

    def step(name: str) -> None:
        loop = loops[name]
        batch = next(loop["it"], None)
        if batch is None:  # end of the epoch
            loop["it"] = iter(loop["loader"])
            batch = next(loop["it"])
        task = loop["task"]
        loss = task.loss_fn(loop["ddp"], batch).mean()
        if loop["ckpt"] is not None:
            loss = loss * loop["sampler"].loss_weight()
        loss.backward()
        task.optimizer.step()
        task.optimizer.zero_grad(set_to_none=True)
        if loop["ckpt"] is not None:
            loop["ckpt"].commit(loss)

    times: dict[str, list[float]] = {name: [] for name in OWN_LOOPS}
    blocks, block_steps = (4, 6) if args.quick else (OWN_LOOP_BLOCKS, OWN_LOOP_BLOCK_STEPS)
    for _ in range(args.warmup):
        for name in OWN_LOOPS:
            step(name)
    for block in range(blocks):
        for name in OWN_LOOPS[block % 3 :] + OWN_LOOPS[: block % 3]:  # the order rotates
            dist.barrier()
            t = time.perf_counter()
            for _ in range(block_steps):
                step(name)
            dist.barrier()
            times[name].append((time.perf_counter() - t) / block_steps)
    for name in OWN_LOOPS[1:]:
        loops[name]["ckpt"].finalize()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    loops.clear()  # DDP's reducers must go before the process group does
    et.shutdown()


def own_loop_main(args: argparse.Namespace) -> int:
    """Run :func:`_own_loop_worker` on ``args.world`` processes; print (and write) the per-step ratio."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("ELASTIC_TRAIN_LOG_LEVEL", "warning")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        mp.spawn(_own_loop_worker, args=(args, _free_port(), out), nprocs=args.world, join=True)
        with open(out) as f:
            times = json.load(f)
    medians = {name: statistics.median(t) for name, t in times.items()}
    ratios = {
        name: statistics.median(o / p for p, o in zip(times["plain"], times[name], strict=True))
        for name in OWN_LOOPS[1:]
    }
    blocks = len(times["plain"])
    print(f"own loop: task={args.task} world={args.world} global_batch={args.global_batch} blocks={blocks}")
    print(f"plain DataLoader+DDP loop    : {medians['plain'] * 1e3:8.2f} ms per step (median of blocks)")
    for name, label in (("api", "with the API"), ("api-no-snapshot", "with the API, no snapshots")):
        ratio = ratios[name]
        print(f"{label:<29}: {medians[name] * 1e3:8.2f} ms, ratio {ratio:.4f} ({(ratio - 1) * 100:+.2f}%; "
              "target <= +3%; median of paired blocks)")  # fmt: skip
    if args.json:
        result = {"benchmark": "overhead-own-loop", "task": args.task, "world_size": args.world,
                  "global_batch": args.global_batch, "step_s": medians, "ratios": ratios,
                  "target_ratio": 1.03, "blocks": times}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
