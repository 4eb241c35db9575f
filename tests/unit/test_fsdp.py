"""FSDP2 helpers of the own-loop API (world of one, in this process) and the shardings the sharded tiers
refuse with one line."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from elastic_train.checkpoint.sharded.local import UnsupportedSharding, split
from elastic_train.train.fsdp import blocks, device_mesh, load_full, shard_model


@pytest.fixture
def world_one() -> Iterator[None]:
    from elastic_train.net import free_port

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)])
        self.head = torch.nn.Linear(2, 1)
        self.register_buffer("scale", torch.ones(2))


def test_blocks_are_the_module_lists_entries() -> None:
    net = Net()
    assert blocks(net) == list(net.layers)


def test_a_meta_skeleton_sharded_then_loaded_equals_the_full_model(world_one: None) -> None:
    torch.manual_seed(3)
    full = Net().state_dict()
    model = shard_model(Net, mesh=device_mesh())
    assert all(isinstance(p, DTensor) and p.device.type == "cpu" for p in model.parameters())
    load_full(model, full)
    for name, value in model.state_dict().items():
        got = value.full_tensor() if isinstance(value, DTensor) else value
        assert torch.equal(got, full[name]), name


def test_split_keeps_the_local_shards_and_their_map(world_one: None) -> None:
    mesh = device_mesh()
    state = {"model": {"w": distribute_tensor(torch.ones(5, 2), mesh, [Shard(0)])}, "step": 3}
    local, smap = split(state, rank=0, world_size=1)
    assert not isinstance(local["model"]["w"], DTensor) and local["step"] == 3
    assert smap.tensors["/model/w"].shape == (5, 2) and smap.tensors["/model/w"].ranges == ((0, 5),)
    replicated = {"b": distribute_tensor(torch.ones(2), mesh, [Replicate()])}
    local, smap = split(replicated, rank=0, world_size=1)
    assert torch.equal(local["b"], torch.ones(2)) and not smap.tensors


def test_a_sharding_the_tiers_cannot_keep_is_one_line(world_one: None) -> None:
    mesh = device_mesh()
    by_columns = {"model": {"w": distribute_tensor(torch.ones(2, 6), mesh, [Shard(1)])}}
    with pytest.raises(UnsupportedSharding, match=r"state at /model/w: placement \(Shard\(dim=1\),\) is not"):
        split(by_columns, rank=0, world_size=1)
    with pytest.raises(UnsupportedSharding, match="not every rank of the world of 2 in order"):
        split(by_columns, rank=0, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh

    hybrid = distribute_tensor(torch.ones(2, 2), init_device_mesh("cpu", (1, 1)), [Replicate(), Shard(0)])
    with pytest.raises(UnsupportedSharding, match="a 2-D device mesh .hybrid sharding. is not supported"):
        split({"w": hybrid}, rank=0, world_size=1)


def _trainer(tmp: Path, *, fsdp: bool, steps: int, mixed_precision: str = "none") -> Any:
    from elastic_train.checkpoint import CheckpointConfig, CheckpointManager
    from elastic_train.checkpoint.sharded.manager import ShardedCheckpointManager
    from elastic_train.train import rng
    from elastic_train.train.api import load_task
    from elastic_train.train.config import TrainConfig
    from elastic_train.train.events import EventWriter
    from elastic_train.train.fsdp import ShardedTask
    from elastic_train.train.loop import Trainer

    rng.seed_all(3)
    task = load_task("regression", {"n_samples": 64})
    cfg = CheckpointConfig(url=str(tmp / "ck"), memory=False, every_steps=0)
    sharded = None
    if fsdp:
        parts = ShardedTask(task.model, task.optimizer, mixed_precision=mixed_precision)
        model = parts.build(torch.device("cpu"))
        sharded = (model, parts.initial)
        manager: Any = ShardedCheckpointManager(
            cfg, "r", rank=0, world_size=1, local_rank=0, model=model, optimizer=task.optimizer
        )
    else:
        manager = CheckpointManager(cfg, "r", rank=0, world_size=1, local_rank=0)
    trainer = Trainer(
        TrainConfig(
            task="regression", steps=steps, global_batch=10, micro_batch=4, seed=3, fsdp=fsdp,
            mixed_precision=mixed_precision,
        ),
        task, rank=0,
        world_size=1, round=0, device=torch.device("cpu"), checkpointer=manager,
        events=EventWriter(None, round=0, world_size=1), sharded=sharded,
    )  # fmt: skip
    trainer.restore()
    return trainer


def test_the_builtin_loop_trains_a_sharded_task_as_ddp_does(world_one: None, tmp_path: Path) -> None:
    """train.fsdp at world one: the same weights as the replicated loop, micro-batches accumulated without
    a reduce in between, the task's optimizer stepping the shards."""
    ddp = _trainer(tmp_path / "ddp", fsdp=False, steps=6)
    ddp.run()
    sharded = _trainer(tmp_path / "fsdp", fsdp=True, steps=6)
    assert isinstance(next(sharded.model.parameters()), DTensor)
    sharded.run()
    for name, value in ddp.model.state_dict().items():
        got = sharded.model.state_dict()[name]
        assert torch.equal(got.full_tensor() if isinstance(got, DTensor) else got, value), name
    resumed = _trainer(tmp_path / "fsdp", fsdp=True, steps=6)  # its final checkpoint: a DCP directory
    assert resumed.step == 6 and resumed.ckpt.source == "durable"


def test_the_builtin_loop_computes_a_sharded_task_in_bfloat16(world_one: None, tmp_path: Path) -> None:
    """train.mixed_precision: bfloat16: forward in bfloat16, while the shards, the optimizer state and the
    durable checkpoint keep the parameters' own dtype (float64 here); a resume reads them back."""
    plain = _trainer(tmp_path / "plain", fsdp=True, steps=6)
    plain.run()
    mixed = _trainer(tmp_path / "mixed", fsdp=True, steps=6, mixed_precision="bfloat16")
    seen: list[torch.dtype] = []
    first = next(m for m in mixed.model.modules() if isinstance(m, torch.nn.Linear))
    first.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    mixed.run()
    assert seen and set(seen) == {torch.bfloat16}
    state = mixed.model.state_dict()
    for name, value in plain.model.state_dict().items():
        got, want = state[name].full_tensor(), value.full_tensor()
        assert got.dtype == torch.float64 and not torch.equal(got, want), name
        torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)  # the same training, rounded
    moments = [v for st in mixed.task.optimizer.state.values() for v in st.values() if isinstance(v, DTensor)]
    assert moments and all(m.dtype == torch.float64 for m in moments)
    resumed = _trainer(tmp_path / "mixed", fsdp=True, steps=6, mixed_precision="bfloat16")
    assert resumed.step == 6 and resumed.ckpt.source == "durable"
    for name, value in resumed.model.state_dict().items():
        assert torch.equal(value.full_tensor(), state[name].full_tensor()), name
