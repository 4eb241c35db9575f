"""Who closes a forming round, decided from the run's view: the node expected to close it never waits a
follower's interval because the watch had not shown its own join yet (a scale-up then waited 0.25 s for
nothing), and it closes as soon as its own join is seen."""

from __future__ import annotations

import json
import time

from elastic_train.etcd.client import KeyValue
from elastic_train.rendezvous import protocol
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
    kv = KeyValue(PREFIX + sub, value, revision, revision, 0)
    view.keys[kv.key] = kv
    group, _, name = sub.partition("/")
    view._groups.setdefault(group + "/", {})[name] = kv
    view.revision = max(view.revision, revision)


def test_the_expected_closer_waits_for_its_own_join_not_a_followers_interval() -> None:
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
    state = JoinState(target=2, reason="scale", deadline=time.monotonic() + 10)
    now = time.monotonic()
    with view.cond:
        assert a._evaluate(state, rec, 10, now) is None
    assert state.next_eval <= now + protocol.CLOSER_EVAL_INTERVAL  # not a follower's 0.25 s
    put(view, "join/a", join, 22)
    with view.cond:
        attempt = a._evaluate(state, rec, 10, time.monotonic())
    assert isinstance(attempt, CloseAttempt) and set(attempt.joins) == {"a", "b", "c"}
