"""The agent's metrics: the run's view at scrape time, the workers' figures through the node's channel,
recovery timing, the endpoint."""

from __future__ import annotations

import os
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from elastic_train.metrics import agent
from elastic_train.node import AgentChannel, Stats, WorkerChannel
from elastic_train.rendezvous.budget import BudgetRecord
from elastic_train.rendezvous.config import ProtocolSettings
from elastic_train.rendezvous.observe import RunObserver
from elastic_train.rendezvous.records import RoundRecord, RunReader


@dataclass
class KV:
    value: bytes
    mod_revision: int = 1


@dataclass
class View:
    keys: dict[str, bytes] = field(default_factory=dict)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def get(self, key: str) -> KV | None:
        return KV(self.keys[key], hash(self.keys[key])) if key in self.keys else None

    def under(self, group: str) -> dict[str, KV]:
        return {k[len(group) :]: KV(v) for k, v in self.keys.items() if k.startswith(group)}

    def decoded(self, key: str, decode: Callable[[bytes], Any]) -> Any:
        return decode(self.keys[key]) if key in self.keys else None


@dataclass
class FakeParticipant:
    round: int | None = None
    members: list[str] = field(default_factory=list)
    view: View = field(default_factory=View)

    @property
    def run(self) -> RunReader:
        return RunReader(self.view)  # type: ignore[arg-type]


def settings(**kw: Any) -> ProtocolSettings:
    return ProtocolSettings(run_id="job-7", min_nodes=1, max_nodes=4, failure_budget=5, **kw)


def report(directory: Path, **fields: Any) -> None:
    """A worker's figures, as its channel writes them."""
    base: dict[str, Any] = {"round": 1, "step": 1, "time": time.time(), "round_first_step": time.time()}
    WorkerChannel(str(directory)).report_stats(Stats(**{**base, **fields}))


def samples(observer: RunObserver) -> dict[str, float]:
    return {s.name: s.value for fam in observer.collect() for s in fam.samples}


def test_the_scrape_shows_the_round_the_budget_and_the_workers(tmp_path: Path) -> None:
    p = FakeParticipant(round=3, members=["a", "b"])
    now = time.time()
    p.view.keys["failures"] = b"4"
    p.view.keys["budget"] = BudgetRecord((now - 7200, now - 60, now - 30), leaves=6).encode()
    me = os.getpid()
    report(tmp_path, pid=me, step=40, steps_per_s=12.5, round=3)
    obs = RunObserver(lambda: p, AgentChannel(str(tmp_path)), settings())  # type: ignore[arg-type,return-value]
    got = samples(obs)
    assert got["elastic_train_round"] == 3 and got["elastic_train_world_size"] == 2
    assert got["elastic_train_failures_in_window"] == 2 and got["elastic_train_failure_budget_left"] == 3
    assert got["elastic_train_failures_total"] == 4 and got["elastic_train_leaves_total"] == 6
    assert got["elastic_train_step"] == 40 and got["elastic_train_steps_per_second"] == 12.5
    assert got["elastic_train_workers"] == 1


def test_an_exited_workers_totals_are_kept_and_its_figures_removed(tmp_path: Path) -> None:
    import subprocess
    import sys

    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid = int(gone.stdout)
    report(tmp_path, pid=pid, step=9, snapshots=9, snapshot_s=0.9, snapshot_last_s=0.1)
    obs = RunObserver(lambda: None, AgentChannel(str(tmp_path)), settings())
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
    obs = RunObserver(lambda: p, AgentChannel(str(tmp_path)), settings())  # type: ignore[arg-type,return-value]
    me = os.getpid()
    report(tmp_path, pid=me, step=10, round=1, round_first_step=1.0)
    obs.tick()
    before = recoveries("leave", path)
    # c left; a and b asked for round 2 (the first at t0), and the round closed with what caused it
    t0 = time.time() - 3.0
    p.view.keys["round"] = RoundRecord(2, ["a", "b"], kind="leave", asked_at=t0).encode()
    p.round, p.members = 2, ["a", "b"]
    obs.tick()
    assert recoveries("leave", path) == before  # no step in round 2 yet
    pid = me if same_worker else os.getppid()  # a restarted worker: another (alive) process
    report(tmp_path, pid=pid, step=11, round=2, round_first_step=t0 + 2.0)
    obs.tick()
    assert recoveries("leave", path) - before == pytest.approx(2.0)


def test_the_endpoint_serves_the_registry() -> None:
    port = agent.serve(0, "127.0.0.1", "job-7")
    try:
        agent.count_fence("lease_lost")
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'elastic_train_fences_total{reason="lease_lost",run_id="job-7"}' in body
        assert 'elastic_train_recovery_seconds_count{kind="failure",path="hot",run_id="job-7"} 0.0' in body
    finally:
        agent.stop()
