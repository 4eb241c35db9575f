"""One worker's life: process group → task → restore → DDP → train → final checkpoint.

Start-up is timed (``worker_ready`` log event: seconds since exec, torch import, process group, task build,
restore) because it is most of a recovery on small jobs.
"""

from __future__ import annotations

import os
import time
from typing import Any

from elastic_train.config import JobConfig
from elastic_train.log import get_logger
from elastic_train.worker.env import WorkerEnv

log = get_logger(__name__)


def _since_exec() -> float:
    """Seconds since this process was created (includes the interpreter's own start-up)."""
    import psutil

    return time.time() - psutil.Process().create_time()


def resolve_backend(requested: str, cuda: bool) -> str:
    """``auto`` → nccl when CUDA is usable, gloo otherwise."""
    if requested == "auto":
        return "nccl" if cuda else "gloo"
    return requested


def init_process_group(cfg: JobConfig, env: WorkerEnv) -> Any:
    """Form the process group from torchrun's env; returns the device this worker trains on."""
    import torch
    import torch.distributed as dist

    from elastic_train.train.errors import TrainingError

    cuda = torch.cuda.is_available()
    backend = resolve_backend(cfg.train.backend, cuda)
    if backend == "nccl":
        if not cuda:
            raise TrainingError("train.backend: nccl needs CUDA, and no GPU is visible")
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", env.master_addr)
    if env.master_port == 0:
        assert env.world_size == 1, "MASTER_PORT is required for a multi-process group"
        os.environ["MASTER_PORT"] = str(_free_port(env.master_addr))
    kwargs: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
    generation = env.group_generation
    if env.agent_store and generation is not None:
        # torch's dynamic rendezvous hands workers the agent's TCPStore, which outlives worker groups: keys of
        # an earlier group (gloo peer addresses) would be read by the next one; a per-group prefix avoids it.
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False)
        kwargs["store"] = dist.PrefixStore(f"elastic_train/{generation}/", store)
    else:
        kwargs["init_method"] = "env://"
    dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, **kwargs)
    return device


def _free_port(addr: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def run_worker(cfg: JobConfig, env: WorkerEnv, *, started: float) -> int:
    """Train the job in this process; returns the exit code (0 when training completed)."""
    timings: dict[str, float] = {"since_exec_at_main_s": _since_exec() - (time.perf_counter() - started)}
    t = time.perf_counter()
    import torch.distributed as dist

    from elastic_train.checkpoint import CheckpointManager
    from elastic_train.train import rng
    from elastic_train.train.api import load_task
    from elastic_train.train.audit import AuditWriter, write_meta
    from elastic_train.train.events import EventWriter
    from elastic_train.train.loop import Trainer
    from elastic_train.worker.faults import ENV_FAULT, ENV_STEP_DELAY, delay_hook, fault_hook

    timings["import_s"] = time.perf_counter() - t
    if env.local_rank == 0 and env.restart_count == 0:  # fail at start, not at the first save
        from elastic_train.checkpoint.preflight import check_root

        check_root(cfg.checkpoint.url, cfg.checkpoint.storage_options, probe_remote=False)
    t = time.perf_counter()
    device = init_process_group(cfg, env)
    timings["pg_init_s"] = time.perf_counter() - t
    t = time.perf_counter()
    rng.seed_all(cfg.train.seed)
    task = load_task(cfg.train.task, cfg.train.task_args)
    timings["task_build_s"] = time.perf_counter() - t
    run_id = env.run_id or cfg.rendezvous.run_id
    manager = CheckpointManager(
        cfg.checkpoint,
        run_id,
        rank=env.rank,
        world_size=env.world_size,
        local_rank=env.local_rank,
        group=dist.group.WORLD,
        device=device,
    )
    events = EventWriter.from_env(rank=env.rank, round=env.round, world_size=env.world_size)
    audit = None
    if cfg.train.audit_dir:
        audit = AuditWriter(cfg.train.audit_dir, rank=env.rank, world_size=env.world_size, round=env.round)
        if env.rank == 0:
            write_meta(
                cfg.train.audit_dir,
                dataset_len=len(task.dataset),
                global_batch=cfg.train.global_batch,
                seed=cfg.train.seed,
            )
    hooks = [
        hook
        for hook in (
            fault_hook(os.environ.get(ENV_FAULT), rank=env.rank, restart_count=env.restart_count),
            delay_hook(os.environ.get(ENV_STEP_DELAY)),
        )
        if hook is not None
    ]
    trainer = Trainer(
        cfg.train,
        task,
        rank=env.rank,
        world_size=env.world_size,
        round=env.round,
        device=device,
        checkpointer=manager,
        events=events,
        audit=audit,
        hooks=hooks,
    )
    try:
        t = time.perf_counter()
        trainer.restore()
        timings["restore_s"] = time.perf_counter() - t
        timings["since_exec_s"] = _since_exec()
        log.info(
            "worker_ready",
            backend=dist.get_backend(),
            device=str(device),
            **{k: round(v, 3) for k, v in timings.items()},
        )
        trainer.run()
    except BaseException:
        manager.close()
        raise
    finally:
        trainer.unwrap()
        events.close()
        if audit is not None:
            audit.close()
        dist.destroy_process_group()
    return 0
