"""Where a planned snapshot's structure check runs, paired: the training thread's Python per save with the
full check in the loop against the cheap check (the full one on the memory tier's copier).

One process, world 1 (gloo), the overhead benchmark's all-in loop (``Trainer.train_step`` then
``Checkpointer.save`` into the memory tier every step). Blocks alternate between ``snapshot()`` (every model
and optimizer tensor checked on the training thread) and ``snapshot(verify=False)`` (what the built-in loop
uses), their order swapped at each block so that load from other processes hits both alike. Prints, per
mode, the median over blocks of each block's median CPU time of the training thread in ``save`` other than
the copies (``SaveStats``, as benchmarks/overhead.py reports it) and the median paired ratio.

    PYTHONPATH=. .venv/bin/python benchmarks/snapshot_checks.py --config 17ms --blocks 8 --steps 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from functools import partial
from typing import Any

CONFIGS: dict[str, dict[str, Any]] = {"17ms": {}, "200ms": {"width": 256, "layers": 4}}


def one_rank_trainer(config: str, name: str) -> tuple[Any, Any]:
    """A wrapped built-in Trainer of one rank (gloo, CPU, one thread) on a ``config`` of :data:`CONFIGS` and
    its checkpoint manager, the memory snapshot taken every step under run id ``name``-PID (what both
    snapshot benchmarks time)."""
    import torch
    import torch.distributed as dist

    from elastic_train.checkpoint import CheckpointConfig, CheckpointManager
    from elastic_train.net import free_port
    from elastic_train.train import rng
    from elastic_train.train.api import load_task
    from elastic_train.train.config import TrainConfig
    from elastic_train.train.events import EventWriter
    from elastic_train.train.loop import Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    manager = CheckpointManager(
        CheckpointConfig(url=tempfile.mkdtemp(), every_steps=0, memory_every_steps=1),
        f"{name}-{os.getpid()}",
        rank=0,
        world_size=1,
        local_rank=0,
        group=dist.group.WORLD,
    )
    rng.seed_all(0)
    trainer = Trainer(
        TrainConfig(task="charlm", steps=10**9, global_batch=48, micro_batch=0, seed=0),
        load_task("charlm", CONFIGS[config]),
        rank=0,
        world_size=1,
        round=0,
        device=torch.device("cpu"),
        checkpointer=manager,
        events=EventWriter(None, round=0, world_size=1),
    )
    trainer.wrap()
    return trainer, manager


def measure(config: str, blocks: int, steps: int) -> dict[str, list[float]]:
    """Per mode, the median Python seconds per save of each block."""
    import torch.distributed as dist

    trainer, manager = one_rank_trainer(config, "snapshot-checks")

    def step() -> None:
        result = trainer.train_step()
        trainer.ckpt.save(loss=result.loss, samples=result.samples, epoch=result.epoch)

    try:
        for _ in range(5):
            step()
        assert manager.memory is not None
        stats = manager.memory.stats
        stats.record = True
        state = trainer.train_state
        modes = {"full": state.snapshot, "cheap": partial(state.snapshot, verify=False)}
        got: dict[str, list[float]] = {name: [] for name in modes}
        for block in range(blocks):
            for name in list(modes) if block % 2 == 0 else list(modes)[::-1]:
                trainer.ckpt._unverified_snapshot = modes[name]
                stats.python_cpu_s.clear()
                stats.python_wall_s.clear()
                for _ in range(steps):
                    step()
                got[name].append(statistics.median(stats.python_cpu_s))
        return got
    finally:
        manager.close(release_memory=True)
        trainer.unwrap()
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="17ms")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="steps per block")
    args = p.parse_args()
    got = measure(args.config, args.blocks, args.steps)
    for name, label in (("full", "full check in the loop"), ("cheap", "cheap check, full on the copier")):
        print(f"[{args.config}] {label:32s}: {statistics.median(got[name]) * 1e3:.3f} ms CPU per save")
    ratios = [c / f for f, c in zip(got["full"], got["cheap"], strict=True)]
    print(f"[{args.config}] paired ratio cheap/full: {statistics.median(ratios):.3f} ({len(ratios)} blocks)")
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
