"""A sharded model's busy time: the step less the time the rank was blocked in FSDP2's collectives.

Two ranks of one FSDP2 model on gloo, rank 1 slowed by a sleep in one block's forward: with the timing
wrappers the fast rank's busy time is its own work and the slow rank's includes the sleep; without them both
are the step time. The wrappers change no gradient, and an asynchronous all-gather's ``wait()`` is timed
too."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elastic_train.net import free_port
from elastic_train.torchcompat import fsdp_comms
from elastic_train.train.busy import StepClock, time_collectives

SLEEP_S = 0.15
STEPS = 4


class Block(torch.nn.Module):
    def __init__(self, slow: bool) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.slow = slow

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.slow:
            time.sleep(SLEEP_S)  # the slow rank's extra work, between two collectives
        return torch.tanh(self.linear(x))


class Net(torch.nn.Module):
    def __init__(self, slow: bool) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(False), Block(slow), Block(False)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def _sharded(slow: bool) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Net(slow)
    mesh = init_device_mesh("cpu", (2,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class _Rider:
    """A speed-shares rider's shape: one slot per rank, this rank's value in its own."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def slots(self, busy: float | None) -> torch.Tensor:
        values = torch.zeros(4, dtype=torch.float64)
        values[self.rank] = 0.125 * (self.rank + 1)
        values[2 + self.rank] = 3.0 + self.rank
        return values


def _busy(model: torch.nn.Module, clock: StepClock, rank: int) -> list[float]:
    out = []
    clock.lap()
    for step in range(STEPS):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).backward()
        busy = clock.lap()
        assert busy is not None
        out.append(busy)
    return out


def _rank(rank: int, port: int, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    slow = rank == 1
    plain, plain_clock = _sharded(slow), StepClock()
    untimed = _busy(plain, plain_clock, rank)
    timed, clock = _sharded(slow), StepClock()
    time_collectives(timed, clock)
    time_collectives(timed, clock)  # a second call wraps the same communication, not the wrapper
    busy = _busy(timed, clock, rank)
    same = all(
        torch.equal(a.grad.to_local(), b.grad.to_local())  # type: ignore[union-attr]
        for a, b in zip(plain.parameters(), timed.parameters(), strict=True)
    )
    # An asynchronous all-gather (a prefetch): the rank is blocked in the handle's wait(), not the call.
    clock.lap()
    if slow:
        time.sleep(SLEEP_S)
    handle = timed.layers[0].unshard(async_op=True)  # type: ignore[operator]
    if handle is not None:
        handle.wait()
    timed.layers[0].reshard()  # type: ignore[operator]
    waited = clock._blocked
    wrappers = [type(c).__name__ for c in fsdp_comms(timed.layers[0]) or ()]
    result = {"untimed": untimed, "busy": busy, "same": same, "timed": clock.timed, "waited": waited}
    # The rider's values ride in the step's first reduce-scatter: every rank gets their sum, once a step,
    # and the gradients are still FSDP2's own.
    ridden, ridden_clock = _sharded(False), StepClock()
    time_collectives(ridden, ridden_clock)
    ridden_clock.rider = _Rider(rank)
    reference = _sharded(False)
    carried = []
    for step in range(2):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * step + rank))
        ridden_clock.lap()
        for model in (ridden, reference):
            model.zero_grad()
            model(x).backward()
        values = ridden_clock.take_carried()
        carried.append(None if values is None else values.tolist())
    rider_same = all(
        torch.equal(a.grad.to_local(), b.grad.to_local())  # type: ignore[union-attr]
        for a, b in zip(ridden.parameters(), reference.parameters(), strict=True)
    )
    loop = StepClock(loop_carries=True)  # the built-in loop's loss sum carries: the reduce-scatters do not
    time_collectives(reference, loop)
    loop.rider = _Rider(rank)
    reference(x).backward()
    result.update(carried=carried, rider_same=rider_same, loop_carried=loop.take_carried() is not None)
    torch.save({**result, "plain_timed": plain_clock.timed, "wrappers": wrappers}, f"{out}.{rank}")
    dist.destroy_process_group()


def test_a_sharded_models_busy_time_leaves_out_its_waits_in_fsdp_collectives(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = str(tmp_path / "r.pt")
    mp.spawn(_rank, args=(free_port(), out), nprocs=2, join=True)
    fast, slow = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    assert fast["same"] and slow["same"]  # the wrappers change no gradient
    assert fast["timed"] and not fast["plain_timed"]
    assert fast["wrappers"] == ["_TimedComm", "_TimedReduceScatter"]
    # Without the wrappers each rank's busy time is the step's, the sleep included on both.
    assert min(fast["untimed"][1:]) >= SLEEP_S * 0.9
    # With them the fast rank's waits are left out; the slow rank keeps its sleep (every step).
    assert min(slow["busy"]) >= SLEEP_S * 0.9
    assert sorted(fast["busy"])[1] <= SLEEP_S * 0.5, fast["busy"]
    # The rider's values, summed over the ranks, on both ranks, each step; the gradients unchanged.
    want = [0.125, 0.25, 3.0, 4.0]
    assert fast["carried"] == [want, want], fast["carried"]
    assert slow["carried"] == [want, want], slow["carried"]
    assert fast["rider_same"] and slow["rider_same"]
    assert not fast["loop_carried"] and not slow["loop_carried"]
    # The fast rank waited in the asynchronous all-gather's wait() for the slow one to join.
    assert fast["waited"] >= SLEEP_S * 0.7 and slow["waited"] < SLEEP_S * 0.7


def test_a_model_without_ddp_or_fully_shard_is_refused() -> None:
    with pytest.raises(TypeError, match="DistributedDataParallel model or a model sharded with fully_shard"):
        time_collectives(torch.nn.Linear(2, 2), StepClock())
