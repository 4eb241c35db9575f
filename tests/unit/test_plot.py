"""The demo's timeline: only the time without training is shaded; the world-size axis counts workers."""

from __future__ import annotations

import pytest

from elastic_train.launch.faults import Fault, FaultRecord
from elastic_train.launch.plot import idle_spans
from elastic_train.launch.summary import Summary

T0 = 1000.0


def steps(*spans: tuple[float, float, int]) -> list[dict]:
    """Step events every 0.5 s over each (start, end, world size), seconds since T0."""
    out, n = [], 0
    for start, end, world in spans:
        t = start
        while t <= end + 1e-9:
            n += 1
            out.append({"time": T0 + t, "step": n, "world_size": world, "loss": 3.0 - n * 0.01})
            t += 0.5
    return out


def faults() -> list[FaultRecord]:
    kill = FaultRecord(fault=Fault(kind="kill-node", step=10, node=1), fired_at=T0 + 5.2, resumed_at=T0 + 8.0)
    # A join injected at 12 s: the job keeps training at world 2 until its workers stop at 15 s.
    join = FaultRecord(fault=Fault(kind="add-node", step=20), fired_at=T0 + 12.0, resumed_at=T0 + 17.0)
    return [kill, join]


def test_only_the_time_without_training_is_shaded() -> None:
    events = steps((0, 5.0, 3), (8.0, 15.0, 2), (17.0, 20.0, 3))
    (kill, join) = idle_spans(events, faults(), t0=T0)
    assert kill == pytest.approx((5.2, 8.0))  # from the kill (the last step was before it)
    assert join == pytest.approx((15.0, 17.0))  # from the last step at world 2, not from the injection
    unresolved = [FaultRecord(fault=Fault(kind="kill-node", step=10, node=1), fired_at=T0 + 5.2)]
    assert idle_spans(events, unresolved, t0=T0) == []


def test_the_figure_shades_the_idle_spans_and_ticks_whole_world_sizes() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from elastic_train.launch.plot import timeline_figure

    events = steps((0, 5.0, 3), (8.0, 15.0, 2), (17.0, 20.0, 3))
    fig = timeline_figure(events, Summary(run_id="demo", steps=40, faults=faults()), t0=T0)
    try:
        _, ax_ws = fig.axes
        lo, hi = ax_ws.get_ylim()
        ticks = [t for t in ax_ws.get_yticks() if lo <= t <= hi]
        assert ticks and all(float(t).is_integer() for t in ticks)
        shaded = sorted((round(p.get_x(), 3), round(p.get_x() + p.get_width(), 3)) for p in ax_ws.patches)
        assert shaded == [(5.2, 8.0), (15.0, 17.0)]
    finally:
        plt.close(fig)
