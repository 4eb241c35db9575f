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
"""

from __future__ import annotations

import contextlib
import json
import os
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
) -> None:
    """Leave this rank's outcome for the agent (atomically; a no-op outside an ``etcd3`` agent).

    Args:
        environ: the worker's environment.
        rank: global rank of the worker.
        state: ``finished``, ``failed`` or ``exited``.
        step: the last step trained (finished).
        message: one line saying why (failed), or the last line written to stderr (exited).
        code: the exit code (exited).
    """
    directory = environ.get(ENV_OUTCOME_DIR)
    if not directory or not os.path.isdir(directory):
        return
    path = os.path.join(directory, f"rank-{int(rank)}.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    with contextlib.suppress(OSError):
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(
                {"state": state, "step": step, "message": message[:2000], "rank": rank, "code": code}, f
            )
        os.replace(tmp, path)


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


def clear_outcomes(directory: str) -> None:
    """Forget the outcomes of a worker group (before the next one starts); the trained mark stays."""
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            # the directory also holds the fence's files (agentlink) and the trained mark
            if not name.startswith("rank-") or name == OUTCOME_TRAINED:
                continue
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))
