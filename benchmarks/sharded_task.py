"""The training script of benchmarks/sharded.py: examples/fsdp_train.py's transformer plus a frozen ballast
that scales the state without scaling the compute, on one of three recovery paths.

    python benchmarks/sharded_task.py --mode fsdp|dcp|ddp --state-mb MB [--steps N] [--save-at S]

- ``fsdp``: sharded with FSDP2 through the elastic_train API (``shard_model``, ``Checkpointer`` with
  ``shard_replicas: 1``): a membership change reshards in-process from the survivors' memory.
- ``dcp``: sharded with FSDP2, torchtitan's way: ``dcp.save`` of ``get_state_dict`` at step ``--save-at``
  into ``--checkpoint``, and every worker that starts ``dcp.load``-s the newest one (run it with
  ``rendezvous.hot=false``: every change restarts every worker).
- ``ddp``: the same model replicated with DDP through the elastic_train API (the memory tier).

The ballast is one parameter of ``--state-mb`` MiB (float32, random, ``requires_grad=False``) in a module
of its own: it is in every state, sharded by FSDP2 like any parameter, but no forward all-gathers it and no
step changes it. Progress events (``$ELASTIC_TRAIN_EVENTS``) come from the ``Checkpointer``, or, on the
``dcp`` path, from this script; a ``bench_dcp_load`` JSON line says how long the load took.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from fsdp_train import Sequences, TinyLM

import elastic_train as et
from elastic_train.checkpoint import CheckpointConfig

#: Float32 columns of the ballast (a row is 4 KiB).
COLUMNS = 1024


class Ballast(torch.nn.Module):
    def __init__(self, mb: float) -> None:
        super().__init__()
        rows = max(1, int(mb * (1 << 20)) // (4 * COLUMNS))
        self.weight = torch.nn.Parameter(torch.empty(rows, COLUMNS), requires_grad=False)


class Bench(torch.nn.Module):
    def __init__(self, mb: float) -> None:
        super().__init__()
        self.lm = TinyLM()
        self.ballast = Ballast(mb)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lm(x, y)
        return out


def shard(model: torch.nn.Module, mesh: object) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in model.lm.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(model.ballast, mesh=mesh)  # never all-gathered: its forward never runs
    fully_shard(model, mesh=mesh)


def fill(model: torch.nn.Module, seed: int = 0) -> None:
    """Initial weights: the transformer seeded, the ballast random (each rank its own rows)."""
    torch.manual_seed(seed)
    full = TinyLM().state_dict()
    with torch.no_grad():
        for name, value in model.lm.state_dict().items():  # type: ignore[union-attr]
            local = value.to_local() if hasattr(value, "to_local") else value
            source = full[name]
            if local.shape != source.shape:
                from elastic_train.checkpoint.sharded.shardmap import fsdp_ranges

                first, rows = fsdp_ranges(source.shape[0], dist.get_world_size())[dist.get_rank()]
                source = source[first : first + rows]
            local.copy_(source)
        ballast = model.ballast.weight
        local = ballast.to_local() if hasattr(ballast, "to_local") else ballast
        local.uniform_(generator=torch.Generator().manual_seed(1 + dist.get_rank()))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("fsdp", "dcp", "ddp"), required=True)
    p.add_argument("--state-mb", type=float, default=100.0)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-at", type=int, default=9, help="dcp: the step whose checkpoint a restart loads")
    p.add_argument("--checkpoint", default="checkpoints")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    et.init()
    dataset = Sequences(4096)
    sampler = et.ElasticBatchSampler(dataset, 16, seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler)
    if args.mode == "dcp":
        et.run(lambda world: titan(args, sampler, loader, world))
    else:
        et.run(lambda world: elastic(args, sampler, loader, world))
    et.shutdown()


def elastic(
    args: argparse.Namespace, sampler: et.ElasticBatchSampler, loader: DataLoader, world: et.World
) -> None:
    if args.mode == "fsdp":
        model = et.shard_model(lambda: Bench(args.state_mb), shard=shard)
        wrapped = model
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = Bench(args.state_mb)
        fill(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    state = et.TrainState(model=model, optimizer=optimizer, sampler=sampler)
    config = CheckpointConfig(url=args.checkpoint, every_steps=0, shard_replicas=1)
    with et.Checkpointer(state, config=config) as ckpt:
        ckpt.restore()
        if args.mode == "fsdp" and ckpt.source is None:
            fill(model)
        if args.mode == "ddp":
            wrapped = DDP(model, init_sync=False)  # every rank holds the same state already
        while ckpt.step < args.steps:
            for x, y in loader:
                (wrapped(x, y) * sampler.loss_weight()).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                ckpt.commit()
                if ckpt.step >= args.steps:
                    break
        ckpt.finalize()


def titan(
    args: argparse.Namespace, sampler: et.ElasticBatchSampler, loader: DataLoader, world: et.World
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from elastic_train.train.events import EventWriter

    events = EventWriter.from_env(rank=world.rank, round=world.round, world_size=world.world_size)
    model = et.shard_model(lambda: Bench(args.state_mb), shard=shard)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    step = 0
    saved = Path(args.checkpoint) / f"step-{args.save_at}"
    if (saved / ".metadata").exists():
        started = time.perf_counter()
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd, "train": {"step": torch.tensor(0), "cursor": torch.tensor(0)}}
        dcp.load(state, checkpoint_id=str(saved))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step, cursor = int(state["train"]["step"]), int(state["train"]["cursor"])
        sampler.load_state_dict({**sampler.state_dict(), "cursor": cursor, "epoch": 0})
        seconds = time.perf_counter() - started
        stamp = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
        record = {"event": "bench_dcp_load", "seconds": round(seconds, 4), "rank": world.rank}
        print(json.dumps({**record, "round": world.round, "timestamp": stamp}), flush=True)
        events.emit("resumed", step, source="durable", from_step=step)
    else:
        fill(model)
        events.emit("started", 0)
    sampler.step = step
    while step < args.steps:
        for x, y in loader:
            (model(x, y) * sampler.loss_weight()).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sampler.advance(sampler.current())
            step += 1
            if step == args.save_at:
                msd, osd = get_state_dict(model, optimizer)
                train = {"step": torch.tensor(step), "cursor": torch.tensor(sampler.cursor)}
                dcp.save({"model": msd, "optim": osd, "train": train}, checkpoint_id=str(saved))
            events.emit("step", step, loss=None, samples_per_s=0.0, epoch=sampler.epoch)
            if step >= args.steps:
                break
    events.emit("done", step)
    events.close()


if __name__ == "__main__":
    if os.environ.get("OMP_NUM_THREADS") is None:
        torch.set_num_threads(1)
    main()
