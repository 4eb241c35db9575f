"""What a flagged node leads to: evicted or kept (and why), and an evicted node's probation."""

from __future__ import annotations

import json

import pytest

from elastic_train.config import load_job_config
from elastic_train.errors import ConfigError
from elastic_train.rendezvous.slownodes import evicted_nodes, eviction_times, eviction_total
from elastic_train.straggler.config import StragglerConfig
from elastic_train.straggler.policy import (
    KEPT_BUDGET,
    KEPT_MIN_NODES,
    KEPT_REPORT,
    KEPT_RESTART,
    changed,
    decide_evictions,
    probation,
)
from elastic_train.straggler.record import StragglerRecord

EVICT = StragglerConfig(policy="evict", max_evictions=1, eviction_window=600.0)


def decide(flagged, world=4, min_nodes=1, evicted_at=(), now=1000.0, cfg=EVICT, on_trial=()):  # type: ignore[no-untyped-def]
    return [
        (d.event, d.node, d.why)
        for d in decide_evictions(
            flagged=flagged, world=world, min_nodes=min_nodes, evicted_at=evicted_at, now=now, cfg=cfg,
            on_trial=on_trial,
        )
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"cfg": StragglerConfig()}, [("straggler_kept", "a", KEPT_REPORT)]),
        ({}, [("straggler_evict", "a", "policy is evict")]),
        ({"world": 2, "min_nodes": 2}, [("straggler_kept", "a", KEPT_MIN_NODES)]),
        ({"evicted_at": [500.0]}, [("straggler_kept", "a", KEPT_BUDGET)]),
        ({"evicted_at": [300.0]}, [("straggler_evict", "a", "policy is evict")]),  # out of the window
    ],
)
def test_one_flagged_node(kwargs, expected) -> None:  # type: ignore[no-untyped-def]
    assert decide([("a", 2.0)], **kwargs) == expected


def test_worst_first_within_the_bounds() -> None:
    two = StragglerConfig(policy="evict", max_evictions=2)
    assert decide([("a", 1.6), ("b", 3.0), ("c", 2.0)]) == [
        ("straggler_evict", "b", "policy is evict"),
        ("straggler_kept", "c", KEPT_BUDGET),
        ("straggler_kept", "a", KEPT_BUDGET),
    ]
    assert decide([("a", 1.6), ("b", 3.0), ("c", 2.0)], world=4, min_nodes=2, cfg=two) == [
        ("straggler_evict", "b", "policy is evict"),
        ("straggler_evict", "c", "policy is evict"),
        ("straggler_kept", "a", KEPT_MIN_NODES),
    ]


def test_a_node_back_on_trial_is_evicted_again_without_spending_the_budget() -> None:
    """A node still slow after its probation goes out again although the window's budget is spent (it
    returns the job to where it was before the trial; ``max_trials`` bounds how often), and its eviction
    leaves the budget to another node."""
    evict = ("straggler_evict", "a", "policy is evict")
    assert decide([("a", 3.0)], evicted_at=[900.0], on_trial={"a"}) == [evict]
    assert decide([("a", 3.0)], evicted_at=[900.0]) == [("straggler_kept", "a", KEPT_BUDGET)]
    assert decide([("a", 3.0), ("b", 2.0)], on_trial={"a"}) == [
        evict,
        ("straggler_evict", "b", "policy is evict"),
    ]
    assert decide([("a", 3.0), ("b", 2.0)], evicted_at=[900.0], on_trial={"a"}) == [
        evict,
        ("straggler_kept", "b", KEPT_BUDGET),
    ]
    assert decide([("a", 3.0)], world=2, min_nodes=2, on_trial={"a"}) == [
        ("straggler_kept", "a", KEPT_MIN_NODES)
    ]
    never = StragglerConfig(policy="evict", max_evictions=0)  # flag and never evict
    assert decide([("a", 3.0)], on_trial={"a"}, cfg=never) == [("straggler_kept", "a", KEPT_BUDGET)]
    (d,) = decide_evictions(
        flagged=[("a", 3.0)], world=3, min_nodes=1, evicted_at=[900.0], now=1000.0, cfg=EVICT, on_trial={"a"}
    )
    assert d.fields()["trial"] is True and d.fields()["evictions_in_window"] == 1


def test_the_eviction_record_names_the_nodes_evicted_and_reads_bad_entries_as_absent() -> None:
    raw = json.dumps({"times": [1.0], "total": 3, "nodes": ["n1", 7, "", "x" * 300, "n2"]}).encode()
    assert evicted_nodes(raw) == ["n1", "n2"]
    assert eviction_times(raw) == [1.0] and eviction_total(raw) == 3
    for bad in (None, b"", b"[1]", b'{"nodes": "n1"}', b"\xff"):
        assert evicted_nodes(bad) == []


def test_a_decision_is_one_event_until_it_changes() -> None:
    first = decide_evictions(flagged=[("a", 2.0)], world=2, min_nodes=2, evicted_at=[], now=0.0, cfg=EVICT)
    previous = {d.node: d for d in first}
    again = decide_evictions(flagged=[("a", 2.1)], world=2, min_nodes=2, evicted_at=[], now=1.0, cfg=EVICT)
    assert changed(previous, again) == []
    later = decide_evictions(flagged=[("a", 2.1)], world=3, min_nodes=2, evicted_at=[], now=2.0, cfg=EVICT)
    assert [d.event for d in changed(previous, later)] == ["straggler_evict"]
    f = later[0].fields()
    assert f["world"] == 3 and f["min_nodes"] == 2 and f["evictions_in_window"] == 0 and f["score"] == 2.1


TRIALS = StragglerConfig(policy="evict", probation_seconds=10.0, max_trials=3)


@pytest.mark.parametrize(
    ("evictions", "action", "wait"),
    [(1, "wait", 10.0), (2, "wait", 20.0), (3, "leave", 0.0), (4, "leave", 0.0)],
)
def test_probation_doubles_until_the_node_leaves(evictions: int, action: str, wait: float) -> None:
    p = probation(node="x", evictions=evictions, cfg=TRIALS)
    assert (p.action, p.wait_s) == (action, wait)
    assert p.event == {"wait": "straggler_probation", "leave": "straggler_leave"}[action]
    assert p.fields()["evictions"] == evictions and p.fields()["max_trials"] == 3


def test_no_eviction_while_a_member_would_restart() -> None:
    d = decide_evictions(flagged=[("a", 2.0)], world=3, min_nodes=1, evicted_at=[], now=0.0, cfg=EVICT,
                         in_process=False)  # fmt: skip
    assert [(x.event, x.why) for x in d] == [("straggler_kept", KEPT_RESTART)]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "rendezvous: {straggler: {policy: kill}}",
            "rendezvous.straggler.policy: 'kill' is not one of 'off', 'report', 'evict'",
        ),
        ("rendezvous: {straggler: {threshold: 1.0}}", "rendezvous.straggler.threshold: 1 must be above 1"),
        (
            "rendezvous: {straggler: {threshold: 1.5, clear_below: 1.6}}",
            "rendezvous.straggler.clear_below: 1.6 must be at least 1 and below",
        ),
        ("rendezvous: {straggler: {window: 0}}", "rendezvous.straggler.window: 0 must be >= 1 report"),
        ("rendezvous: {straggler: {max_trials: 0}}", "rendezvous.straggler.max_trials: 0 must be >= 1"),
        ("rendezvous: {straggler: {evict: true}}", "rendezvous.straggler.evict: unknown key"),
    ],
)
def test_bad_settings_are_one_line(tmp_path, text: str, message: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_job_config(str(path), environ={})
    assert message in str(info.value) and "\n" not in str(info.value)


def test_the_default_reports_and_evict_is_one_key(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert load_job_config(None, environ={}).rendezvous.straggler.policy == "report"
    cfg = load_job_config(None, {"rendezvous.straggler.policy": "evict"}, environ={})
    assert cfg.rendezvous.straggler.policy == "evict"


@pytest.mark.parametrize(
    "raw",
    [b"nope", b"[]", b'{"state": "asleep", "score": 1, "step": 1, "since": 0}',
     b'{"state": "flagged", "score": "high", "step": 1, "since": 0}',
     b'{"state": "flagged", "score": 2.0, "step": true, "since": 0}'],
)  # fmt: skip
def test_a_record_read_back_is_validated(raw: bytes) -> None:
    with pytest.raises(ValueError, match="straggler record of n1"):
        StragglerRecord.decode("n1", raw)


def test_a_record_round_trips_and_reads_as_one_line() -> None:
    rec = StragglerRecord(node="n1", state="evicted", score=2.04, step=120, since=5.0, policy="evict")
    assert StragglerRecord.decode("n1", rec.encode()) == rec
    assert rec.line() == "n1: evicted at step 120 (score 2.04, policy evict)"
