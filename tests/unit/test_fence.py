"""The fencing rule (pure) and the worker's step counter as its agent reads it."""

from __future__ import annotations

import os

from elastic_train.agentlink import CURRENT, AgentLink, clear_beats, read_beats
from elastic_train.rendezvous.fence import FENCE_GRACE, STALL_MIN, fence_reason

TTL = 3.0


def test_a_lost_lease_fences_at_once() -> None:
    assert fence_reason(lease_lost=True, etcd_silent_s=0.0, stalled_s=0.0, ttl=TTL) == "lease_lost"


def test_etcd_silence_alone_never_fences_while_steps_complete() -> None:
    # etcd down for everyone: no world can form without this node, training goes on
    assert fence_reason(lease_lost=False, etcd_silent_s=600.0, stalled_s=0.1, ttl=TTL) is None


def test_a_stall_alone_never_fences_while_etcd_answers() -> None:
    assert fence_reason(lease_lost=False, etcd_silent_s=0.5, stalled_s=600.0, ttl=TTL) is None


def test_silent_and_stalled_past_ttl_and_grace_fences() -> None:
    limit = TTL + FENCE_GRACE
    assert fence_reason(lease_lost=False, etcd_silent_s=limit - 0.01, stalled_s=limit, ttl=TTL) is None
    assert fence_reason(lease_lost=False, etcd_silent_s=limit, stalled_s=limit - 0.01, ttl=TTL) is None
    assert fence_reason(lease_lost=False, etcd_silent_s=limit, stalled_s=limit, ttl=TTL) == "cut_off"


def test_workers_that_count_no_steps_are_only_fenced_by_a_lost_lease() -> None:
    assert fence_reason(lease_lost=False, etcd_silent_s=600.0, stalled_s=None, ttl=TTL) is None
    assert fence_reason(lease_lost=True, etcd_silent_s=0.0, stalled_s=None, ttl=TTL) == "lease_lost"


def test_once_a_step_time_is_known_a_short_stall_fences_a_silent_node() -> None:
    kw = dict(lease_lost=False, etcd_silent_s=TTL + FENCE_GRACE, ttl=TTL)
    assert fence_reason(stalled_s=STALL_MIN - 0.01, step_s=0.05, **kw) is None  # type: ignore[arg-type]
    assert fence_reason(stalled_s=STALL_MIN, step_s=0.05, **kw) == "cut_off"  # type: ignore[arg-type]
    # slow steps are not a stall: four step times
    assert fence_reason(stalled_s=3.9, step_s=1.0, **kw) is None  # type: ignore[arg-type]
    assert fence_reason(stalled_s=4.0, step_s=1.0, **kw) == "cut_off"  # type: ignore[arg-type]


def test_step_counters_round_trip_and_clear(tmp_path) -> None:
    link = AgentLink(str(tmp_path), 7)
    for _ in range(5):
        link.beat()
    assert read_beats(str(tmp_path)) == {os.getpid(): 5}
    link.close()
    clear_beats(str(tmp_path))
    assert read_beats(str(tmp_path)) == {}


def test_without_an_agent_nothing_is_counted_and_publishing_is_allowed(tmp_path) -> None:
    link = AgentLink(None, None)
    link.beat()
    assert link.may_publish() == CURRENT and not link.fenced
    assert AgentLink(str(tmp_path), 3).may_publish() == "unknown"  # an agent dir without a gate: unconfirmed


def test_workers_blocked_needs_step_counters_and_a_stall() -> None:
    import time

    from elastic_train.rendezvous.fence import STALL_MIN, Fence, _Progress

    fence = Fence.__new__(Fence)
    fence.ttl = 2.0
    now = time.monotonic()
    fence._progress = _Progress({}, now - 100)
    assert not fence.workers_blocked()  # nothing counts steps: nothing to tell
    fence._progress = _Progress({1: 5}, now, step_s=0.1)
    assert not fence.workers_blocked()  # a step just finished
    fence._progress = _Progress({1: 5}, now - STALL_MIN - 0.1, step_s=0.1)
    assert fence.workers_blocked()  # four step times are shorter than the floor: the floor counts
    fence._progress = _Progress({1: 5}, now - STALL_MIN - 0.1, step_s=1.0)
    assert not fence.workers_blocked()  # slow steps are not a stall
    fence._progress = _Progress({1: 5}, now - 2.0)
    assert not fence.workers_blocked() and fence.ttl + 0.5 > 2.0  # no step time yet: a TTL and the grace
