"""A PNG timeline of a local run: loss and world size over time, faults marked (``[plot]`` extra)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from elastic_train.errors import ConfigError
from elastic_train.launch.faults import FaultRecord
from elastic_train.launch.summary import Summary


def idle_spans(
    step_events: Sequence[dict[str, Any]], faults: Sequence[FaultRecord], *, t0: float
) -> list[tuple[float, float]]:
    """The spans (seconds since ``t0``) in which the job did not train because of a fault.

    A fault's span starts at its injection or at the last step completed before the job trained again,
    whichever is later (after a join is injected, the job keeps training at the old size until its
    workers stop for the new round), and ends at that first step in the new round.
    """
    times = sorted(float(e["time"]) for e in step_events)
    spans = []
    for f in faults:
        if f.fired_at is None or f.resumed_at is None:
            continue
        before = [t for t in times if t < f.resumed_at]
        start = max([f.fired_at, *before[-1:]])
        spans.append((start - t0, f.resumed_at - t0))
    return spans


def plot_timeline(
    step_events: list[dict[str, Any]], summary: Summary, path: str, *, t0: float, required: bool
) -> bool:
    """Draw the timeline into ``path``; returns False (or raises when ``required``) without matplotlib.

    Raises:
        ConfigError: matplotlib is missing and the plot was asked for explicitly.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        if required:
            raise ConfigError(
                "--plot needs matplotlib: install elastic-train's [plot] extra (pip install -e '.[plot]')"
            ) from exc
        return False
    if not step_events:
        return False
    fig = timeline_figure(step_events, summary, t0=t0)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def timeline_figure(step_events: list[dict[str, Any]], summary: Summary, *, t0: float) -> Any:
    """The timeline as a matplotlib figure: loss and world size over time, faults marked, the spans
    without training shaded (:func:`idle_spans`)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    times = [float(e["time"]) - t0 for e in step_events]
    fig, (ax_loss, ax_ws) = plt.subplots(2, 1, sharex=True, figsize=(9, 5), height_ratios=[3, 1])
    ax_loss.plot(times, [e.get("loss") for e in step_events], lw=1.2, color="tab:blue")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title(f"{summary.run_id}: loss and world size")
    ax_ws.step(times, [e.get("world_size") for e in step_events], where="post", color="tab:green")
    ax_ws.set_ylabel("world size")
    ax_ws.set_xlabel("seconds since launch")
    ax_ws.yaxis.set_major_locator(MaxNLocator(integer=True))  # a world has no half workers
    sizes = [int(e["world_size"]) for e in step_events if e.get("world_size") is not None]
    if sizes:
        ax_ws.set_ylim(min(sizes) - 0.5, max(sizes) + 0.5)
    shaded = False
    for start, end in idle_spans(step_events, summary.faults, t0=t0):
        for ax in (ax_loss, ax_ws):
            ax.axvspan(
                start, end, color="tab:red", alpha=0.15, lw=0, label=None if shaded else "not training"
            )
        shaded = True
    if shaded:
        ax_loss.legend(loc="upper right", fontsize=8)
    for f in summary.faults:
        if f.fired_at is None:
            continue
        x = f.fired_at - t0
        for ax in (ax_loss, ax_ws):
            ax.axvline(x, color="tab:red", ls="--", lw=1)
        ax_loss.annotate(f.label, (x, 1.0), xycoords=("data", "axes fraction"), rotation=90,
                         va="top", ha="right", fontsize=8, color="tab:red")  # fmt: skip
    fig.tight_layout()
    return fig
