"""How workers tell their agent the job's outcome: finished at a step, failed for good, or exited.

The ``etcd3`` handler creates a directory per agent and names it in :data:`ENV_OUTCOME_DIR`; workers inherit
the variable and write one small JSON file per rank when they finish training or fail with a
:class:`~elastic_train.errors.NonRetryableError` (``elastic_train.worker``), or when a user's script exits
non-zero (``exited``, with its exit code and the last line it wrote to stderr: the stand-in of
``elastic-train run --entry`` records it). The handler reads them when the worker group ends: a failure
closes the run as failed (no restart, no failure budget spent), a finish records the final step in the
run's ``closed`` mark, an exit is this node's report for the start-up failure rule
(:func:`elastic_train.rendezvous.decide.identical_startup_failure`). A worker that committed a step creates
:data:`OUTCOME_TRAINED` there (:func:`elastic_train.train.env.mark_trained`). Workers not started by this
handler (no variable) write nothing.

The stand-in also marks when its script starts (``rank-<r>.start``, :func:`mark_script`): ``pending`` while it
waits for the fork server, then the start time. While peers report a start-up failure, the agent leaves its
own workers running until its script has had as long as theirs took to fail (:func:`script_clock`,
:func:`elastic_train.rendezvous.decide.hold_for_startup_reports`), so a node whose fork server was slower
still reports its own, identical failure instead of being restarted over it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Mapping
from typing import Any

from elastic_train.envvars import ENV_OUTCOME_DIR, OUTCOME_TRAINED

#: What a worker may report.
STATES = ("finished", "failed", "exited")


def record_outcome(
    environ: Mapping[str, str],
    rank: int,
    state: str,
    *,
    step: int | None = None,
    message: str = "",
    code: int | None = None,
    ran_s: float | None = None,
) -> None:
    """Leave this rank's outcome for the agent (atomically; a no-op outside an ``etcd3`` agent).

    Args:
        environ: the worker's environment.
        rank: global rank of the worker.
        state: ``finished``, ``failed`` or ``exited``.
        step: the last step trained (finished).
        message: one line saying why (failed), or the last line written to stderr (exited).
        code: the exit code (exited).
        ran_s: seconds the script ran before it exited (exited).
    """
    directory = _directory(environ)
    if directory is None:
        return
    doc = {
        "state": state,
        "step": step,
        "message": message[:2000],
        "rank": rank,
        "code": code,
        "ran_s": ran_s,
    }
    _write(os.path.join(directory, f"rank-{int(rank)}.json"), doc)


def _directory(environ: Mapping[str, str]) -> str | None:
    """The agent's outcome directory named in ``environ``, or None outside an ``etcd3`` agent."""
    directory = environ.get(ENV_OUTCOME_DIR)
    return directory if directory and os.path.isdir(directory) else None


def _write(path: str, doc: dict[str, Any]) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with contextlib.suppress(OSError):
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f)
        os.replace(tmp, path)


def mark_script(environ: Mapping[str, str], rank: int, *, started: bool) -> None:
    """Mark this rank's script as waiting to start (``started=False``) or started now (a no-op outside an
    ``etcd3`` agent). The time is ``time.monotonic()``, one clock for every process on the machine."""
    directory = _directory(environ)
    if directory is not None:
        _write(
            os.path.join(directory, f"rank-{int(rank)}.start"), {"at": time.monotonic() if started else None}
        )


def script_clock(directory: str) -> tuple[bool, float | None] | None:
    """How far this agent's scripts got: ``None`` when none marked a start (not run by the stand-in);
    else (some still wait to start, when the last of the started ones started, on ``time.monotonic()``)."""
    try:
        names = [n for n in os.listdir(directory) if n.startswith("rank-") and n.endswith(".start")]
    except OSError:
        return None
    pending, latest = False, None
    for name in names:
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                at = json.load(f).get("at")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(at, float) and math.isfinite(at):
            latest = at if latest is None else max(latest, at)
        else:
            pending = True
    if not pending and latest is None:
        return None
    return pending, latest


def read_outcomes(directory: str) -> list[dict[str, Any]]:
    """The outcomes left in ``directory``, by rank (unreadable files are skipped)."""
    out = []
    try:
        names = sorted(n for n in os.listdir(directory) if n.startswith("rank-") and n.endswith(".json"))
    except OSError:
        return []
    for name in names:
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                d = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(d, dict) and d.get("state") in STATES:
            out.append(d)
    return sorted(out, key=lambda d: d["rank"] if isinstance(d.get("rank"), int) else 0)


def trained(directory: str) -> bool:
    """Whether a worker started from ``directory``'s agent committed (or resumed past) a step."""
    return os.path.exists(os.path.join(directory, OUTCOME_TRAINED))


def exit_report(outcomes: list[dict[str, Any]]) -> tuple[int, str] | None:
    """(exit code, last stderr line) when the exited workers of a group all failed the same way: the same
    code, the same non-empty line; ``None`` otherwise (none exited, they differ, or no line was written)."""
    exited = [o for o in outcomes if o["state"] == "exited"]
    reports = {(o.get("code"), str(o.get("message") or "").strip()) for o in exited}
    if len(reports) != 1:
        return None
    code, line = reports.pop()
    if not isinstance(code, int) or isinstance(code, bool) or code <= 0 or not line:
        return None
    return code, line


def seconds(v: Any) -> float:
    """A duration read from a file or a join (untrusted): a finite number of seconds in [0, 1 day], else 0."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return 0.0
    return min(max(float(v), 0.0), 86400.0)


def exit_ran_s(outcomes: list[dict[str, Any]]) -> float:
    """The longest any exited worker's script ran before it exited (0 when none says)."""
    return max((seconds(o.get("ran_s")) for o in outcomes if o["state"] == "exited"), default=0.0)


def clear_outcomes(directory: str) -> None:
    """Forget the outcomes of a worker group (before the next one starts); the trained mark and the fence's
    files stay."""
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if name.startswith("rank-"):  # the directory also holds the fence's files (agentlink)
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(directory, name))
