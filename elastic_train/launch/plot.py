"""A PNG timeline of a local run: loss and world size over time, faults marked (``[plot]`` extra)."""

from __future__ import annotations

from typing import Any

from elastic_train.errors import ConfigError
from elastic_train.launch.summary import Summary


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
    times = [float(e["time"]) - t0 for e in step_events]
    fig, (ax_loss, ax_ws) = plt.subplots(2, 1, sharex=True, figsize=(9, 5), height_ratios=[3, 1])
    ax_loss.plot(times, [e.get("loss") for e in step_events], lw=1.2, color="tab:blue")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title(f"{summary.run_id}: loss and world size")
    ax_ws.step(times, [e.get("world_size") for e in step_events], where="post", color="tab:green")
    ax_ws.set_ylabel("world size")
    ax_ws.set_xlabel("seconds since launch")
    for f in summary.faults:
        if f.fired_at is None:
            continue
        x = f.fired_at - t0
        for ax in (ax_loss, ax_ws):
            ax.axvline(x, color="tab:red", ls="--", lw=1)
        ax_loss.annotate(f.label, (x, 1.0), xycoords=("data", "axes fraction"), rotation=90,
                         va="top", ha="right", fontsize=8, color="tab:red")  # fmt: skip
        if f.resumed_at is not None:
            ax_ws.axvspan(x, f.resumed_at - t0, color="tab:red", alpha=0.15)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
