"""What a flagged node leads to: evicted or kept (and why), and an evicted node's probation."""

from __future__ import annotations

import pytest

from elastic_train.config import load_job_config
from elastic_train.errors import ConfigError
from elastic_train.straggler.config import StragglerConfig
from elastic_train.straggler.policy import (
    KEPT_BUDGET,
    KEPT_MIN_NODES,
    KEPT_REPORT,
    changed,
    decide_evictions,
    judge_probation,
)
from elastic_train.straggler.record import StragglerRecord

EVICT = StragglerConfig(policy="evict", max_evictions=1, eviction_window=600.0)


def decide(flagged, world=4, min_nodes=1, evicted_at=(), now=1000.0, cfg=EVICT):  # type: ignore[no-untyped-def]
    return [
        (d.event, d.node, d.why)
        for d in decide_evictions(
            flagged=flagged, world=world, min_nodes=min_nodes, evicted_at=evicted_at, now=now, cfg=cfg
        )
    ]


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


def test_a_decision_is_one_event_until_it_changes() -> None:
    first = decide_evictions(flagged=[("a", 2.0)], world=2, min_nodes=2, evicted_at=[], now=0.0, cfg=EVICT)
    previous = {d.node: d for d in first}
    again = decide_evictions(flagged=[("a", 2.1)], world=2, min_nodes=2, evicted_at=[], now=1.0, cfg=EVICT)
    assert changed(previous, again) == []
    later = decide_evictions(flagged=[("a", 2.1)], world=3, min_nodes=2, evicted_at=[], now=2.0, cfg=EVICT)
    assert [d.event for d in changed(previous, later)] == ["straggler_evict"]
    f = later[0].fields()
    assert f["world"] == 3 and f["min_nodes"] == 2 and f["evictions_in_window"] == 0 and f["score"] == 2.1


PROBE = StragglerConfig(policy="evict", clear_below=1.2, probation_probes=3, probation_seconds=10.0,
                        probation_max_seconds=60.0)  # fmt: skip


@pytest.mark.parametrize(
    ("probes", "elapsed", "action", "healthy"),
    [
        ([], 5.0, "wait", 0),
        ([1.0, 1.0, 1.0], 5.0, "wait", 3),  # healthy, but not on probation long enough
        ([1.0, 1.0, 1.0], 10.0, "readmit", 3),
        ([1.0, 1.0, 2.0, 1.0, 1.0], 30.0, "wait", 2),  # a slow probe starts the count again
        ([2.0, 2.0], 60.0, "leave", 0),
        ([1.0, 1.0, 1.0], 60.0, "readmit", 3),  # healthy at the deadline: readmitted, not sent away
    ],
)
def test_probation(probes: list[float], elapsed: float, action: str, healthy: int) -> None:
    p = judge_probation(
        node="x", probes=probes, reference_s=1.1, started=100.0, now=100.0 + elapsed, cfg=PROBE
    )
    assert (p.action, p.healthy_probes) == (action, healthy)
    assert (
        p.event
        == {"wait": "straggler_probation", "readmit": "straggler_readmit", "leave": "straggler_leave"}[action]
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("straggler: {policy: kill}", "straggler.policy: 'kill' is not one of 'off', 'report', 'evict'"),
        ("straggler: {threshold: 1.0}", "straggler.threshold: 1 must be above 1"),
        (
            "straggler: {threshold: 1.5, clear_below: 1.6}",
            "straggler.clear_below: 1.6 must be at least 1 and below",
        ),
        ("straggler: {window: 0}", "straggler.window: 0 must be >= 1 step"),
        ("straggler: {probation_seconds: 9, probation_max_seconds: 5}", "straggler.probation_max_seconds: 5"),
        ("straggler: {evict: true}", "straggler.evict: unknown key"),
    ],
)
def test_bad_settings_are_one_line(tmp_path, text: str, message: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_job_config(str(path), environ={})
    assert message in str(info.value) and "\n" not in str(info.value)


def test_the_default_reports_and_evict_is_one_key(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert load_job_config(None, environ={}).straggler.policy == "report"
    assert load_job_config(None, {"straggler.policy": "evict"}, environ={}).straggler.policy == "evict"


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
