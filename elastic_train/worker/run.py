"""One worker's life: task (model, optimizer, data) → process group → restore → DDP → train → last save.

Start-up is timed (``worker_ready`` log event: seconds since exec, torch import, process group, task build,
restore) because it is most of a recovery on small jobs.
"""

from __future__ import annotations

import time
from typing import Any

from elastic_train.config import JobConfig
from elastic_train.log import get_logger
from elastic_train.train.env import WorkerEnv

log = get_logger(__name__)


def _since_exec() -> float:
    """Seconds since this process was created (includes the interpreter's own start-up; for a worker a fork
    server forked, since the fork).

    Read from the kernel's own clock (``/proc/uptime`` less the process's start tick, both since boot, 10 ms
    resolution): psutil's ``create_time`` adds the boot time, which Linux gives in whole seconds, so against
    ``time.time()`` it is up to a second early.
    """
    import os

    from elastic_train.procs import CLOCK_TICKS, start_ticks

    try:
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        ticks = start_ticks(os.getpid())
    except (OSError, ValueError, IndexError):
        ticks = None
    if ticks is not None:
        return max(0.0, uptime - ticks / CLOCK_TICKS)
    import psutil

    return time.time() - psutil.Process().create_time()


def run_worker(cfg: JobConfig, env: WorkerEnv, *, started: float) -> int:
    """Train the job in this process; returns the exit code (0 when training completed)."""
    timings: dict[str, float] = {"since_exec_at_main_s": _since_exec() - (time.perf_counter() - started)}
    t = time.perf_counter()
    import torch.distributed as dist

    from elastic_train import elastic
    from elastic_train.checkpoint import CheckpointManager
    from elastic_train.train import hot, rng
    from elastic_train.train.api import load_task
    from elastic_train.train.checkpointer import close_after
    from elastic_train.train.events import EventWriter
    from elastic_train.train.link import process_link
    from elastic_train.train.loop import Trainer

    timings["import_s"] = time.perf_counter() - t
    if env.local_rank == 0 and env.restart_count == 0:  # fail at start, not at the first save
        from elastic_train.checkpoint.preflight import check_root

        check_root(cfg.checkpoint.url, cfg.checkpoint.storage_options, probe_remote=False)
    # Model, optimizer and data exist before any group does: a worker started on standby (its node joins a
    # running job) is admitted only once they are built, so the job trains on while this one builds.
    t = time.perf_counter()
    rng.seed_all(cfg.train.seed)
    task: Any = load_task(cfg.train.task, cfg.train.task_args)
    sharded_task = None
    if cfg.train.fsdp:  # the model is sharded anew in each group; its initial weights are kept
        from elastic_train.train.fsdp import ShardedTask

        sharded_task = ShardedTask(task.model, task.optimizer, mixed_precision=cfg.train.mixed_precision)
    elif cfg.checkpoint.shard_replicas:
        log.warning("shard_replicas_ignored", reason="train.fsdp is off: every rank holds the whole state")
    timings["task_build_s"] = time.perf_counter() - t
    t = time.perf_counter()

    def train(world: elastic.World) -> int:
        """Everything that depends on the group, (re-)built in each group this process trains in."""
        if "pg_init_s" not in timings:
            timings["pg_init_s"] = time.perf_counter() - t
        run_id = world.run_id if env.run_id else cfg.rendezvous.run_id
        link = process_link().checkpoint_link()
        sharded = None
        manager: Any
        if sharded_task is not None:
            from elastic_train.checkpoint.sharded.manager import ShardedCheckpointManager

            model = sharded_task.build(world.device)
            sharded = (model, sharded_task.initial)
            manager = ShardedCheckpointManager(
                cfg.checkpoint, run_id, rank=world.rank, world_size=world.world_size,
                local_rank=world.local_rank, local_world_size=world.local_world_size, round=world.round,
                model=model, optimizer=task.optimizer, group=dist.group.WORLD, link=link,
            )  # fmt: skip
        else:
            manager = CheckpointManager(
                cfg.checkpoint,
                run_id,
                rank=world.rank,
                world_size=world.world_size,
                local_rank=world.local_rank,
                group=dist.group.WORLD,
                device=world.device,
                link=link,
            )
        events = EventWriter.from_env(rank=world.rank, round=world.round, world_size=world.world_size)
        trainer = Trainer(
            cfg.train,
            task,
            rank=world.rank,
            world_size=world.world_size,
            round=world.round,
            device=world.device,
            checkpointer=manager,
            events=events,
            audit_dir=cfg.train.audit_dir,
            sharded=sharded,
        )
        if sharded is not None:
            manager.current_state = trainer.train_state.state_dict
        try:
            t0 = time.perf_counter()
            trainer.restore()
            timings["restore_s"] = time.perf_counter() - t0
            timings["since_exec_s"] = _since_exec()
            log.info(
                "worker_ready",
                backend=dist.get_backend(),
                device=str(world.device),
                **{k: round(v, 3) for k, v in timings.items()},
            )
            trainer.run()
        except BaseException as exc:
            close_after(manager, exc)
            raise
        finally:
            trainer.unwrap(collect=False)  # the group's shutdown collects (hot.run, elastic.shutdown)
            trainer.sampler.close()
            events.close()
        return 0

    try:
        return hot.run(train, env, cfg.train.backend)
    finally:
        elastic.shutdown()
