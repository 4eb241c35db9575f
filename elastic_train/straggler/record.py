"""A slow node's standing as the run keeps it for ``elastic-train status``: ``straggler/<node>`` in etcd.

Written by the node that decides (on its lease: the record goes with it), read back by ``status`` as untrusted
input: a record that does not parse is reported as unreadable, never a traceback.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any, Literal, TypeGuard

#: Standing of a node with a record: flagged (in the job), evicted (out of the job, its workers stopped), on
#: probation (waiting to rejoin on trial).
STATES = ("flagged", "evicted", "probation")


@dataclass(frozen=True, slots=True)
class StragglerRecord:
    """One slow node's standing."""

    node: str
    state: Literal["flagged", "evicted", "probation"]
    score: float
    """Its score when last decided (its time over the others' median)."""
    step: int
    """The step it was decided at."""
    since: float
    """Unix time it reached this state."""
    policy: str
    """The job's straggler policy (``report`` or ``evict``)."""
    why: str = ""
    """Why it is kept in the job, or how its probation stands."""

    def encode(self) -> bytes:
        return json.dumps({k: v for k, v in asdict(self).items() if k != "node"}).encode()

    @staticmethod
    def decode(node: str, raw: bytes) -> StragglerRecord:
        """Read a record back from etcd.

        Raises:
            ValueError: not a straggler record (bad JSON, a missing or ill-typed field).
        """
        try:
            d: Any = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"straggler record of {node}: not JSON") from exc
        if not isinstance(d, dict):
            raise ValueError(f"straggler record of {node}: not a mapping")
        state, score, step, since = d.get("state"), d.get("score"), d.get("step"), d.get("since")
        if state not in STATES:
            raise ValueError(f"straggler record of {node}: state {state!r}")
        if not (seconds(score) and seconds(since) and whole(step)):
            raise ValueError(f"straggler record of {node}: score, step or since missing")
        return StragglerRecord(
            node=node,
            state=state,
            score=float(score),
            step=step,
            since=float(since),
            policy=str(d.get("policy", ""))[:16],
            why=str(d.get("why", ""))[:200],
        )

    def line(self) -> str:
        """How ``status`` shows it."""
        why = f"; {self.why}" if self.why else ""
        score = f"score {self.score:.2f}, policy {self.policy}{why}"
        return f"{self.node}: {self.state} at step {self.step} ({score})"


def whole(v: Any) -> TypeGuard[int]:
    """``v`` read from JSON is a count: an integer (not a bool), at least 0."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def seconds(v: Any) -> TypeGuard[float]:
    """``v`` read from JSON is a finite number, at least 0 (seconds, a score, a Unix time)."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
