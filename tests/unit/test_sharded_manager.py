"""The sharded checkpoint manager in a world of one (gloo, in this process): the memory tier's slots, the
DCP durable tier, a torn slot, another model, a foreign DCP checkpoint; multi-rank resharding is in
tests/integration/test_fsdp_train.py."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from elastic_train.checkpoint import CheckpointConfig, ModelMismatch
from elastic_train.checkpoint.sharded.manager import ShardedCheckpointManager
from elastic_train.train.fsdp import device_mesh, load_full, shard_model
from elastic_train.train.group import World
from elastic_train.train.sampler import ElasticBatchSampler
from elastic_train.train.state import TrainState


@pytest.fixture
def world_one() -> Iterator[World]:
    from elastic_train.net import free_port

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield World(
        rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"), backend="gloo",
        round=1, run_id="r", restart_count=0,
    )  # fmt: skip
    dist.destroy_process_group()


class Net(torch.nn.Module):
    def __init__(self, out: int = 3) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 5), torch.nn.Linear(5, out)])
        self.register_buffer("scale", torch.tensor([2.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x * self.scale


def job(
    world: World, tmp: Path, *, out: int = 3, **cfg: object
) -> tuple[TrainState, ShardedCheckpointManager]:
    torch.manual_seed(0)
    full = Net(out).state_dict()
    model = shard_model(lambda: Net(out), mesh=device_mesh())
    load_full(model, full)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)
    sampler = ElasticBatchSampler(32, 8, seed=0)
    state = TrainState(model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler)
    settings = {"url": str(tmp / "ck"), "memory_dir": str(tmp / "shm"), "every_steps": 0, **cfg}
    manager = ShardedCheckpointManager(
        CheckpointConfig(**settings), "r", rank=0, world_size=1, local_rank=0, model=model,  # type: ignore[arg-type]
        optimizer=optimizer, current_state=state.state_dict, group=dist.group.WORLD,
    )  # fmt: skip
    return state, manager


def train(state: TrainState, manager: ShardedCheckpointManager, steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(8, 4)
        state.model(x).pow(2).mean().backward()
        state.optimizer.step()  # type: ignore[union-attr]
        state.optimizer.zero_grad()  # type: ignore[union-attr]
        state.scheduler.step()  # type: ignore[union-attr]
        state.sampler.advance(state.sampler.plan(1, 0))  # type: ignore[union-attr]
        state.step += 1
        manager.save(state.step, state.state_dict)


def local(state: TrainState) -> dict[str, torch.Tensor]:
    out = {
        f"model.{k}": (v.to_local() if isinstance(v, DTensor) else v).clone()
        for k, v in state.model.state_dict().items()
    }
    for i, per in enumerate(state.optimizer.state.values()):  # type: ignore[union-attr]
        for k, v in per.items():
            out[f"opt.{i}.{k}"] = (v.to_local() if isinstance(v, DTensor) else v).clone()
    return out


@pytest.fixture
def shm(tmp_path: Path) -> Path:
    (tmp_path / "shm").mkdir()
    return tmp_path


def test_memory_round_trip_into_a_rebuilt_model(world_one: World, shm: Path) -> None:
    state, manager = job(world_one, shm)
    assert manager.restore() is None
    train(state, manager, 3)
    saved = local(state)
    manager.close()

    state2, manager2 = job(world_one, shm)
    restored = manager2.restore(state2.model.state_dict())
    assert restored is not None and restored.step == 3 and restored.source == "memory"
    assert isinstance(restored.state["optimizer"]["state"][0]["exp_avg"], DTensor)
    state2.load_state_dict(restored.state)
    got = local(state2)
    assert got.keys() == saved.keys() and all(torch.equal(got[k], saved[k]) for k in saved)
    assert state2.scheduler.last_epoch == 3 and state2.sampler.state_dict()["cursor"] == 24  # type: ignore[union-attr]
    assert manager2.last_moved["kept"] > 0 and manager2.last_moved["received"] == 0
    manager2.close(release_memory=True)


def test_a_torn_slot_is_never_restored(world_one: World, shm: Path) -> None:
    state, manager = job(world_one, shm)
    manager.restore()
    train(state, manager, 3)
    manager.close()
    assert manager.memory is not None
    newest = manager.memory.own.valid_slots()[0]  # maps the file again
    assert newest.step == 3
    data = manager.memory.own.data(newest.slot, newest.nbytes)
    data[-8:] ^= 0xFF  # flipped bits in the newest step's data: its header and metadata still verify
    manager.memory.own.detach()

    state2, manager2 = job(world_one, shm)
    restored = manager2.restore(state2.model.state_dict())
    assert restored is not None and restored.step == 2  # the next-newest slot, after the verdict
    manager2.close(release_memory=True)


def test_durable_dcp_round_trip_and_ls(world_one: World, shm: Path) -> None:
    state, manager = job(world_one, shm, every_steps=2, memory=False)
    manager.restore()
    train(state, manager, 4)
    saved = local(state)
    manager.finalize(state.step, state.state_dict())
    run = shm / "ck" / "r"
    assert sorted(p.name for p in run.glob("step-*")) == ["step-00000002", "step-00000004"]
    assert (run / "step-00000004" / ".metadata").exists()

    state2, manager2 = job(world_one, shm, memory=False)
    restored = manager2.restore(state2.model.state_dict())
    assert restored is not None and restored.step == 4 and restored.source == "durable"
    state2.load_state_dict(restored.state)
    got = local(state2)
    assert all(torch.equal(got[k], saved[k]) for k in saved)
    manager2.close()


def test_a_checkpoint_of_another_model_is_refused(world_one: World, shm: Path) -> None:
    state, manager = job(world_one, shm, every_steps=1, memory=False)
    manager.restore()
    train(state, manager, 1)
    manager.finalize(state.step, state.state_dict())
    state2, manager2 = job(world_one, shm, out=4, memory=False)
    with pytest.raises(
        ModelMismatch, match="different model: .layers.1.bias. is float32.3. in the checkpoint"
    ):
        manager2.restore(state2.model.state_dict())
    manager2.close()
