"""How workers tell their agent the job's outcome: finished at a step, or failed for good.

The ``etcd3`` handler creates a directory per agent and names it in :data:`ENV_OUTCOME_DIR`; workers inherit
the variable and write one small JSON file per rank when they finish training or fail with a
:class:`~elastic_train.errors.NonRetryableError`. The handler reads them when the worker group ends: a
failure closes the run as failed (no restart, no failure budget spent), a finish records the final step in
the run's ``closed`` mark. Workers not started by this handler (no variable) write nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from typing import Any

from elastic_train.envvars import ENV_OUTCOME_DIR


def record_outcome(
    environ: Mapping[str, str], rank: int, state: str, *, step: int | None = None, message: str = ""
) -> None:
    """Leave this rank's outcome for the agent (atomically; a no-op outside an ``etcd3`` agent).

    Args:
        environ: the worker's environment.
        rank: global rank of the worker.
        state: ``finished`` or ``failed``.
        step: the last step trained (finished).
        message: one line saying why (failed).
    """
    directory = environ.get(ENV_OUTCOME_DIR)
    if not directory or not os.path.isdir(directory):
        return
    path = os.path.join(directory, f"rank-{int(rank)}.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    with contextlib.suppress(OSError):
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"state": state, "step": step, "message": message[:2000], "rank": rank}, f)
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
        if isinstance(d, dict) and d.get("state") in ("finished", "failed"):
            out.append(d)
    return sorted(out, key=lambda d: d["rank"] if isinstance(d.get("rank"), int) else 0)


def clear_outcomes(directory: str) -> None:
    """Forget the outcomes of a worker group (before the next one starts)."""
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if name.startswith("rank-"):  # the directory also holds the fence's files (agentlink)
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(directory, name))
