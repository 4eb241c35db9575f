"""Chaos: a job preempted more often than any fixed failure budget allows finishes, its leaves counted apart.

Preemption as Kubernetes does it: SIGTERM to a node's agent alone (``preempt-node``), which says in etcd that
it leaves before its workers stop. With ``failure_budget: 0`` a single failure would end the job; three
preemptions, one of them the rank-0 node, must not. Every sample is trained exactly once, the run records
three clean leaves and no failure, and each preempted node exits by the signal (143) with one line.

The agents serve their metrics on free ports: before each preemption after the first, the node that is never
preempted is scraped, and shows the leaves so far, the round, the world size and its timed recoveries.
"""

from __future__ import annotations

import io
import json
import os
import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from elastic_train.config import load_job_config
from elastic_train.launch.faults import Fault, FaultRecord
from elastic_train.launch.local import LocalJob, LocalOptions, Node
from elastic_train.train.audit import check_exactly_once

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 36
PREEMPTED = (1, 2, 0)


def test_preemptions_beyond_any_budget_are_leaves_not_failures(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    ov = {
        "rendezvous.run_id": "preempted",
        "rendezvous.min_nodes": 1,
        "rendezvous.max_nodes": 4,
        "rendezvous.failure_budget": 0,
        "rendezvous.lease_ttl": 2.0,
        "rendezvous.settle": 0.5,
        "train.task": "tests.chaos.chaos_task:build",
        "train.task_args": {"step_delay": 0.05},
        "train.steps": STEPS,
        "train.global_batch": 24,
        "train.audit_dir": str(tmp_path / "audit"),
        "checkpoint.url": str(tmp_path / "ckpt"),
        "checkpoint.every_steps": 10,
        "rendezvous.metrics_port": 0,
    }
    faults = [Fault(kind="preempt-node", node=n, step=6 + 8 * i) for i, n in enumerate(PREEMPTED)]
    job = LocalJob(
        load_job_config(None, ov),
        LocalOptions(
            config_path=None, overrides=ov, nodes=4, faults=faults, workdir=str(tmp_path / "work"),
            timeout=240.0, out=io.StringIO(),
        ),
    )  # fmt: skip
    scrapes: list[dict[str, float]] = []
    preempt = job.actions["preempt-node"]

    def scrape_then_preempt(record: FaultRecord, node: Node | None) -> None:
        if record is not job.records[0]:
            scrapes.append(scrape(job.nodes[3]))
        preempt(record, node)

    job.actions["preempt-node"] = scrape_then_preempt
    summary = job.run()
    out = job.opts.out.getvalue()  # type: ignore[attr-defined]
    assert summary.succeeded and summary.completed_steps == STEPS, f"{out}\nlogs: {tmp_path / 'work'}"
    audit = check_exactly_once(str(tmp_path / "audit"), steps=STEPS)
    assert audit.ok, audit.problems[:5]
    assert [f.fired_at is not None for f in summary.faults] == [True] * len(PREEMPTED), out
    st = job.final_status
    assert st is not None and (st.state, st.failures_used, st.leaves) == ("finished", 0, len(PREEMPTED)), st
    for n in PREEMPTED:
        node = job.nodes[n]
        assert node.proc.returncode == 143, (n, node.proc.returncode)
        log = Path(node.log_path).read_text(errors="replace")
        assert "elastic-train: node stopped by SIGTERM; this node left the run cleanly" in log
        assert '"rendezvous_node_left"' in log
    sizes = [p["world_size"] for p in summary.world_size_timeline]
    assert sizes[0] == 4 and sizes[-1] == 1, summary.world_size_timeline
    # what the node that stayed served before the second and the third preemption
    assert [(m["leaves"], m["round"], m["world_size"]) for m in scrapes] == [(1, 2, 3), (2, 3, 2)], scrapes
    assert all(m["failures"] == 0 and m["budget_left"] == 0 and m["step"] > 0 for m in scrapes), scrapes
    assert scrapes[-1]["leave_recoveries"] >= 1, scrapes


def scrape(node: Node) -> dict[str, Any]:
    """The figures of one agent's /metrics (its port from its ``metrics_serving`` log line)."""
    port = next(
        json.loads(line)["port"]
        for line in Path(node.log_path).read_text(errors="replace").splitlines()
        if '"metrics_serving"' in line
    )
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()

    def value(pattern: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{pattern} (\S+)$", body, re.M))

    return {
        "leaves": value(r"elastic_train_leaves_total\{[^}]*\}"),
        "failures": value(r"elastic_train_failures_total\{[^}]*\}"),
        "budget_left": value(r"elastic_train_failure_budget_left\{[^}]*\}"),
        "round": value(r"elastic_train_round\{[^}]*\}"),
        "world_size": value(r"elastic_train_world_size\{[^}]*\}"),
        "step": value(r"elastic_train_step\{[^}]*\}"),
        "leave_recoveries": value(r'elastic_train_recovery_seconds_count\{kind="leave",[^}]*\}'),
    }
