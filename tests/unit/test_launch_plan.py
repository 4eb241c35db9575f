"""Pure parts of the launchers: fault plans, option mapping, summaries."""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

import pytest

from elastic_train.cli.options import node_overrides, parse_nodes
from elastic_train.config.options import add_job_options, collect_overrides
from elastic_train.errors import ConfigError
from elastic_train.launch.faults import Fault, FaultRecord, due, parse_fault, validate_plan
from elastic_train.launch.run import endpoint_is_loopback, worker_overrides_argv
from elastic_train.launch.summary import Summary, render_table, world_size_timeline


def test_parse_fault_forms() -> None:
    f = parse_fault("kill-node", "1@step=30")
    assert (f.kind, f.node, f.step) == ("kill-node", 1, 30)
    g = parse_fault("add-node", "@step=70")
    assert (g.node, g.step) == (None, 70)


@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        ("kill-node", "@step=3", "needs a node index"),
        ("add-node", "2@step=3", "takes no node index"),
        ("kill-node", "1@30", "expected NODE@step=S"),
        ("explode", "1@step=3", "unknown fault kind"),
    ],
)
def test_parse_fault_errors(kind: str, spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_fault(kind, spec)


def test_a_slow_node_takes_a_factor_and_a_span() -> None:
    f = parse_fault("slow-node", "1@step=30,factor=3,for=20")
    assert (f.node, f.step, f.option("factor"), f.option("for")) == (1, 30, 3.0, 20.0)
    assert f.label == "slow-node 1@step=30,factor=3,for=20"
    g = parse_fault("slow-node", "2@step=5")
    assert (g.option("factor"), g.option("for"), g.label) == (2.0, None, "slow-node 2@step=5")


@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        ("slow-node", "1@step=3,speed=2", "unknown option 'speed' (slow-node takes factor, for)"),
        ("slow-node", "1@step=3,factor=1", "factor=1 must be above 1"),
        ("slow-node", "1@step=3,for=0", "for=0 must be > 0 seconds"),
        ("slow-node", "1@step=3,factor=fast", "factor='fast' is not a number"),
        ("slow-node", "1@step=3,", "expected NODE@step=S[,factor=X][,for=X]"),
        ("kill-node", "1@step=3,factor=2", "unknown option 'factor' (kill-node takes no options)"),
    ],
)
def test_fault_options_are_checked(kind: str, spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_fault(kind, spec)


def test_validate_plan_counts_added_nodes() -> None:
    plan = [parse_fault("add-node", "@step=5"), parse_fault("kill-node", "3@step=9")]
    validate_plan(plan, initial_nodes=3, steps=20)
    with pytest.raises(ConfigError, match="only nodes 0..2"):
        validate_plan([parse_fault("kill-node", "3@step=4"), *plan], initial_nodes=3, steps=20)
    with pytest.raises(ConfigError, match="only trains 20 steps"):
        validate_plan([parse_fault("kill-node", "0@step=20")], initial_nodes=3, steps=20)


def test_due_and_steps_redone() -> None:
    plan = [Fault(kind="kill-node", node=0, step=3), Fault(kind="add-node", step=8)]
    a, b = (FaultRecord(fault=f) for f in plan)
    assert due([a, b], 2) == []
    assert due([a, b], 5) == [a]
    a.fired_at, a.fired_step, a.resumed_from = 10.0, 5, 4
    assert due([a, b], 9) == [b]
    assert a.steps_redone == 1
    a.resumed_at = 12.5
    assert a.to_json()["resumed_s"] == 2.5
    assert (a.kind, a.label) == ("kill-node", "kill-node 0@step=3")
    assert plan[0] == Fault(kind="kill-node", node=0, step=3)  # the plan is not what happened
    with pytest.raises(AttributeError):
        plan[0].step = 4  # type: ignore[misc]


def test_every_fault_kind_has_an_action(tmp_path: Path) -> None:
    from elastic_train.config import load_job_config
    from elastic_train.launch.faults import KINDS
    from elastic_train.launch.local import LocalJob, LocalOptions

    def probe(record: FaultRecord, node: object) -> None:
        record.extra["probe"] = node

    opts = LocalOptions(
        config_path=None, overrides={}, nodes=1, workdir=str(tmp_path), actions={"probe": probe}
    )
    job = LocalJob(load_job_config(None, environ={}), opts)
    assert set(job.actions) == {*KINDS, "probe"}
    record = FaultRecord(fault=Fault(kind="probe", step=1))
    job.fire(record)
    assert record.extra == {"probe": None} and record.fired_at is not None and record.fired_step == 0


def test_options_map_to_config_keys() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nodes")
    add_job_options(p)
    args = p.parse_args(
        [
            "--nodes",
            "2:4",
            "--checkpoint",
            "s3://b/r",
            "--steps",
            "7",
            "--set",
            "train.seed=3",
            "--set",
            "x.y=z",
        ]
    )
    assert collect_overrides(args, node_overrides(args.nodes)) == {
        "checkpoint.url": "s3://b/r",
        "train.steps": 7,
        "rendezvous.min_nodes": 2,
        "rendezvous.max_nodes": 4,
        "train.seed": 3,
        "x.y": "z",
    }


def test_set_wins_over_dedicated_options_and_derived_keys() -> None:
    p = argparse.ArgumentParser()
    add_job_options(p)
    args = p.parse_args(["--set", "train.steps=5", "--steps", "7", "--set", "rendezvous.max_nodes=6"])
    overrides = collect_overrides(args, node_overrides("2:4"))
    assert overrides["train.steps"] == 5
    assert (overrides["rendezvous.min_nodes"], overrides["rendezvous.max_nodes"]) == (2, 6)
    # the last --set of a key wins over an earlier one
    args = p.parse_args(["--set", "train.seed=1", "--set", "train.seed=2", "--seed", "9"])
    assert collect_overrides(args)["train.seed"] == 2


def test_without_leaves_an_option_out() -> None:
    p = argparse.ArgumentParser()
    add_job_options(p, without=["--endpoint"])
    with pytest.raises(SystemExit):
        p.parse_args(["--endpoint", "h:1"])
    assert collect_overrides(p.parse_args(["--run-id", "r"])) == {"rendezvous.run_id": "r"}


def test_parse_nodes() -> None:
    assert node_overrides(None) == {}
    assert parse_nodes("3") == (3, 3)
    assert parse_nodes("2:4") == (2, 4)
    for bad in ("4:2", "0", "a:b"):
        with pytest.raises(ConfigError):
            parse_nodes(bad)


def test_worker_overrides_keep_types() -> None:
    argv = worker_overrides_argv(
        {"rendezvous.run_id": "123", "train.steps": 5, "checkpoint.resume_from": None}
    )
    assert argv == ["--set", 'rendezvous.run_id="123"', "--set", "train.steps=5"]


def test_endpoint_is_loopback() -> None:
    assert endpoint_is_loopback("127.0.0.1:2379,localhost:2380")
    assert endpoint_is_loopback("127.0.0.3:1")
    assert not endpoint_is_loopback("etcd.default.svc:2379")
    assert not endpoint_is_loopback("10.0.0.1:2379")


def test_world_size_timeline_and_table() -> None:
    events = [
        {"time": 1.0, "step": 1, "world_size": 3, "round": 1, "loss": 2.0},
        {"time": 2.0, "step": 2, "world_size": 3, "round": 1, "loss": 1.9},
        {"time": 5.0, "step": 2, "world_size": 2, "round": 2, "loss": 1.9},
        {"time": 6.0, "step": 3, "world_size": 2, "round": 2, "loss": 1.8},
    ]
    tl = world_size_timeline(events, t0=0.0)
    assert [(p["step"], p["world_size"]) for p in tl] == [(1, 3), (2, 2)]
    f = FaultRecord(
        fault=Fault(kind="kill-node", node=1, step=2),
        fired_at=2.5,
        fired_step=2,
        detected_at=3.0,
        resumed_at=5.0,
    )
    f.resumed_from, f.resumed_world_size, f.source = 2, 2, "memory"
    s = Summary(run_id="r", steps=3, completed_steps=3, succeeded=True, faults=[f], world_size_timeline=tl)
    table = render_table(s)
    assert "kill-node 1@step=2" in table and "2.50s" in table and "memory" in table
    assert json.loads(json.dumps(s.to_json()))["faults"][0]["steps_redone"] == 0


def test_etcd_cluster_faults_need_a_cluster() -> None:
    for kind in ("kill-etcd-leader", "etcd-quorum-loss"):
        fault = parse_fault(kind, "@step=5")
        validate_plan([fault], 2, 20, etcd_members=3)
        with pytest.raises(ConfigError, match=f"--{kind} needs a 3- or 5-member etcd"):
            validate_plan([fault], 2, 20)
        with pytest.raises(ConfigError, match="takes no node index"):
            parse_fault(kind, "1@step=5")


def test_endpoint_is_loopback_without_ports() -> None:
    assert endpoint_is_loopback("127.0.0.1") and endpoint_is_loopback("localhost,[::1]")
    assert not endpoint_is_loopback("etcd-0,127.0.0.1") and not endpoint_is_loopback("a:x")


class _Exited:
    """A node process that already exited (what ``LocalJob.cleanup`` finds after a run)."""

    pid = 100
    returncode = 0

    def poll(self) -> int:
        return 0

    def wait(self, timeout: float | None = None) -> int:
        return 0


def test_cleanup_deletes_its_own_nodes_snapshots_only(tmp_path: Path) -> None:
    """Two jobs on one machine under one run id (a default run id is the second the job started): the one
    that ends first deletes its nodes' memory snapshots, not the other's. Deleting those lost the other
    job's state: its workers wrote on into the unlinked files, and after a kill its survivors re-formed
    in-process, found no snapshot and trained again from step 0."""
    from elastic_train.checkpoint.shmfiles import PREFIX, snapshot_files
    from elastic_train.config import load_job_config
    from elastic_train.launch.local import LocalJob, LocalOptions, Node

    memdir = tmp_path / "shm"
    memdir.mkdir()
    run = "elastic-train-20261204-162833"

    def snapshot(pid: int, started_ms: int, local_rank: int = 0) -> str:
        path = memdir / f"{PREFIX}{run}+0123456789ab.{pid}-{started_ms}.{local_rank}"
        path.write_bytes(b"state")
        return str(path)

    ours = [snapshot(100, 5000), snapshot(100, 5000, 1), snapshot(101, 5001)]
    # another job's node, and an earlier process that had the PID of one of ours
    theirs = [snapshot(200, 5002), snapshot(100, 4000)]
    cfg = load_job_config(None, {"rendezvous.run_id": run, "checkpoint.memory_dir": str(memdir)}, environ={})
    job = LocalJob(cfg, LocalOptions(config_path=None, overrides={}, nodes=2, workdir=str(tmp_path / "w")))
    for index, owner in enumerate([(100, 5000), (101, 5001)]):
        job.nodes.append(Node(index, _Exited(), str(tmp_path / f"node-{index}.log"), owner=owner))  # type: ignore[arg-type]
    job.cleanup()
    assert sorted(snapshot_files(str(memdir), run)) == sorted(theirs)
    assert not any(os.path.exists(p) for p in ours)
