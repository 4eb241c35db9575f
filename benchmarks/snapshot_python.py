"""The Python of a memory snapshot on the training thread, per step: what benchmarks/overhead.py reports as
"snapshot Python", measured alone and split in two.

One process, world 1 (gloo), the overhead benchmark's all-in loop and model (``Trainer.train_step``, then
``Checkpointer.save`` into the memory tier every step). Per save it records, as overhead.py does, the CPU time
of the training thread inside ``CheckpointManager.save`` other than the tensor copies and the copier's wake
(``SaveStats``; the wake is printed beside it), and the part of it spent in
``TrainState.snapshot(verify=False)`` (RNG reads, the parts' checks, the plan's walk). Prints the medians
over the saves. The caches are as cold as in training: each save follows a real step.

``--against TREE`` compares two source trees under the same load: rounds of two processes, this tree's
``elastic_train`` and ``TREE``'s, in an order that alternates, and prints the median of the per-round ratios.

    PYTHONPATH=. .venv/bin/python benchmarks/snapshot_python.py --config 17ms --steps 300
    PYTHONPATH=. .venv/bin/python benchmarks/snapshot_python.py --against /path/to/other/checkout --rounds 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

#: The target overhead.py checks the figure against (seconds per save).
TARGET_S = 0.2e-3

CONFIGS: dict[str, dict[str, Any]] = {"17ms": {}, "200ms": {"width": 256, "layers": 4}}


def one_rank_trainer(config: str, name: str) -> tuple[Any, Any]:
    """A wrapped built-in Trainer of one rank (gloo, CPU, one thread) on a ``config`` of :data:`CONFIGS` and
    its checkpoint manager, the memory snapshot taken every step under run id ``name``-PID."""
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


def measure(config: str, steps: int, warmup: int = 10) -> dict[str, float]:
    """Median CPU seconds per save: the save's Python (no copies) and the snapshot's part of it."""
    import torch.distributed as dist

    trainer, manager = one_rank_trainer(config, "snapshot-python")
    snapshot_cpu: list[float] = []
    unverified = trainer.ckpt._unverified_snapshot

    def timed_snapshot() -> Any:
        c = time.thread_time()
        try:
            return unverified()
        finally:
            snapshot_cpu.append(time.thread_time() - c)

    trainer.ckpt._unverified_snapshot = timed_snapshot  # type: ignore[assignment]

    def step() -> None:
        result = trainer.train_step()
        trainer.ckpt.save(loss=result.loss, samples=result.samples, epoch=result.epoch)

    try:
        for _ in range(warmup):
            step()
        assert manager.memory is not None
        stats = manager.memory.stats
        stats.record = True
        snapshot_cpu.clear()
        for _ in range(steps):
            step()
        return {
            "python_s": statistics.median(stats.python_cpu_s),
            "python_wall_s": statistics.median(stats.python_wall_s),
            "wake_s": statistics.median(stats.wake_cpu_s),
            "snapshot_s": statistics.median(snapshot_cpu),
            "saves": len(stats.python_cpu_s),
        }
    finally:
        manager.close(release_memory=True)
        trainer.unwrap()
        dist.destroy_process_group()


def _child(tree: str, args: argparse.Namespace) -> dict[str, float]:
    """Run :func:`measure` in a process that imports ``elastic_train`` from ``tree``."""
    env = {**os.environ, "PYTHONPATH": tree, "ELASTIC_TRAIN_LOG_LEVEL": "warning"}
    cmd = [sys.executable, __file__, "--config", args.config, "--steps", str(args.steps), "--json-line"]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=600).stdout
    result: dict[str, float] = json.loads(out.strip().splitlines()[-1])
    return result


def compare(args: argparse.Namespace) -> None:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"this": here, "against": os.path.abspath(args.against)}
    got: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for r in range(args.rounds):
        for name in list(trees) if r % 2 == 0 else list(trees)[::-1]:
            got[name].append(_child(trees[name], args))
    for name, tree in trees.items():
        py = statistics.median(g["python_s"] for g in got[name])
        snap = statistics.median(g["snapshot_s"] for g in got[name])
        print(
            f"[{args.config}] {name:8s} {tree}: snapshot Python {py * 1e3:.3f} ms CPU per save "
            f"(TrainState.snapshot {snap * 1e3:.3f} ms); median of {args.rounds} runs x {args.steps} saves"
        )
    ratios = [a["python_s"] / b["python_s"] for a, b in zip(got["this"], got["against"], strict=True)]
    print(
        f"[{args.config}] paired ratio this/against: {statistics.median(ratios):.3f} ({len(ratios)} rounds)"
    )
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="17ms")
    p.add_argument("--steps", type=int, default=300, help="measured saves (after 10 warm-up steps)")
    p.add_argument("--against", metavar="TREE", help="another checkout to compare with, paired")
    p.add_argument("--rounds", type=int, default=6, help="with --against: process pairs")
    p.add_argument("--json-line", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.against:
        compare(args)
        return
    got = measure(args.config, args.steps)
    if args.json_line:
        print(json.dumps(got))
        return
    print(
        f"[{args.config}] snapshot Python: {got['python_s'] * 1e3:.3f} ms CPU per save on the training "
        f"thread, no copies ({got['python_wall_s'] * 1e3:.3f} ms wall; median of {got['saves']} saves; "
        f"target <= {TARGET_S * 1e3:.1f} ms), of which TrainState.snapshot: "
        f"{got['snapshot_s'] * 1e3:.3f} ms; besides, waking the copier thread: "
        f"{got['wake_s'] * 1e3:.3f} ms CPU"
    )
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
