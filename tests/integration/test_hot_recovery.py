"""Hot recovery on real torchrun agents meeting through etcd3: survivors of a kill -9 and of a join keep their
worker processes, re-form the group in-process, and the job still ends with the weights of a world-1 run
(within 1e-5) and exactly-once data; a second node dying during the re-formation converges, in-process and
on the restart path; ``hot: false`` takes the restart path (new worker processes)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from elastic_train.etcd.client import connect
from elastic_train.procs import kill_tree, signal_tree, tree
from elastic_train.rendezvous.exchange import ASSIGN_TIMEOUT
from elastic_train.train.audit import check_exactly_once
from elastic_train.train.events import read_events
from tests.integration.test_training_elastic_etcd import ROOT, STEPS, ElasticJob, env

#: Steps of these jobs: enough for a joiner's agent to start (imports) on a busy machine before the end.
HOT_STEPS = 4 * STEPS
#: Seconds from a second death during a re-formation to training at the smaller world: the in-process path
#: takes a round and a group formation; the restart path only starts after the rank exchange waited this long.
WITHIN_EXCHANGE = ASSIGN_TIMEOUT
#: The join keys of the jobs' run.
JOINS = "/elastic_train/train-elastic/join/"

pytestmark = pytest.mark.slow
pytest.importorskip("elastic_train.rendezvous.registry")


def workers(agent: subprocess.Popen, *, recursive: bool = True) -> set[int]:
    """PIDs of an agent's worker processes (its children: plain torchrun starts workers directly); without
    ``recursive`` not theirs, such as DataLoader workers."""
    try:
        return {p.pid for p in psutil.Process(agent.pid).children(recursive=recursive)}
    except psutil.NoSuchProcess:
        return set()


def events_of(job: ElasticJob, name: str) -> list[dict[str, Any]]:
    return [e for e in read_events(str(job.events)) if e["event"] == name]


def final_model(ckpt: Path) -> dict[str, Any]:
    from elastic_train.checkpoint import CheckpointConfig, CheckpointManager

    mgr = CheckpointManager(
        CheckpointConfig(url=str(ckpt), memory=False), "train-elastic", rank=0, world_size=1, local_rank=0
    )
    restored = mgr.restore()
    mgr.close()
    assert restored is not None and restored.step == HOT_STEPS
    return dict(restored.state["model"])


def reference(job: ElasticJob, tmp: Path) -> dict[str, Any]:
    ref = tmp / "ref"
    ref.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "elastic_train.worker", "--config", str(job.config), "--checkpoint", str(ref),
         "--set", "train.task_args.step_delay=0"],
        cwd=ROOT, env=env(), capture_output=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return final_model(ref)


def hot_job(tmp: Path, endpoint: str, reaper: Any, *, hot: bool = True, max_nodes: int = 3) -> ElasticJob:
    job = ElasticJob(tmp, endpoint, reaper)
    text = job.config.read_text().replace("max_nodes: 3", f"max_nodes: {max_nodes}")
    text = text.replace(f"steps: {STEPS}\n", f"steps: {HOT_STEPS}\n")
    assert f"steps: {HOT_STEPS}" in text
    job.config.write_text(text.replace("  settle: 1.0\n", f"  settle: 1.0\n  hot: {str(hot).lower()}\n"))
    return job


def wait_workers(
    agents: list[subprocess.Popen], timeout: float = 60.0, *, recursive: bool = True
) -> dict[int, set[int]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = {a.pid: workers(a, recursive=recursive) for a in agents}
        if all(found.values()):
            return found
        time.sleep(0.1)
    raise AssertionError("agents without workers")


def test_kill_and_join_keep_the_survivors_processes(tmp_path: Path, etcd_server: Any, reaper: Any) -> None:
    job = hot_job(tmp_path, etcd_server.endpoint, reaper)
    job.config.write_text(job.config.read_text().replace("level: warning", "level: info"))  # the restores
    expected = reference(job, tmp_path)
    for _ in range(3):
        job.start_agent()
    job.wait_step(3, 5)
    survivors = job.agents[:2]
    before = wait_workers(survivors)
    kill_tree(job.agents[2].pid)
    shrunk = job.wait_step(2, 1)
    assert wait_workers(survivors) == before, "a survivor's worker was restarted"
    # the job trains on while the joiner starts and builds (on standby): keep it from finishing first
    job.hold.write_text(f"2 {HOT_STEPS - 10}")
    job.start_agent()  # a joiner: the survivors stop at a step boundary and admit it in-process
    job.wait_step(3, shrunk["step"] + 1, timeout=240)
    job.hold.unlink()
    assert wait_workers(survivors) == before, "a survivor's worker was restarted by the join"
    for agent in job.agents[:2] + job.agents[3:]:
        assert agent.wait(timeout=180) == 0, f"agent failed; logs in {tmp_path}"

    rounds = {e["round"] for e in events_of(job, "step")}
    assert len(rounds) >= 3  # the kill and the join each formed a new round
    # The survivors held the step the groups re-formed at in their live tensors (they left the group at a
    # step boundary with its snapshot taken, or broke before the next optimizer step): they hashed them in
    # place instead of reading their snapshot, and the checksum agreed.
    for i in range(2):
        log_text = (tmp_path / f"agent{i}.log").read_bytes()
        assert re.search(rb"in_place[\"=:\s]+[Tt]rue", log_text), (
            f"agent{i} read its snapshot; logs in {tmp_path}"
        )
        assert b"restore_live_state_differs" not in log_text
    assert events_of(job, "done")[-1]["step"] == HOT_STEPS
    report = check_exactly_once(str(tmp_path / "audit"), steps=HOT_STEPS)
    assert report.ok, report.problems
    weights = final_model(tmp_path / "ck")
    for key, value in expected.items():
        rel = float((weights[key] - value).norm() / value.norm())
        assert rel < 1e-5, f"{key} differs by {rel:.2e} relative to the world-1 run"


def second_death(tmp: Path, etcd_server: Any, reaper: Any, *, hot: bool) -> bytes:
    """Three nodes, min_nodes 1; the survivor's agent (rank 0's, which closes the rounds: the others would
    wait a TTL for it to) held with SIGSTOP while the first victim is killed and the second is killed as soon
    as its join key asks for the next round, so that the round closes with the dead node in it. Checks that
    the job ended exactly once at world 1; returns the survivor's agent log."""
    job = hot_job(tmp, etcd_server.endpoint, reaper, hot=hot)
    # a TTL and a settle window that outlast the survivor's agent being held on a loaded machine: the dead
    # nodes are found gone by the store probe, not by their leases
    text = (
        job.config.read_text()
        .replace("min_nodes: 2", "min_nodes: 1")
        .replace("lease_ttl: 2.0", "lease_ttl: 8.0")
    )
    job.config.write_text(text.replace("  settle: 1.0\n", "  settle: 5.0\n"))
    for _ in range(3):
        job.start_agent()
    job.wait_step(3, 5)
    logs = [tmp / f"agent{i}.log" for i in range(3)]
    (rank0,) = [i for i, p in enumerate(logs) if b"rank=0 round=1 world_size=3" in p.read_bytes()]
    survivor, second_victim, first_victim = (job.agents[(rank0 + k) % 3] for k in range(3))
    before = wait_workers([survivor])
    etcd = connect(etcd_server.endpoint)
    os.kill(survivor.pid, signal.SIGSTOP)  # the agent only: its worker notices the failure meanwhile
    try:
        kill_tree(first_victim.pid)
        # the others' workers fail at once and their agents join the next round: kill the second node as
        # soon as its join key asks for that round (the survivor's agent, held, cannot have asked)
        deadline = time.monotonic() + 30
        while not any(json.loads(kv.value)["target"] == 2 for kv in etcd.get_prefix(JOINS)[0]):
            assert time.monotonic() < deadline, "no re-formation started"
            time.sleep(0.005)
        doomed = tree(second_victim.pid)
        for p in doomed:  # at once: kill_tree also waits for the tree, the survivor's lease would not
            p.kill()
        second = time.time()
    finally:
        os.kill(survivor.pid, signal.SIGCONT)
    psutil.wait_procs(doomed, timeout=30)
    if hot:
        step = job.wait_step(1, 1)
        assert wait_workers([survivor]) == before, "the survivor's worker was restarted"
        print(f"second death: world 1 trains {step['time'] - second:.2f}s later")
        assert step["time"] - second < WITHIN_EXCHANGE, f"logs in {tmp}"
    assert survivor.wait(timeout=180) == 0, f"agent failed; logs in {tmp}"
    assert events_of(job, "done")[-1]["step"] == HOT_STEPS
    assert {e["world_size"] for e in events_of(job, "step")} >= {3, 1}
    report = check_exactly_once(str(tmp / "audit"), steps=HOT_STEPS)
    assert report.ok, report.problems
    return logs[rank0].read_bytes()


@pytest.mark.long
def test_a_second_death_during_the_re_formation_converges(
    tmp_path: Path, etcd_server: Any, reaper: Any
) -> None:
    """A node killed right after it asked for the survivors' next round: that round closes with it (its join
    key lives until its lease expires), the survivor finds its agent gone during the rank exchange and forms
    the next round in-process, well within the 10 s the exchange would otherwise wait before the restart
    path. Three nodes, so that the first kill breaks every survivor's collective (each is next to the dead
    rank in gloo's ring), and min_nodes 1, so that the last node trains on alone (:func:`second_death`).
    """
    log0 = second_death(tmp_path, etcd_server, reaper, hot=True)
    assert b"hot_fallback" not in log0, f"the restart path took over; logs in {tmp_path}"
    assert b"hot_round_abandoned" in log0, f"the dead node was not in the round; logs in {tmp_path}"


@pytest.mark.long
def test_a_second_death_during_the_re_formation_converges_on_the_restart_path(
    tmp_path: Path, etcd_server: Any, reaper: Any
) -> None:
    """``hot: false``: a node killed right after it asked for the survivors' next round is in that round
    (its join key lives until its lease expires). torchrun's own rank exchange would block on it for the
    store's timeout and then end the survivor's agent, and with it the job; the survivor's handler finds
    the dead node's agent gone before that exchange, abandons the round and trains on in the next one
    (:func:`second_death`)."""
    log0 = second_death(tmp_path, etcd_server, reaper, hot=False)
    assert b"rendezvous_round_abandoned" in log0, f"the dead node was not in the round; logs in {tmp_path}"


@pytest.mark.long
def test_hot_off_restarts_the_workers(tmp_path: Path, etcd_server: Any, reaper: Any) -> None:
    job = hot_job(tmp_path, etcd_server.endpoint, reaper, hot=False)
    for _ in range(3):
        job.start_agent()
    job.wait_step(3, 5)
    survivors = job.agents[:2]
    before = wait_workers(survivors)
    kill_tree(job.agents[2].pid)
    job.wait_step(2, 1)
    after = wait_workers(survivors)
    assert all(not (before[pid] & after[pid]) for pid in before), "hot: false kept a worker process"
    for agent in survivors:
        assert agent.wait(timeout=180) == 0, f"agent failed; logs in {tmp_path}"


@pytest.mark.long
def test_a_stopped_node_is_cut_out_in_process_and_rejoins(
    tmp_path: Path, etcd_server: Any, reaper: Any
) -> None:
    """SIGSTOP leaves the survivors blocked in a gloo collective that never fails on its own. Once the stopped
    node's lease expired, their agents ask them to cut their group's connections: the collective fails and
    they re-form in-process without it, keeping their processes. The node rejoins after SIGCONT and the job
    ends exactly-once."""
    job = hot_job(tmp_path, etcd_server.endpoint, reaper)
    for _ in range(3):
        job.start_agent()
    job.wait_step(3, 5)
    survivors = job.agents[:2]
    before = wait_workers(survivors)
    frozen = job.agents[2]
    try:
        signal_tree(frozen.pid, signal.SIGSTOP)
        cut = job.wait_step(2, 1)
        assert wait_workers(survivors) == before, f"a survivor's worker was restarted; logs in {tmp_path}"
    finally:
        signal_tree(frozen.pid, signal.SIGCONT)
    job.wait_step(3, cut["step"] + 1)
    for agent in job.agents:
        assert agent.wait(timeout=180) == 0, f"agent failed; logs in {tmp_path}"
    logs = b"".join((tmp_path / f"agent{i}.log").read_bytes() for i in range(2))
    assert b"hot_links_cut" in logs and b"group_links_cut" in logs
    assert b"hot_fallback" not in logs, f"the restart path took over; logs in {tmp_path}"
    report = check_exactly_once(str(tmp_path / "audit"), steps=HOT_STEPS)
    assert report.ok, report.problems


@pytest.mark.long
def test_a_kill_in_a_four_node_ring_keeps_every_survivor(
    tmp_path: Path, etcd_server: Any, reaper: Any
) -> None:
    """Four nodes: gloo's ring all-reduce leaves one survivor that is not next to the dead rank, blocked on a
    neighbour that is alive. It must fail with its neighbours (they shut their connections of the broken
    group), not wait for a fence stall and restart: every survivor keeps its worker, none falls back."""
    job = hot_job(tmp_path, etcd_server.endpoint, reaper, max_nodes=4)
    for _ in range(4):
        job.start_agent()
    job.wait_step(4, 5, timeout=180)
    survivors = [job.agents[i] for i in (0, 2, 3)]
    before = wait_workers(survivors)
    killed = time.time()
    kill_tree(job.agents[1].pid)
    shrunk = job.wait_step(3, 1)
    print(f"kill in a 4-node ring: world 3 trains {shrunk['time'] - killed:.2f}s later")
    assert wait_workers(survivors) == before, f"a survivor's worker was restarted; logs in {tmp_path}"
    for agent in survivors:
        assert agent.wait(timeout=180) == 0, f"agent failed; logs in {tmp_path}"
    logs = b"".join((tmp_path / f"agent{i}.log").read_bytes() for i in (0, 2, 3))
    assert b"hot_fallback" not in logs, f"the restart path took over; logs in {tmp_path}"
    assert events_of(job, "done")[-1]["step"] == HOT_STEPS
    report = check_exactly_once(str(tmp_path / "audit"), steps=HOT_STEPS)
    assert report.ok, report.problems
