"""CUDA and NCCL paths, skipped where no GPU is visible (CI has none).

Checkpoints of GPU state through both tiers, the loss-carrying DDP comm hook under NCCL, and the worker
training on the GPU with NCCL, committing checkpoints and resuming from them.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elastic_train.checkpoint import CheckpointConfig, CheckpointManager, durable
from elastic_train.checkpoint.storage import open_storage

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROOT = Path(__file__).resolve().parents[2]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 10)).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2):
        x = torch.randn(32, 512, device="cuda")
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))  # type: ignore[arg-type]
    return a == b


def test_gpu_state_round_trips_through_both_tiers(tmp_path, memdir):
    model, opt = _trained()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 2}
    cfg = CheckpointConfig(url=str(tmp_path / "c"), every_steps=2, memory_every_steps=1, memory_dir=memdir)
    device = torch.device("cuda")
    mgr = CheckpointManager(cfg, "run", rank=0, world_size=1, local_rank=0, device=device)
    mgr.save(1, state)
    mgr.save(2, state)  # memory snapshot and durable checkpoint (written with O_DIRECT from the slot)
    mgr.wait()
    mgr.close()  # keeps the snapshot
    got = CheckpointManager(cfg, "run", rank=0, world_size=1, local_rank=0, device=device).restore(
        model=model.state_dict()
    )
    assert got is not None and (got.step, got.source) == (2, "memory")
    assert _same(got.state, state)
    twin, twin_opt = _trained()
    twin.load_state_dict(got.state["model"])
    twin_opt.load_state_dict(got.state["optimizer"])
    assert next(twin.parameters()).is_cuda and _same(twin_opt.state_dict(), opt.state_dict())

    storage = open_storage(cfg.url)
    (entry,) = durable.list_entries(storage, storage.join(storage.root, "run"))
    assert entry.valid and durable.verify(storage, entry.path) == []
    buf, specs = durable.load(storage, entry)
    from elastic_train.checkpoint.codec import tensor_at, unflatten

    assert entry.manifest is not None
    assert _same(unflatten(entry.manifest["skeleton"], [tensor_at(buf, s) for s in specs]), state)


def test_loss_rides_in_the_last_bucket_under_nccl():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from elastic_train.train.lossreduce import LossCarrier

    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{_port()}",
        rank=0,
        world_size=1,
        device_id=torch.device("cuda", 0),
    )
    try:
        torch.manual_seed(0)
        base = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1)).cuda()
        twin = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1)).cuda()
        twin.load_state_dict(base.state_dict())
        plain = DistributedDataParallel(base)
        carried = DistributedDataParallel(twin, bucket_cap_mb=0.01)  # several buckets
        carrier = LossCarrier()
        carrier.register(carried)
        for step in range(3):
            g = torch.Generator(device="cuda").manual_seed(step)
            x = torch.randn(16, 64, device="cuda", generator=g)
            y = torch.randn(16, 1, device="cuda", generator=g)
            ((plain(x) - y) ** 2).sum().backward()
            loss = ((carried(x) - y) ** 2).sum()
            carrier.arm(loss.detach())
            loss.backward()
            got = carrier.take()
            assert got is not None and got.is_cuda
            torch.testing.assert_close(got.reshape(()), loss.detach())
            for a, b in zip(base.parameters(), twin.parameters(), strict=True):
                assert torch.equal(a.grad, b.grad)
            base.zero_grad()
            twin.zero_grad()
        del plain, carried  # DDP's reducers must go before the process group does
        gc.collect()
    finally:
        dist.destroy_process_group()


def _worker(tmp_path: Path, memdir: str, steps: int, tag: str) -> list[dict]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    }
    env.update(
        ELASTIC_TRAIN_LOG_FORMAT="json", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    )
    cmd = [
        sys.executable,
        "-m",
        "elastic_train.worker",
        "--config",
        str(ROOT / "examples" / "job.yaml"),
        "--steps",
        str(steps),
        "--checkpoint",
        str(tmp_path / "ckpt"),
        "--checkpoint-every",
        "20",
        "--set",
        f"checkpoint.memory_dir={memdir}",
    ]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    (tmp_path / f"{tag}.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    events = []
    for line in (proc.stdout + proc.stderr).splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events


def test_worker_trains_on_the_gpu_with_nccl_and_resumes(tmp_path, memdir):
    first = _worker(tmp_path, memdir, 40, "first")
    ready = next(e for e in first if e.get("event") == "worker_ready")
    assert ready["backend"] == "nccl" and ready["device"] == "cuda:0"
    assert any(e.get("event") == "training_done" and e.get("step") == 40 for e in first)
    second = _worker(tmp_path, memdir, 60, "second")
    resumed = next(e for e in second if e.get("event") == "training_resumed")
    assert resumed["step"] == 40 and resumed["source"] == "durable"
    storage = open_storage(str(tmp_path / "ckpt"))
    steps = [e.step for e in durable.list_entries(storage, storage.join(storage.root, "demo")) if e.valid]
    assert steps[-1] == 60


def test_async_snapshot_copies_on_a_side_stream_into_a_pinned_slot(tmp_path, memdir):
    """The snapshot of step n is exactly step n, although save returns before the copy is done and the next
    step's forward (BatchNorm statistics) and optimizer step are queued right after it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 2048), torch.nn.BatchNorm1d(2048), torch.nn.Linear(2048, 256)
    ).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    cfg = CheckpointConfig(url=str(tmp_path / "c"), every_steps=0, memory_every_steps=1, memory_dir=memdir)
    mgr = CheckpointManager(cfg, "run", rank=0, world_size=1, local_rank=0, device=torch.device("cuda"))
    mgr.attach(opt)
    x = torch.randn(64, 256, device="cuda")
    for step in range(1, 4):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        expected = {k: v.cpu().clone() for k, v in model.state_dict().items()}
        mgr.save(step, lambda n=step: {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": n})
        model(x * 3 + 1).square().mean().backward()  # moves BN statistics; the fence orders the step
        opt.step()
        opt.zero_grad()
    assert (
        mgr.memory is not None and mgr.memory._device._stream is not None and mgr.memory._device._pinned_ptr
    )
    torch.cuda.synchronize()
    mgr.close()
    got = CheckpointManager(cfg, "run", rank=0, world_size=1, local_rank=0).restore()
    assert got is not None and (got.step, got.source) == (3, "memory")
    assert _same(got.state["model"], expected)
