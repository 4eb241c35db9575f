"""The run's view as many participants of one process read it: each value decoded once per change, joins and
departures that wake nobody but the node expected to close the round, and a picture of the forming round that
is shared but never stale by a record or a departure."""

from __future__ import annotations

import json
import threading

from elastic_train.etcd.client import KeyValue, WatchEvent
from elastic_train.rendezvous.view import RunView

PREFIX = "/elastic_train/view/"


def view() -> RunView:
    return RunView(None, PREFIX, activity_prefixes=("nodes/", "join/"))  # type: ignore[arg-type]  # never started


def put(v: RunView, sub: str, value: bytes, revision: int) -> None:
    v._apply([WatchEvent(PREFIX + sub, value, revision, revision, 0)])


def delete(v: RunView, sub: str, revision: int) -> None:
    v._apply([WatchEvent(PREFIX + sub, None, revision, 0, 0)])


def test_a_group_is_decoded_once_per_change_and_bad_values_are_left_out() -> None:
    v, calls = view(), []

    def target(name: str, kv: KeyValue) -> int:
        calls.append(name)
        return int(json.loads(kv.value)["target"])

    put(v, "join/a", b'{"target": 1}', 1)
    put(v, "join/b", b"not json", 2)
    with v.cond:
        assert v.decoded_under("join/", target) == {"a": 1}
        assert v.decoded_under("join/", target) == {"a": 1}
    assert calls == ["a", "b"]
    put(v, "join/c", b'{"target": 2}', 3)
    put(v, "join/a", b'{"target": 3}', 4)
    delete(v, "join/b", 5)
    with v.cond:
        assert v.decoded_under("join/", target) == {"a": 3, "c": 2}
    assert sorted(calls[2:]) == ["a", "c"]  # b was deleted, not decoded again


def test_a_key_is_decoded_once_per_change() -> None:
    v, calls = view(), []

    def decode(raw: bytes) -> int:
        calls.append(raw)
        return int(raw)

    with v.cond:
        assert v.decoded("round", decode) is None
    put(v, "round", b"1", 1)
    with v.cond:
        assert v.decoded("round", decode) == v.decoded("round", decode) == 1
    put(v, "round", b"2", 2)
    with v.cond:
        assert v.decoded("round", decode) == 2
    assert calls == [b"1", b"2"]


def waiter(v: RunView, wait: str, arg: float | int) -> tuple[threading.Thread, threading.Event, list[bool]]:
    """A thread waiting on the view (``wait_record`` or ``wait_revision``) that records whether the view held
    a ``round`` record when it woke; returns once it waits (it holds ``cond`` until then)."""
    ready, seen = threading.Event(), []

    def run() -> None:
        with v.cond:
            ready.set()
            if wait == "record":
                v.wait_record(10.0)
            else:
                v.wait_revision(int(arg), 10.0)
            seen.append(v.get("round") is not None)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert ready.wait(5.0)
    with v.cond:  # free only once the thread waits
        pass
    return t, ready, seen


def test_joins_do_not_wake_a_record_waiter_a_round_does() -> None:
    v = view()
    t, _, seen = waiter(v, "record", 0)
    put(v, "nodes/a", b"{}", 1)
    put(v, "join/a", b'{"target": 1}', 2)
    t.join(0.2)
    assert t.is_alive()
    put(v, "round", b"{}", 3)
    t.join(5.0)
    assert seen == [True]


def test_departures_do_not_wake_a_record_waiter_either() -> None:
    v = view()
    put(v, "nodes/a", b"{}", 1)
    t, _, seen = waiter(v, "record", 0)
    delete(v, "nodes/a", 2)  # a lease expiring; thousands at once when a machine stalls
    t.join(0.2)
    assert t.is_alive()
    put(v, "closed", b"{}", 3)
    t.join(5.0)
    assert seen == [False]


def test_a_revision_waiter_wakes_when_the_view_reaches_it() -> None:
    v = view()
    t, _, seen = waiter(v, "revision", 3)
    put(v, "join/a", b'{"target": 1}', 2)
    t.join(0.2)
    assert t.is_alive()
    put(v, "join/b", b'{"target": 1}', 3)
    t.join(5.0)
    assert seen == [False]
    with v.cond:
        assert v.wait_revision(3, 10.0)  # reached: no wait


def test_a_memo_is_shared_for_its_age_unless_a_record_or_a_departure_changed() -> None:
    v, computed = view(), []

    def compute() -> int:
        computed.append(v.revision)
        return v.revision

    put(v, "nodes/a", b"{}", 1)
    with v.cond:
        assert v.memo("k", compute, max_age=60.0) == 1
        assert v.memo("k", compute) == 1  # same revision
    put(v, "join/a", b'{"target": 1}', 2)
    with v.cond:
        assert v.memo("k", compute, max_age=60.0) == 1  # only a join since: young enough
        assert v.memo("k", compute) == 2  # a reader that wants the view as it is now
    put(v, "join/b", b'{"target": 1}', 3)
    delete(v, "nodes/a", 4)
    with v.cond:
        assert v.memo("k", compute, max_age=60.0) == 4  # a departure: never stale by one
    put(v, "round", b"{}", 5)
    with v.cond:
        assert v.memo("k", compute, max_age=60.0) == 5
    assert computed == [1, 2, 4, 5]
