"""A run's failure budget for long jobs: failures counted in a sliding window, clean leaves counted apart.

Pure decisions and the record they keep in etcd (the run's ``budget`` key, written in the same transaction as
the round a transition closes); the protocol feeds them what it reads and writes what they return.

- :func:`transition_kind` says what moved a run from one round to the next: a **failure** (a member gone
  without a word, or workers that failed), a **leave** (a member that said it leaves, on SIGTERM within its
  grace: a preemption, a drain, a resize down; its state is already in memory, as the survivors' is), or a
  **scale** change (members added, or the same members again).
- :func:`spend` counts one failure: the run may survive ``budget`` failures in any ``window`` seconds; the
  window forgets older ones, so a job that lives for weeks does not die of having lived long, while a crash
  loop (a failure every few tens of seconds) spends any budget within minutes. ``window`` 0 counts the
  run's whole life.

Times are the closing node's wall clock (``time.time()``): a skew of seconds between nodes is nothing
against a window of an hour. Everything decoded from etcd is untrusted: a malformed record reads as empty.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from elastic_train.rendezvous.decide import FAILURE_REASONS, Joiner

#: What a transition between two rounds was (see :func:`transition_kind`).
FAILURE, LEAVE, SCALE = "failure", "leave", "scale"
KINDS = (FAILURE, LEAVE, SCALE)
#: Failure times kept in the record, whatever the budget (bounds the record at a few hundred KiB).
MAX_TIMES = 10_000


@dataclass(frozen=True, slots=True)
class BudgetRecord:
    """The run's ``budget`` key: recent failure times and the clean leaves."""

    times: tuple[float, ...] = ()
    """Unix times of the newest failures, oldest first (those still in the window, at most the budget)."""
    leaves: int = 0
    """Members that left cleanly over the run's life (not counted against the budget)."""

    def encode(self) -> bytes:
        return json.dumps({"times": [round(t, 3) for t in self.times], "leaves": self.leaves}).encode()

    @staticmethod
    def decode(raw: bytes | None) -> BudgetRecord:
        """The record read back from etcd (untrusted: anything malformed reads as empty)."""
        if raw is None:
            return BudgetRecord()
        try:
            d = json.loads(raw)
        except (UnicodeDecodeError, ValueError):
            return BudgetRecord()
        if not isinstance(d, dict):
            return BudgetRecord()
        raw_times = d.get("times")
        times = [
            float(t)
            for t in (raw_times if isinstance(raw_times, list) else [])[-MAX_TIMES:]
            if isinstance(t, int | float) and not isinstance(t, bool) and math.isfinite(t)
        ]
        leaves = d.get("leaves")
        count = leaves if isinstance(leaves, int) and not isinstance(leaves, bool) and leaves >= 0 else 0
        return BudgetRecord(tuple(sorted(times)), count)

    def in_window(self, now: float, window: float) -> int:
        """Failures counted against the budget at ``now`` (``window`` 0: every one kept)."""
        if window <= 0:
            return len(self.times)
        # a time ahead of this clock (another node's, skewed) counts as recent
        return sum(1 for t in self.times if t > now - window)


@dataclass(frozen=True, slots=True)
class Spent:
    """What one more failure does to the budget."""

    record: BudgetRecord
    """The record to write (the failure added, times out of the window dropped)."""
    in_window: int
    """Failures in the window, this one included."""
    exhausted: bool
    """More failures in the window than the budget allows: the run stops."""


def spend(record: BudgetRecord, *, now: float, budget: int, window: float, total: int) -> Spent:
    """Count one failure at ``now``.

    Args:
        record: the run's record before this failure.
        now: the closing node's ``time.time()``.
        budget: failures the run may survive in any ``window`` seconds.
        window: the sliding window in seconds; 0 counts the run's whole life (then ``total``, the run's
            failures so far, decides: the record keeps only the newest times).
        total: failures the run spent before this one (the ``failures`` key).
    """
    kept = [t for t in record.times if window <= 0 or t > now - window]
    kept.append(now)
    kept = sorted(kept)[-min(MAX_TIMES, budget + 1) :]
    counted = total + 1 if window <= 0 else len(kept)
    return Spent(BudgetRecord(tuple(kept), record.leaves), counted, counted > budget)


@dataclass(frozen=True, slots=True)
class Transition:
    """What closing a round does to the run's budget (:func:`account`)."""

    kind: str
    """:data:`FAILURE`, :data:`LEAVE` or :data:`SCALE` (:func:`transition_kind`)."""
    record: BudgetRecord
    """The ``budget`` record after the transition."""
    marks_used: tuple[str, ...]
    """Leave marks (``left/<node>``) of members that left with this transition: counted, then deleted."""
    in_window: int = 0
    """For a failure: failures in the window, this one included."""
    exhausted: bool = False
    """A failure beyond the budget: the run stops instead of closing the round."""

    @property
    def failure(self) -> bool:
        return self.kind == FAILURE

    @property
    def writes(self) -> bool:
        """Whether the ``budget`` record changes (written in the round's transaction)."""
        return self.failure or bool(self.marks_used)


def account(
    *,
    previous: Collection[str],
    members: Collection[str],
    joiners: Iterable[Joiner],
    live: Collection[str],
    left_nodes: Collection[str],
    record: BudgetRecord,
    now: float,
    budget: int,
    window: float,
    total: int,
) -> Transition:
    """The budget's side of closing a round (pure: the closing node feeds it what its view holds).

    Args:
        previous: members of the last round.
        members: members of the round being closed.
        joiners: the join requests it closes on.
        live: nodes with a lease.
        left_nodes: nodes with a leave mark.
        record: the run's ``budget`` record.
        now: the closing node's ``time.time()``.
        budget: failures the run may survive in any ``window`` seconds.
        window: the sliding window (0: the run's whole life).
        total: failures the run spent over its life (the ``failures`` key).
    """
    joiners = list(joiners)
    kind = transition_kind(previous, members, joiners, live, left_nodes)
    member_set, gone_cleanly = set(members), set(left_nodes)
    used = tuple(n for n in previous if n in gone_cleanly and n not in member_set)
    if kind != FAILURE:
        return Transition(kind, BudgetRecord(record.times, record.leaves + len(used)), used)
    spent = spend(record, now=now, budget=budget, window=window, total=total)
    after = BudgetRecord(spent.record.times, record.leaves + len(used))
    return Transition(kind, after, used, spent.in_window, spent.exhausted)


def left(record: BudgetRecord, *, now: float, budget: int, window: float, total: int) -> int:
    """Failures the run may still survive at ``now``."""
    used = total if window <= 0 else record.in_window(now, window)
    return max(0, budget - used)


def window_text(window: float) -> str:
    """``1h``, ``30m``, ``45s``, ``2d``: a window for one line."""
    for unit, seconds in (("d", 86400), ("h", 3600), ("m", 60)):
        if window >= seconds and window % seconds == 0:
            return f"{int(window // seconds)}{unit}"
    return f"{window:g}s"


def transition_kind(
    previous: Collection[str],
    members: Collection[str],
    joiners: Iterable[Joiner],
    live: Collection[str],
    left_nodes: Collection[str],
) -> str:
    """What moves the run from its last round (``previous``) to the one being closed (``members``).

    - A member of ``previous`` that is neither in the new round nor alive, and did not say it leaves
      (``left_nodes``): it was lost (kill -9, a crash, a machine gone): a **failure**.
    - Otherwise, a member that left cleanly: a **leave**, whatever the others' join keys say. Its workers
      stopping breaks the survivors' collectives, and their agents may re-join as "failure" or "lost" before
      they see the leave: that is the leave's doing, not a failure of theirs. (A crash that coincides with a
      leave is folded into it, as two crashes in one transition count once.)
    - Otherwise a joiner that re-joins because its workers failed or a member was lost: a **failure**.
    - Otherwise (newcomers, members re-joining to admit them): a **scale** change.
    """
    member_set, live_set, gone_cleanly = set(members), set(live), set(left_nodes)
    departed = [p for p in previous if p not in member_set and p not in live_set]
    if any(p not in gone_cleanly for p in departed):
        return FAILURE
    if departed:
        return LEAVE
    if any(j.reason in FAILURE_REASONS for j in joiners):
        return FAILURE
    return SCALE
