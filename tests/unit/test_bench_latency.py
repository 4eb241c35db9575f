"""rdzv_latency.py's figures: seconds per backend and delay with the ratio to etcd3, and the leader kills."""

from __future__ import annotations

from typing import Any

from tests.unit.bench_scripts import load


def doc() -> dict[str, Any]:
    """rdzv_latency.py's document of raw results: two backends at two delays, two leader kills."""

    def cell(*secs: float | None) -> dict:
        samples = [
            {"status": "ok", "seconds": s, "cap": 60.0} if s is not None else {"status": "timeout", "cap": 60}
            for s in secs
        ]
        return {"samples": samples, "summary": load("harness").summarize(samples)}

    kills = [
        {"status": "ok", "seconds": 0.1, "cap": 60.0, "restarted": False, "worlds_after": [3]},
        {"status": "ok", "seconds": 2.0, "cap": 60.0, "restarted": True, "worlds_after": [3]},
    ]
    return {
        "benchmark": "rdzv_latency", "machine": {"loadavg": [1.0]}, "loadavg_end": [1.0],
        "settings": {"delays_ms": [0, 100], "repeats": 2, "cap": 60.0},
        "recovery": {
            "etcd3": {"0": cell(1.5, 2.5), "100": cell(3.0, 4.0)},
            "c10d-tuned": {"0": cell(10.0, None), "100": cell(None, None)},
        },
        "leader_kill": {"samples": kills, "summary": load("harness").summarize(kills)},
    }  # fmt: skip


def test_latency_table_with_ratios_and_leader_kill() -> None:
    out = load("rdzv_latency").summary(doc())
    etcd3, c10d = out["figures"]
    assert etcd3 == {"backend": "etcd3", "0 ms": "2 (1.5-2.5), 2/2 ok", "100 ms": "3.5 (3-4), 2/2 ok"}
    assert c10d["0 ms"] == "> 60 (10-> 60), 1/2 ok<br>etcd3 >= 30.0x faster"  # a censored median: a bound
    assert c10d["100 ms"] == "> 60 (60-> 60), 0/2 ok<br>etcd3 >= 17.1x faster"
    (kills,) = out["tables"]
    assert "workers restarted in 1 of them" in kills["caption"]
    assert kills["rows"][1] == {
        "kill": 2, "status": "ok", "seconds to next step": 2.0, "workers restarted": "yes",
        "world sizes after": [3],
    }  # fmt: skip
    assert load("report")._problem("rdzv_latency", out) == ""


def test_a_run_without_a_recovery_sample_measured_nothing() -> None:
    empty = doc() | {"recovery": {"etcd3": {"0": {"samples": []}}}, "leader_kill": {"samples": []}}
    out = load("rdzv_latency").summary(empty)
    assert out["figures"] == [{"backend": "etcd3"}] and out["tables"] == []
