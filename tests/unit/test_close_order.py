"""Who closes a forming round, decided from the run's view: the node expected to close it never waits a
follower's interval because the watch had not shown its own join yet (a scale-up then waited 0.25 s for
nothing), and it closes as soon as its own join is seen."""

from __future__ import annotations

import json
import time

import pytest

from elastic_train.etcd.client import WatchEvent
from elastic_train.rendezvous import protocol
from elastic_train.rendezvous.decide import assign_ranks
from elastic_train.rendezvous.protocol import (
    CloseAttempt,
    JoinState,
    Participant,
    ProtocolSettings,
    RoundRecord,
)
from elastic_train.rendezvous.view import RunView

PREFIX = "/elastic_train/close-order/"


def put(view: RunView, sub: str, value: bytes, revision: int) -> None:
    """What the view's watch does with a put."""
    view._apply([WatchEvent(PREFIX + sub, value, revision, revision, 0)])


def test_the_expected_closer_waits_for_its_own_join_not_a_followers_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(protocol, "JOIN_SHOWN_WAIT", 0.01)  # no watch here to wake it when its join shows
    settings = ProtocolSettings(run_id="close-order", min_nodes=2, max_nodes=3, lease_ttl=2.0, settle=1.0)
    view = RunView(None, PREFIX)  # type: ignore[arg-type]  # filled by hand, never started
    a = Participant(None, settings, addr="127.0.0.1", node_id="a", view=view)  # type: ignore[arg-type]
    rec = RoundRecord(1, ["a", "b"], {})
    put(view, "round", rec.encode(), 10)
    for rev, node in enumerate(["a", "b", "c"], start=11):
        put(view, "nodes/" + node, b"{}", rev)
    join = json.dumps({"target": 2, "reason": "scale"}).encode()
    put(view, "join/c", join, 20)  # the newcomer asked first ...
    put(view, "join/b", join, 21)  # ... then b; a wrote its join, the watch has not shown it yet
    a._join_value, a._join_revision = join, 22
    state = JoinState(target=2, reason="scale", deadline=time.monotonic() + 10)
    now = time.monotonic()
    with view.cond:
        assert a._evaluate(state, rec, 10, now) is None
    assert state.next_eval <= now + protocol.CLOSER_EVAL_INTERVAL  # not a follower's 0.25 s
    put(view, "join/a", join, 22)
    with view.cond:
        attempt = a._evaluate(state, rec, 10, time.monotonic())
    assert isinstance(attempt, CloseAttempt) and set(attempt.joins) == {"a", "b", "c"}


def test_participants_of_one_view_share_one_picture_and_the_expected_closer_never_trusts_a_stale_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    computed = []

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        computed.append(1)
        return assign_ranks(*args, **kwargs)

    monkeypatch.setattr(protocol, "assign_ranks", counting)
    settings = ProtocolSettings(run_id="close-order", min_nodes=3, max_nodes=4, lease_ttl=2.0, settle=1.0)
    view = RunView(None, PREFIX, activity_prefixes=("nodes/", "join/"))  # type: ignore[arg-type]
    monkeypatch.setattr(view, "wait_record", lambda timeout: False)  # nothing would wake a follower here
    monkeypatch.setattr(view.cond, "wait", lambda timeout=None: False)
    ps = {n: Participant(None, settings, addr="127.0.0.1", node_id=n, view=view) for n in "abcd"}  # type: ignore[arg-type]
    rec = RoundRecord(1, ["a", "b", "c", "d"], {})
    put(view, "round", rec.encode(), 10)
    for rev, node in enumerate("abcd", start=11):
        put(view, "nodes/" + node, b"{}", rev)
    join = json.dumps({"target": 2, "reason": "failure"}).encode()
    for rev, node in enumerate("bcd", start=20):
        put(view, "join/" + node, join, rev)
        ps[node]._join_value, ps[node]._join_revision = join, rev
    states = {n: JoinState(target=2, reason="failure", deadline=time.monotonic() + 10) for n in "abcd"}
    now = time.monotonic()
    with view.cond:
        for node in "bcd":
            ps[node]._evaluate(states[node], rec, 10, now)
    assert len(computed) == 1  # one picture for the view
    assert states["b"].next_eval == now + protocol.CLOSER_EVAL_INTERVAL  # a's rank 0 absent: b closes
    assert states["c"].next_eval == states["d"].next_eval == now + protocol.FOLLOWER_EVAL_INTERVAL
    put(view, "join/a", join, 30)
    ps["a"]._join_value, ps["a"]._join_revision = join, 30
    with view.cond:
        ps["c"]._evaluate(states["c"], rec, 10, now + 0.1)  # a join since: the follower's picture stands
        assert len(computed) == 1
        attempt = ps["a"]._evaluate(
            states["a"], rec, 10, now + 0.1
        )  # absent from it, ranked before its first
    assert len(computed) == 2  # a looked at the run as it is now, and closes it (all four asked)
    assert isinstance(attempt, CloseAttempt) and set(attempt.joins) == set("abcd")
