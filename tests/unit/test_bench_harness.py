"""Pure parts of the benchmark harness: progress parsing, first-step search, censored statistics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.bench_scripts import load

harness = load("harness")


def step(t: float, world: int, rank: int = 0, event: str = "step") -> dict:
    return {"event": event, "time": t, "world_size": world, "rank": rank, "step": 1}


def ok(seconds: float, cap: float = 90.0) -> dict:
    return {"status": "ok", "seconds": seconds, "cap": cap}


def timeout(cap: float = 90.0) -> dict:
    return {"status": "timeout", "seconds": None, "cap": cap}


def test_progress_reader_reads_only_complete_lines_incrementally(tmp_path: Path) -> None:
    reader = harness.ProgressReader(str(tmp_path))
    f = tmp_path / "node0-pid1.jsonl"
    f.write_bytes(json.dumps(step(1.0, 3)).encode() + b"\n" + b'{"event": "st')
    assert [r["time"] for r in reader.poll()] == [1.0]
    with f.open("ab") as fh:
        fh.write(b'ep", "time": 2.0, "world_size": 2, "rank": 0}\n')
    (tmp_path / "ignored.txt").write_text("{}\n")
    new = reader.poll()
    assert [(r["time"], r["world_size"]) for r in new] == [(2.0, 2)]
    assert reader.poll() == []
    assert len(reader.records) == 2


def test_progress_reader_missing_directory(tmp_path: Path) -> None:
    assert harness.ProgressReader(str(tmp_path / "nope")).poll() == []


def test_first_step_at_filters_world_event_and_time() -> None:
    records = [
        step(5.0, 3),
        step(9.0, 2, event="pg"),
        step(11.0, 2, rank=1),
        step(10.0, 2),
        step(8.0, 2),  # before the event
    ]
    assert harness.first_step_at(records, 2, after=9.0) == 10.0
    assert harness.first_step_at(records, 4, after=0.0) is None


def test_phases_reports_first_of_each_event_after_origin() -> None:
    records = [
        step(10.5, 2, event="start"),
        step(10.2, 2, event="start", rank=1),
        step(12.0, 2, event="pg"),
        step(12.1, 2),
        step(8.0, 2, event="start"),  # before
    ]
    assert harness.phases(records, 2, after=10.0) == {
        "workers_started": 0.2,
        "all_started": 0.5,
        "imported": None,
        "pg_ready": 2.0,
        "first_step": 2.1,
    }
    assert harness.phases(records, 4, after=10.0)["first_step"] is None


def test_summarize_all_ok_odd_and_even() -> None:
    s = harness.summarize([ok(3.0), ok(1.0), ok(2.0)])
    assert (s["n"], s["ok"], s["median"], s["min"], s["max"]) == (3, 3, 2.0, 1.0, 3.0)
    assert not s["median_censored"] and not s["max_censored"]
    assert harness.summarize([ok(1.0), ok(2.0)])["median"] == 1.5


def test_summarize_censors_failures_above_cap() -> None:
    s = harness.summarize([ok(5.0), timeout(), timeout()])
    assert s["median_censored"] and s["median"] == 90.0
    assert s["min"] == 5.0 and s["max_censored"] and s["ok"] == 1
    s = harness.summarize([ok(5.0), ok(6.0), timeout()])
    assert not s["median_censored"] and s["median"] == 6.0 and s["max_censored"]


def test_summarize_ignores_not_run_and_handles_empty() -> None:
    s = harness.summarize([{"status": "not_run", "cap": None}])
    assert s["n"] == 0 and s["median"] is None
    assert harness.format_summary(s) == "not measured"


def test_speedup_plain_lower_bound_and_unusable() -> None:
    ours = harness.summarize([ok(2.0)])
    assert harness.speedup(harness.summarize([ok(20.0)]), ours) == {"ratio": 10.0, "lower_bound": False}
    assert harness.speedup(harness.summarize([timeout(60.0)]), ours) == {"ratio": 30.0, "lower_bound": True}
    assert harness.speedup(ours, harness.summarize([timeout()])) is None
    assert harness.speedup(harness.summarize([]), ours) is None


@pytest.mark.parametrize(
    ("samples", "expected"),
    [
        ([ok(3.214)], "3.21 s (1/1)"),
        ([ok(3.0), ok(2.0), timeout()], "3.00 s [2.00, >90] (2/3)"),
        ([timeout(), timeout()], "> 90 s (0/2)"),
    ],
)
def test_format_summary(samples: list[dict], expected: str) -> None:
    assert harness.format_summary(harness.summarize(samples)) == expected


def test_format_ratio() -> None:
    assert harness.format_ratio(None) == "-"
    assert harness.format_ratio({"ratio": 4.25, "lower_bound": False}) == "4.2x"
    assert harness.format_ratio({"ratio": 9.1, "lower_bound": True}) == ">= 9.1x"


def test_configs_tuned_baselines_use_the_honest_settings() -> None:
    tuned = harness.CONFIGS["c10d-tuned"]
    assert tuned.rdzv_conf["last_call_timeout"] == "1"
    assert tuned.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert harness.CONFIGS["c10d"].endpoint_kind == "tcpstore"
    assert harness.CONFIGS["etcd-v2"].endpoint_kind == "etcd"
    assert harness.CONFIGS["etcd3"].ours and not harness.CONFIGS["etcd-v2"].ours


def test_job_command_is_loopback_with_same_agent_settings(tmp_path: Path) -> None:
    job = harness.Job(harness.CONFIGS["c10d-tuned"], workdir=str(tmp_path))
    cmd = job.command()
    assert "--local-addr=127.0.0.1" in cmd
    assert f"--monitor-interval={harness.MONITOR_INTERVAL}" in cmd
    assert f"--max-restarts={harness.MAX_RESTARTS}" in cmd
    assert any(a.startswith("--rdzv-endpoint=127.0.0.1:") for a in cmd)
    assert "--rdzv-conf=last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3" in cmd
    env = job.env("0")
    assert env["GLOO_SOCKET_IFNAME"] == "lo" and env["MASTER_ADDR"] == "127.0.0.1"
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert env["BENCH_NODE"] == "0"
