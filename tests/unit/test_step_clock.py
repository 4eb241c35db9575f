"""A rank's busy time per step: wall time less the wait for the gradient all-reduce, reported as a mean."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from elastic_train.node import Stats, StatsCounter
from elastic_train.train.busy import StepClock, time_collectives


def test_the_wait_after_the_last_launch_is_not_busy(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    now = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    clock = StepClock()
    assert clock.lap() is None  # the first boundary: no step yet
    now[0] = 100.2
    clock.launched()  # the last bucket launched 0.2 s into the step
    now[0] = 100.5
    clock.completed()  # ... and the others arrived 0.3 s later
    now[0] = 100.6
    assert clock.lap() == pytest.approx(0.3)  # 0.6 s of wall time, 0.3 s of it waiting
    now[0] = 101.0
    assert clock.lap() == pytest.approx(0.4)  # no all-reduce timed in this step: all of it counts


def test_stats_carry_the_mean_busy_time_since_the_last_report() -> None:
    sent: list[Stats] = []
    counter = StatsCounter(sent.append, every=3600.0)
    counter.committed(1, 1, 0.0, busy_s=None)  # a round's first step re-formed the group: not counted
    for step, busy in [(2, 0.1), (3, 0.1), (4, 0.4)]:
        counter.committed(1, step, 0.0, busy_s=busy)
    counter.flush()
    assert sent[0].busy_s is None and sent[-1].busy_s == pytest.approx(0.2) and sent[-1].busy_steps == 3
    back = Stats.decode(sent[-1].encode())
    assert back.busy_s == pytest.approx(0.2) and back.busy_steps == 3
    with pytest.raises(ValueError, match="busy_s"):
        Stats.decode({**sent[-1].encode(), "busy_s": -1})
    older = {k: v for k, v in sent[-1].encode().items() if k not in ("busy_s", "busy_steps")}
    assert Stats.decode(older).busy_s is None  # a worker of an older release reports none


def test_time_collectives_keeps_ddps_gradients_and_times_each_bucket(tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        plain = torch.nn.Linear(16, 4)
        timed = torch.nn.Linear(16, 4)
        timed.load_state_dict(plain.state_dict())
        x = torch.randn(8, 16)
        torch.nn.parallel.DistributedDataParallel(plain)(x).sum().backward()
        ddp = torch.nn.parallel.DistributedDataParallel(timed)
        clock = StepClock()
        time_collectives(ddp, clock)
        clock.lap()
        ddp(x).sum().backward()
        assert clock.timed and clock._completed >= clock._launched > 0
        assert clock.lap() is not None
        for a, b in zip(plain.parameters(), timed.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad)  # type: ignore[arg-type]
    finally:
        dist.destroy_process_group()
