"""The failure budget for long jobs: what a transition is, the sliding window, the record read from etcd."""

from __future__ import annotations

import json
import signal

import pytest

from elastic_train.rendezvous import budget
from elastic_train.rendezvous.budget import FAILURE, LEAVE, SCALE, BudgetRecord, spend, transition_kind
from elastic_train.rendezvous.decide import Joiner
from elastic_train.rendezvous.leave import LeaveOnSignal, left_ttl


def j(node: str, reason: str = "scale") -> Joiner:
    return Joiner(node, 2, reason, 0)


# (previous round, new members, joiners with their reasons, live nodes, nodes that left cleanly) -> kind
TRANSITIONS = {
    "workers failed on a member": (
        ["a", "b"], ["a", "b"], [j("a", "failure"), j("b")], ["a", "b"], [], FAILURE,
    ),
    "a member lost, both saw it": (
        ["a", "b", "c"], ["a", "b"], [j("a", "lost"), j("b", "lost")], ["a", "b"], [], FAILURE,
    ),
    "a member vanished, nobody said": (
        ["a", "b", "c"], ["a", "b"], [j("a"), j("b")], ["a", "b"], [], FAILURE,
    ),
    "scale up": (["a", "b"], ["a", "b", "d"], [j("a"), j("b"), j("d", "start")], ["a", "b", "d"], [], SCALE),
    "first round": ([], ["a", "b"], [j("a", "start"), j("b", "start")], ["a", "b"], [], SCALE),
    "a clean leave": (["a", "b", "c"], ["a", "b"], [j("a"), j("b")], ["a", "b"], ["c"], LEAVE),
    # the survivors' collectives broke when c's workers stopped: their agents re-join as failure/lost
    "a clean leave seen as a failure by the survivors": (
        ["a", "b", "c"], ["a", "b"], [j("a", "failure"), j("b", "lost")], ["a", "b"], ["c"], LEAVE,
    ),
    "a leave and a crash at once": (["a", "b", "c"], ["a"], [j("a", "lost")], ["a"], ["c"], FAILURE),
    "a mark of a node that was not a member": (
        ["a", "b"], ["a", "b"], [j("a", "failure"), j("b")], ["a", "b"], ["x"], FAILURE,
    ),
    "a leaver's peer re-joins, replaced": (
        ["a", "b"], ["a", "e"], [j("a", "lost"), j("e", "start")], ["a", "e"], ["b"], LEAVE,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(TRANSITIONS))
def test_transition_kind(case: str) -> None:
    previous, members, joiners, live, left, kind = TRANSITIONS[case]
    assert transition_kind(previous, members, joiners, live, left) == kind


HOUR = 3600.0


# (failure times in the record, now, budget, window, failures before) -> (in window after, exhausted)
SPENDS = {
    "fresh run": ((), 1000.0, 10, HOUR, 0, 1, False),
    "budget 0 stops at the first failure": ((), 1000.0, 0, HOUR, 0, 1, True),
    "the tenth of ten in the hour": (tuple(float(t) for t in range(9)), 100.0, 10, HOUR, 9, 10, False),
    "the eleventh in the hour": (tuple(float(t) for t in range(10)), 100.0, 10, HOUR, 10, 11, True),
    "old failures are forgotten": (tuple(float(t) for t in range(10)), 10 + HOUR, 10, HOUR, 500, 1, False),
    "half of them old": ((0.0, 1.0, 2000.0, 3000.0), 4000.0, 3, HOUR, 4, 3, False),
    "a time ahead of this clock counts": ((5000.0,), 4000.0, 1, HOUR, 1, 2, True),
    "no window: the run's whole life": ((0.0,), 10 * HOUR, 10, 0.0, 10, 11, True),
    "no window, within the budget": ((), 10 * HOUR, 10, 0.0, 3, 4, False),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(SPENDS))
def test_spend(case: str) -> None:
    times, now, allowed, window, total, in_window, exhausted = SPENDS[case]
    out = spend(BudgetRecord(times, leaves=4), now=now, budget=allowed, window=window, total=total)
    assert (out.in_window, out.exhausted) == (in_window, exhausted)
    assert out.record.leaves == 4 and now in out.record.times
    assert len(out.record.times) <= allowed + 1
    after = budget.left(out.record, now=now, budget=allowed, window=window, total=total + 1)
    assert after == max(0, allowed - in_window)


def test_a_long_job_outlives_any_fixed_budget_at_a_steady_churn() -> None:
    """One failure every 20 minutes for 30 days (2160 failures) never spends a budget of 10 per hour, while a
    crash loop (one every 30 s) spends it within six minutes."""
    record, total = BudgetRecord(), 0
    for i in range(30 * 24 * 3):
        out = spend(record, now=i * 1200.0, budget=10, window=HOUR, total=total)
        assert not out.exhausted
        record, total = out.record, total + 1
    assert len(record.times) <= 11
    record, total, t = BudgetRecord(), 0, 0.0
    while not (out := spend(record, now=t, budget=10, window=HOUR, total=total)).exhausted:
        record, total, t = out.record, total + 1, t + 30.0
    assert total == 10 and t <= 360.0


@pytest.mark.parametrize(
    "raw",
    [
        None,
        b"",
        b"7",
        b"[]",
        b"\xff",
        b'{"times": "x", "leaves": -1}',
        b'{"times": [1, "a", null, 1e999, true]}',
    ],
)
def test_a_malformed_record_reads_as_what_it_can(raw: bytes | None) -> None:
    rec = BudgetRecord.decode(raw)
    assert rec.leaves == 0 and all(isinstance(t, float) for t in rec.times)


def test_record_round_trips() -> None:
    rec = BudgetRecord((1.5, 2.25), leaves=3)
    assert BudgetRecord.decode(rec.encode()) == rec
    assert json.loads(rec.encode()) == {"times": [1.5, 2.25], "leaves": 3}


def test_window_text() -> None:
    assert [budget.window_text(w) for w in (3600, 1800, 86400 * 2, 45, 90)] == [
        "1h",
        "30m",
        "2d",
        "45s",
        "90s",
    ]


def test_a_leave_mark_outlives_the_survivors_wait_for_a_replacement() -> None:
    assert left_ttl(600) == 3600 and left_ttl(3000) == 6000


def test_leave_on_signal_runs_once_then_the_previous_handler() -> None:
    calls: list[str] = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: calls.append("previous"))
    try:
        hook = LeaveOnSignal(lambda why: calls.append(f"leave {why}"), signal.SIGUSR1)
        hook.arm()
        hook.arm()  # already wrapped: nothing changes
        signal.raise_signal(signal.SIGUSR1)
        signal.raise_signal(signal.SIGUSR1)
        assert calls == ["leave SIGUSR1", "previous", "previous"]
        # the agent installs its own handler again when it restarts workers: arm wraps that one
        signal.signal(signal.SIGUSR1, lambda *_: calls.append("agent"))
        hook.arm()
        signal.raise_signal(signal.SIGUSR1)
        assert calls[-1] == "agent" and calls.count("leave SIGUSR1") == 1
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_failing_leave_never_keeps_the_node_from_stopping() -> None:
    calls: list[str] = []

    def boom(_why: str) -> None:
        raise RuntimeError("etcd gone")

    previous = signal.signal(signal.SIGUSR2, lambda *_: calls.append("previous"))
    try:
        LeaveOnSignal(boom, signal.SIGUSR2).arm()
        signal.raise_signal(signal.SIGUSR2)
        assert calls == ["previous"]
    finally:
        signal.signal(signal.SIGUSR2, previous)
