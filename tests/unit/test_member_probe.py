"""The closing agent's probe of members that have not asked for the next round (``Participant._known_gone``):
a member whose store port refuses is gone; one whose port accepted is probed again a little later (a
killed agent's port may accept while the kernel tears the process down); one that did not answer is
probed once (a stopped node is left to its lease)."""

from __future__ import annotations

import time

import pytest

from elastic_train.rendezvous import protocol
from elastic_train.rendezvous.protocol import JoinState, Participant, RoundRecord


def participant(answers: dict[str, list[str]], calls: list[str]) -> Participant:
    p = Participant.__new__(Participant)
    p.node_id = "me"

    def probe(node: str) -> str:
        calls.append(node)
        return answers[node].pop(0) if len(answers[node]) > 1 else answers[node][0]

    p._probe = probe  # type: ignore[method-assign]
    return p


def closing(
    monkeypatch: pytest.MonkeyPatch, interval: float, answers: dict[str, list[str]]
) -> tuple[Participant, JoinState, RoundRecord, set[str], list[str]]:
    """A closer of round 3 whose last round's other members answer their probes with ``answers`` (in turn),
    accepted ports probed again after ``interval``; its probe calls are recorded."""
    monkeypatch.setattr(protocol, "REPROBE_INTERVAL", interval)
    calls: list[str] = []
    rec = RoundRecord(2, ["me", *answers])
    state = JoinState(target=3, reason="lost", deadline=time.monotonic() + 60)
    return participant(answers, calls), state, rec, set(rec.members), calls


def test_an_accepting_port_is_probed_again_until_it_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    p, state, rec, live, calls = closing(
        monkeypatch, 0.05, {"dying": ["accepted", "accepted", "refused"], "stopped": ["unknown"]}
    )
    assert p._known_gone(state, rec, live, {}) == set()
    assert p._known_gone(state, rec, live, {}) == set()  # within the interval: not probed again
    assert calls == ["dying", "stopped"]
    gone: set[str] = set()
    deadline = time.monotonic() + 5
    while not gone and time.monotonic() < deadline:
        time.sleep(0.06)
        gone = p._known_gone(state, rec, live, {})
    assert gone == {"dying"}
    assert calls.count("stopped") == 1, calls  # no answer: probed once, left to its lease
    assert calls.count("dying") == 3, calls
    assert p._known_gone(state, rec, live, {}) == {"dying"} and calls.count("dying") == 3  # gone stays gone
    state.missed(3)  # a new target round probes afresh
    assert not state.probed and not state.reprobe


def test_the_closer_waits_no_longer_than_the_next_reprobe(monkeypatch: pytest.MonkeyPatch) -> None:
    p, state, rec, live, calls = closing(
        monkeypatch, 0.5, {"dying": ["accepted", "accepted", "unknown"], "gone": ["refused"]}
    )
    assert state.reprobe_in(time.monotonic()) is None  # nothing probed yet
    assert p._known_gone(state, rec, live, {}) == {"gone"}
    now = time.monotonic()
    due = state.reprobe_in(now)
    assert due is not None and 0.4 < due <= 0.5  # "dying" accepted: due again within the interval
    assert state.reprobe_in(now + 0.6) == 0.0  # overdue: at once
    state.reprobe["dying"] = now  # due now: probed again, accepts again, due again an interval later
    assert p._known_gone(state, rec, live, {}) == {"gone"} and calls.count("dying") == 2
    assert 0.4 < (state.reprobe_in(time.monotonic()) or 0.0) <= 0.5
    state.reprobe["dying"] = time.monotonic()  # due: no answer this time, left to its lease
    assert p._known_gone(state, rec, live, {}) == {"gone"} and calls.count("dying") == 3
    assert state.reprobe_in(time.monotonic()) is None
    assert p._known_gone(state, rec, live, {}) == {"gone"} and calls.count("dying") == 3  # not probed again
