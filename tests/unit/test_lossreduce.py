"""The loss carried in DDP's first gradient bucket: same gradients as DDP's default hook, summed loss; with
the step clock's per-rank slots after it (speed-weighted shares' busy times), every rank's value, exact, on
every rank, once a step; the same slots ride with ``time_collectives``' hook."""

from __future__ import annotations

import gc
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from elastic_train.train.busy import StepClock, time_collectives
from elastic_train.train.lossreduce import LossCarrier


class _Slots:
    """A rider: one slot per rank, this rank's holding a value of the step."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world, self.value = rank, world, 0.0

    def slots(self, busy: float | None) -> torch.Tensor:
        out = torch.zeros(self.world, dtype=torch.float64)
        out[self.rank] = self.value
        return out


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    twin = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    twin.load_state_dict(base.state_dict())
    plain = DistributedDataParallel(base)
    carried_ddp = DistributedDataParallel(twin, bucket_cap_mb=0.0005)  # several buckets
    clock = StepClock()
    rider = _Slots(rank, world)
    carrier = LossCarrier(clock=clock)
    assert carrier.suitable(twin)
    carrier.register(carried_ddp)
    timed_twin = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    timed_twin.load_state_dict(base.state_dict())
    timed_ddp = DistributedDataParallel(timed_twin, bucket_cap_mb=0.0005)
    timed_clock = StepClock()
    time_collectives(timed_ddp, timed_clock)
    timed_clock.rider = rider
    results = []
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(5 + rank, 8, generator=g), torch.randn(5 + rank, 1, generator=g)
        loss = ((plain(x) - y) ** 2).sum()
        loss.backward()
        expected = loss.detach().clone()
        dist.all_reduce(expected)
        loss2 = ((carried_ddp(x) - y) ** 2).sum()
        rider.value = 0.1 * (rank + 1) + step / 3
        clock.rider = rider if step > 0 else None  # step 0 carries the loss alone
        carrier.arm(loss2.detach().to(torch.float64))
        loss2.backward()
        got = carrier.take()
        slots = clock.take_carried()
        assert got is not None and got.numel() == 1
        assert (slots is None) == (step == 0) and clock.take_carried() is None
        ((timed_ddp(x) - y) ** 2).sum().backward()
        timed = timed_clock.take_carried()
        assert timed is not None and timed_clock.carry() is None  # once a step: until the next lap
        timed_clock.lap()
        clock.lap()
        same_grads = all(
            torch.equal(a.grad, b.grad) and torch.equal(a.grad, c.grad)
            for a, b, c in zip(base.parameters(), twin.parameters(), timed_twin.parameters(), strict=True)
        )
        carried = [] if slots is None else slots.tolist()
        assert carried in ([], timed.tolist())
        results.append((float(got[0].item()), float(expected.item()), same_grads, carried))
        for m in (base, twin, timed_twin):
            m.zero_grad()
    # Without arming, no bucket carries anything and the gradients are still DDP's.
    (carried_ddp(torch.ones(2, 8)).sum()).backward()
    results.append((carrier.take(), None, True, []))
    torch.save(results, f"{out}.{rank}")
    # DDP's reducers must go before the process group does (else gloo can abort the process at exit).
    del plain, carried_ddp, carrier, timed_ddp
    gc.collect()
    dist.destroy_process_group()


def test_loss_carrier_sums_the_loss_and_keeps_ddp_gradients(tmp_path):
    out = str(tmp_path / "r.pt")
    mp.spawn(_rank, args=(2, _port(), out), nprocs=2, join=True)
    results, other = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    for step, (got, expected, same_grads, slots) in enumerate(results[:-1]):
        assert abs(got - expected) <= 1e-5 * max(1.0, abs(expected))
        assert same_grads
        # Each slot holds one rank's value exactly as the bucket's dtype (float32) has it, on both ranks.
        want = [] if step == 0 else [float(torch.tensor(0.1 * (r + 1) + step / 3).float()) for r in range(2)]
        assert slots == want and other[step][3] == want
    assert results[-1][0] is None
