"""The sharded (FSDP2) tiers on GPUs (skipped where no CUDA GPU is visible).

- One GPU, a world of one on NCCL: an FSDP2 model's shards, Adam state and data position go into the memory
  tier (CUDA tensors through page-locked host memory) and a durable DCP checkpoint, and come back onto the
  device into a model sharded anew; in float32, and with bfloat16 compute (mixed precision: float32 shards).
- Two GPUs (>= 2 visible): ranks re-form their NCCL group in-process from a world of 2 to a world of 1 after
  rank 1 "dies"; the survivor holds rank 1's shards as a replica (``shard_replicas: 1``), reshards onto its
  device, and its weights equal a fault-free world-1 run's.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import elastic_train as et
from elastic_train.checkpoint import CheckpointConfig
from elastic_train.train.busy import StepClock

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(16, 64), torch.nn.Linear(64, 64)])
        self.head = torch.nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        out: torch.Tensor = self.head(x)
        return out


@pytest.fixture
def world() -> Iterator[et.World]:
    saved = {k: os.environ.pop(k) for k in TORCHRUN_VARS if k in os.environ}
    w = et.init()
    yield w
    et.shutdown()
    os.environ.update(saved)


def job(
    tmp: Path, sharding: dict[str, object] | None = None, **cfg: object
) -> tuple[torch.nn.Module, torch.optim.Optimizer, et.Checkpointer]:
    model = et.shard_model(Net, **(sharding or {}))
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = et.ElasticBatchSampler(64, 8, seed=0)
    state = et.TrainState(model=model, optimizer=optimizer, sampler=sampler)
    config = CheckpointConfig(memory_dir=str(tmp / "shm"), **cfg)  # type: ignore[arg-type]
    ckpt = et.Checkpointer(state, str(tmp / "ck"), every_steps=2, config=config, run_id="gpu")
    return model, optimizer, ckpt


def local(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.to_local().detach().cpu().clone() for k, v in model.state_dict().items()}


#: FSDP2's mixed precision as GPU jobs run it: bfloat16 compute, float32 gradient reduction and shards.
BF16 = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}


@pytest.mark.parametrize("sharding", [None, BF16], ids=["float32", "bf16"])
def test_a_sharded_cuda_state_round_trips_memory_and_dcp(
    world: et.World, tmp_path: Path, sharding: dict[str, object] | None
) -> None:
    assert world.backend == "nccl"
    (tmp_path / "shm").mkdir()
    model, optimizer, ckpt = job(tmp_path, sharding)
    ckpt.restore()
    et.load_full(model, Net().state_dict())
    for _ in range(3):
        model(torch.randn(8, 16, device="cuda")).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        ckpt.commit()
    saved = local(model)
    assert {v.dtype for v in saved.values()} == {torch.float32}
    ckpt.close()

    model2, optimizer2, ckpt2 = job(tmp_path, sharding)
    assert ckpt2.restore() == 3 and ckpt2.source == "memory"
    got = local(model2)
    assert all(torch.equal(got[k], saved[k]) for k in saved)
    moment = next(iter(optimizer2.state.values()))["exp_avg"]
    assert isinstance(moment, DTensor) and moment.device.type == "cuda"
    ckpt2.finalize()

    model3, _, ckpt3 = job(tmp_path, sharding, memory=False)
    assert ckpt3.restore() == 3 and ckpt3.source == "durable"
    assert all(torch.equal(local(model3)[k], saved[k]) for k in saved)
    ckpt3.close()


WORKER = """
import sys
sys.path.insert(0, {root!r})
from tests.gpu.test_sharded_cuda import reform_worker
reform_worker(sys.argv[1], sys.argv[2], [int(p) for p in sys.argv[3:]])
"""


def reform_worker(role: str, tmp: str, ports: list[int]) -> None:
    """``0`` / ``1``: a rank of a world of 2 on that GPU, 3 steps; then rank 0 alone re-forms and reshards
    (rank 1's shards from its replica) and trains 3 more steps. ``ref``: 6 steps at a world of 1. Each
    saves its full weights (the same batch on every rank: the mean gradient is the world of one's)."""
    from elastic_train.train.group import World, shutdown

    index = 0 if role == "ref" else int(role)
    os.environ["ELASTIC_TRAIN_SHM_OWNER"] = str(os.getpid())
    torch.cuda.set_device(index)
    device = torch.device("cuda", index)

    def world_of(rank: int, size: int, rnd: int) -> World:
        return World(
            rank=rank, world_size=size, local_rank=index, local_world_size=1, device=device, backend="nccl",
            round=rnd, run_id="gpu", restart_count=0,
        )  # fmt: skip

    def train(world: World, steps: int, url: str) -> tuple[torch.nn.Module, et.Checkpointer]:
        from torch.distributed.device_mesh import init_device_mesh

        model = et.shard_model(Net, mesh=init_device_mesh("cuda", (world.world_size,)), device=device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        state = et.TrainState(model=model, optimizer=optimizer)
        config = CheckpointConfig(memory_dir=f"{tmp}/shm", every_steps=0, shard_replicas=1)
        ckpt = et.Checkpointer(state, url, config=config, run_id=f"gpu-{role}", world=world)
        ckpt.restore()
        if ckpt.source is None:
            torch.manual_seed(0)
            et.load_full(model, Net().state_dict())
        for _ in range(steps):
            x = torch.randn(64, 16, generator=torch.Generator().manual_seed(ckpt.step))
            model(x.to(device)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            ckpt.commit()
        return model, ckpt

    def finish(model: torch.nn.Module, ckpt: et.Checkpointer, name: str) -> None:
        full = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
        ckpt.finalize()
        torch.save(full, f"{tmp}/{name}")

    if role == "ref":
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=0, world_size=1)
        finish(*train(world_of(0, 1, 1), 6, f"{tmp}/ref"), "reference.pt")
        shutdown()
        return
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=index, world_size=2)
    model, ckpt = train(world_of(index, 2, 1), 3, f"{tmp}/ck")
    ckpt.close()
    del model
    shutdown()
    if index == 1:
        return
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{ports[1]}", rank=0, world_size=1)
    model, ckpt = train(world_of(0, 1, 2), 3, f"{tmp}/ck")
    assert ckpt.source == "memory" and ckpt.step == 6, (ckpt.source, ckpt.step)
    finish(model, ckpt, "weights.pt")
    shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_reshard_in_process_from_a_replica(tmp_path: Path) -> None:
    import subprocess

    from elastic_train.net import free_port

    (tmp_path / "shm").mkdir()
    root = str(Path(__file__).resolve().parents[2])
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(root=root))
    ports = [str(free_port("127.0.0.1")) for _ in range(2)]
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env.update(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1", PYTHONPATH=root)

    def run(*roles: str) -> None:
        procs = [
            subprocess.Popen([sys.executable, str(script), role, str(tmp_path), *ports], env=env)
            for role in roles
        ]
        assert [p.wait(timeout=300) for p in procs] == [0] * len(roles)

    run("0", "1")
    run("ref")
    weights = torch.load(tmp_path / "weights.pt", weights_only=True)
    reference = torch.load(tmp_path / "reference.pt", weights_only=True)
    for name, value in reference.items():
        rel = float((weights[name] - value).norm() / value.norm())
        assert rel < 1e-5, (name, rel)


def test_timing_a_sharded_cuda_models_collectives_changes_no_gradient(world: et.World) -> None:
    """``et.time_collectives`` on a CUDA model sharded with FSDP2 (NCCL): the wrapped all-gather and
    reduce-scatter allocate and communicate as FSDP2's own do (the same gradients), and the clock is told."""
    torch.manual_seed(0)
    full = Net().state_dict()
    plain, timed = et.shard_model(Net), et.shard_model(Net)
    et.load_full(plain, full)
    et.load_full(timed, full)
    clock = StepClock()
    et.time_collectives(timed, clock)
    x = torch.randn(8, 16, device="cuda")
    for model in (plain, timed):
        model(x).pow(2).mean().backward()
    torch.cuda.synchronize()
    for a, b in zip(plain.parameters(), timed.parameters(), strict=True):
        assert torch.equal(a.grad.to_local(), b.grad.to_local())  # type: ignore[union-attr]
    assert clock.timed
