"""The agent's metrics: workers' stats files, the run's view at scrape time, recovery timing, the endpoint."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from elastic_train.metrics import agent
from elastic_train.metrics.stats import StatsWriter, WorkerStats, read_stats
from elastic_train.rendezvous.budget import BudgetRecord
from elastic_train.rendezvous.observe import RunObserver
from elastic_train.rendezvous.protocol import ProtocolSettings, RoundRecord


@dataclass
class KV:
    value: bytes


@dataclass
class View:
    keys: dict[str, bytes] = field(default_factory=dict)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def get(self, key: str) -> KV | None:
        return KV(self.keys[key]) if key in self.keys else None

    def under(self, group: str) -> dict[str, KV]:
        return {k[len(group) :]: KV(v) for k, v in self.keys.items() if k.startswith(group)}


@dataclass
class FakeParticipant:
    round: int | None = None
    members: list[str] = field(default_factory=list)
    view: View = field(default_factory=View)


def settings(**kw: Any) -> ProtocolSettings:
    return ProtocolSettings(run_id="job-7", min_nodes=1, max_nodes=4, failure_budget=5, **kw)


def write_stats(directory: Path, **fields: Any) -> None:
    st = WorkerStats(**fields)
    (directory / f"stats-{st.pid}.json").write_text(json.dumps(st.to_json()))


def samples(observer: RunObserver) -> dict[str, float]:
    return {s.name: s.value for fam in observer.collect() for s in fam.samples}


def test_a_worker_writes_its_stats_at_most_once_a_second_and_at_once_in_a_new_round(tmp_path: Path) -> None:
    w = StatsWriter(str(tmp_path), {"RANK": "3", "LOCAL_RANK": "1"})
    w.record_step(round=1, step=1, snapshot_s=0.01)
    w.record_step(round=1, step=2, snapshot_s=0.03, durable=(2, 1.5, 100))
    w.record_step(round=1, step=3, snapshot_s=0.02, durable=(2, 1.5, 100))  # counted once
    (mine,) = read_stats(str(tmp_path)).values()
    assert (mine.rank, mine.local_rank, mine.round, mine.step, mine.snapshot.count) == (3, 1, 1, 1, 1)
    w.record_step(round=2, step=4, snapshot_s=0.02)  # a new round: written at once
    (mine,) = read_stats(str(tmp_path)).values()
    assert (mine.round, mine.step, mine.snapshot.count, mine.durable.count, mine.durable_bytes) == (
        2,
        4,
        4,
        1,
        100,
    )
    assert mine.round_first_step is not None and mine.snapshot.sum == pytest.approx(0.08)


def test_outside_an_agent_nothing_is_written(tmp_path: Path) -> None:
    w = StatsWriter(None, {})
    w.record_step(round=1, step=1, snapshot_s=0.01)
    assert not w.enabled and not os.listdir(tmp_path)


@pytest.mark.parametrize(
    "text",
    [
        "{",
        "[]",
        '{"pid": -1}',
        '{"pid": 5, "step": "x"}',
        '{"pid": 5, "snapshot": {"sum": -1}}',
        '{"pid": 6}',
    ],
)
def test_malformed_stats_files_are_skipped(tmp_path: Path, text: str) -> None:
    (tmp_path / "stats-5.json").write_text(text)  # the last: a file named for another pid
    assert read_stats(str(tmp_path)) == {}


def test_the_scrape_shows_the_round_the_budget_and_the_workers(tmp_path: Path) -> None:
    p = FakeParticipant(round=3, members=["a", "b"])
    now = time.time()
    p.view.keys["failures"] = b"4"
    p.view.keys["budget"] = BudgetRecord((now - 7200, now - 60, now - 30), leaves=6).encode()
    me = os.getpid()
    write_stats(tmp_path, pid=me, step=40, steps_per_s=12.5, round=3)
    obs = RunObserver(lambda: p, str(tmp_path), settings())
    got = samples(obs)
    assert got["elastic_train_round"] == 3 and got["elastic_train_world_size"] == 2
    assert got["elastic_train_failures_in_window"] == 2 and got["elastic_train_failure_budget_left"] == 3
    assert got["elastic_train_failures_total"] == 4 and got["elastic_train_leaves_total"] == 6
    assert got["elastic_train_step"] == 40 and got["elastic_train_steps_per_second"] == 12.5
    assert got["elastic_train_workers"] == 1


def test_an_exited_workers_totals_are_kept_and_its_file_removed(tmp_path: Path) -> None:
    import subprocess
    import sys

    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid = int(gone.stdout)
    write_stats(tmp_path, pid=pid, step=9, snapshot={"count": 9, "sum": 0.9, "last": 0.1})
    obs = RunObserver(lambda: None, str(tmp_path), settings())
    got = samples(obs)
    assert got["elastic_train_snapshot_seconds_count"] == 9 and got["elastic_train_workers"] == 0
    assert not (tmp_path / f"stats-{pid}.json").exists()
    assert samples(obs)["elastic_train_snapshot_seconds_sum"] == pytest.approx(0.9)


def recoveries(kind: str, path: str) -> float:
    return agent.RECOVERIES.labels(agent.run_id(), kind, path)._sum.get()  # type: ignore[attr-defined]


@pytest.mark.parametrize(("same_worker", "path"), [(True, "hot"), (False, "restart")])
def test_a_recovery_is_timed_from_the_first_join_to_the_first_step(
    tmp_path: Path, same_worker: bool, path: str
) -> None:
    p = FakeParticipant(round=1, members=["a", "b", "c"])
    obs = RunObserver(lambda: p, str(tmp_path), settings())
    me = os.getpid()
    write_stats(tmp_path, pid=me, step=10, round=1, round_first_step=1.0)
    obs.tick()
    before = recoveries("leave", path)
    # c left; a and b asked for round 2 (the first at t0), then closed it
    t0 = time.time() - 3.0
    p.view.keys["join/a"] = json.dumps({"target": 2, "time": t0}).encode()
    p.view.keys["join/b"] = json.dumps({"target": 2, "time": t0 + 0.5}).encode()
    p.view.keys["round"] = RoundRecord(2, ["a", "b"], kind="leave").encode()
    p.round, p.members = 2, ["a", "b"]
    obs.tick()
    assert recoveries("leave", path) == before  # no step in round 2 yet
    pid = me if same_worker else os.getppid()  # a restarted worker: another (alive) process
    write_stats(tmp_path, pid=pid, step=11, round=2, round_first_step=t0 + 2.0)
    obs.tick()
    assert recoveries("leave", path) - before == pytest.approx(2.0)


def test_the_endpoint_serves_the_registry() -> None:
    port = agent.serve(0, "127.0.0.1", "job-7")
    try:
        agent.count_eviction("slow")
        agent.count_fence("lease_lost")
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'elastic_train_evictions_total{reason="slow",run_id="job-7"} 1.0' in body
        assert 'elastic_train_fences_total{reason="lease_lost",run_id="job-7"}' in body
        assert 'elastic_train_recovery_seconds_count{kind="failure",path="hot",run_id="job-7"} 0.0' in body
    finally:
        agent.stop()
