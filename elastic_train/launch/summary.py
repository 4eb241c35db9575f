"""The outcome of a local job: timeline, faults, final loss, exactly-once verdict — as JSON and a table."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from elastic_train.launch.faults import FaultRecord


@dataclass(kw_only=True, slots=True)
class Summary:
    """What ``elastic-train local`` reports at the end (``--summary FILE`` writes :meth:`to_json`)."""

    run_id: str
    steps: int
    """Steps the job was asked to train."""
    completed_steps: int = 0
    """Highest step completed."""
    succeeded: bool = False
    wall_s: float = 0.0
    first_step_s: float | None = None
    """Seconds from launch to the first completed step."""
    final_loss: float | None = None
    world_size_timeline: list[dict[str, Any]] = field(default_factory=list)
    """[{"time_s", "step", "world_size", "round"}] at every change of world size or round."""
    faults: list[FaultRecord] = field(default_factory=list)
    """What happened to each planned fault."""
    exactly_once: dict[str, Any] | None = None
    """Audit verdict ({"ok", "checked_steps", "problems"}), None when not audited."""
    node_exit_codes: dict[str, int | None] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "steps": self.steps,
            "completed_steps": self.completed_steps,
            "succeeded": self.succeeded,
            "wall_s": round(self.wall_s, 3),
            "first_step_s": None if self.first_step_s is None else round(self.first_step_s, 3),
            "final_loss": self.final_loss,
            "world_size_timeline": self.world_size_timeline,
            "faults": [f.to_json() for f in self.faults],
            "exactly_once": self.exactly_once,
            "node_exit_codes": self.node_exit_codes,
        }


def world_size_timeline(step_events: list[dict[str, Any]], t0: float) -> list[dict[str, Any]]:
    """Reduce step events to the points where the world size or the round changed."""
    timeline: list[dict[str, Any]] = []
    last: tuple[Any, Any] | None = None
    for e in step_events:
        key = (e.get("world_size"), e.get("round"))
        if key != last:
            timeline.append(
                {
                    "time_s": round(float(e["time"]) - t0, 3),
                    "step": e.get("step"),
                    "world_size": e.get("world_size"),
                    "round": e.get("round"),
                }
            )
            last = key
    return timeline


def _fmt(value: float | None, unit: str = "s") -> str:
    return "-" if value is None else f"{value:.2f}{unit}"


def render_table(summary: Summary) -> str:
    """A plain-text report for the terminal."""
    lines = [
        f"run {summary.run_id}: {'finished' if summary.succeeded else 'FAILED'} "
        f"{summary.completed_steps}/{summary.steps} steps in {summary.wall_s:.1f}s, "
        f"first step after {_fmt(summary.first_step_s)}, final loss "
        f"{'-' if summary.final_loss is None else f'{summary.final_loss:.4f}'}",
        "world size: "
        + " -> ".join(f"{p['world_size']}@step{p['step']}" for p in summary.world_size_timeline),
    ]
    if summary.faults:
        width = max(24, *(len(f.label) + 2 for f in summary.faults))
        header = f"{'fault':<{width}}{'detected':>10}{'resumed':>10}{'world':>7}{'redone':>8}  source"
        lines += ["", header, "-" * len(header)]
        for f in summary.faults:
            j = f.to_json()
            lines.append(
                f"{f.label:<{width}}{_fmt(j['detected_s']):>10}{_fmt(j['resumed_s']):>10}"  # type: ignore[arg-type]
                f"{j['resumed_world_size'] if j['resumed_world_size'] is not None else '-':>7}"
                f"{j['steps_redone'] if j['steps_redone'] is not None else '-':>8}  {j['source'] or '-'}"
            )
            if "exit_code" in f.extra:  # an intruding node (collision faults): how it was turned away
                lines.append(f"  -> exit {f.extra['exit_code']}: {f.extra.get('line', '')}")
    if summary.exactly_once is not None:
        eo = summary.exactly_once
        verdict = "OK" if eo.get("ok") else "VIOLATED"
        lines += [
            "",
            f"exactly-once: {verdict} ({_checked(eo)}, {eo.get('samples', 0)} samples checked)",
        ]
        lines += [f"  {p}" for p in eo.get("problems", [])[:10]]
    return "\n".join(lines)


def _checked(eo: dict[str, Any]) -> str:
    """``80 steps``, or ``steps 41..80`` for a run resumed from another run's checkpoint."""
    first, last = int(eo.get("first_step") or 1), int(eo.get("steps") or 0)
    return f"{last} steps" if first == 1 else f"steps {first}..{last}"
