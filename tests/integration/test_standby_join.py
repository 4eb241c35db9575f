"""A node joining a running job under hot recovery starts its workers once, on standby: they build while the
job keeps training at its old size, and are admitted at a step boundary (real torchrun agents on etcd3).

- built-in worker: the joiner's worker process is the same from its start to training at world 3, the job
  made steps while the joiner built (a build made slow through ``tests/fault_task.py``), the survivors keep
  their processes, exactly-once data and the weights of a world-1 run;
- the same with plain ``torchrun --rdzv-backend=etcd3`` agents running an own-loop script (``et.run``);
- a standby joiner of a run that finishes before it is admitted exits 0 with one line;
- a joiner whose workers fail while they build leaves after a few standby starts, with one line and status 1;
  the running job never stops for it;
- the rule (on etcd): a joiner waits on standby only while every live member of the round says that its
  workers re-form in-process (a script without ``et.run`` would train alone in a provisional world).
"""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from elastic_train.train.audit import check_exactly_once
from elastic_train.train.events import read_events
from tests.fault_task import BUILD_DELAY, BUILD_FAIL
from tests.helpers import TorchrunAgents, assert_same_weights, final_weights, log_records
from tests.integration import test_own_loop as own
from tests.integration.test_hot_recovery import HOT_STEPS, events_of, final_model, hot_job
from tests.integration.test_hot_recovery import reference as world1_reference
from tests.integration.test_hot_recovery import wait_workers as hot_wait_workers
from tests.integration.test_own_loop import reference  # noqa: F401 - the own-loop script's fixture
from tests.integration.test_training_elastic_etcd import ElasticJob, env

pytestmark = pytest.mark.slow
pytest.importorskip("elastic_train.rendezvous.registry")

#: Seconds the joiner's build takes longer than the others' (a large model's build, on a small one).
BUILD_S = 6.0
#: Seconds per step of the own-loop script (its 60 steps outlast a joiner's start on a busy machine).
OWN_STEP_S = "0.6"


def wait_workers(agents: list[subprocess.Popen], timeout: float = 60.0) -> dict[int, set[int]]:
    """The agents' worker processes, not theirs (an own-loop script's DataLoader workers come and go)."""
    return hot_wait_workers(agents, timeout, recursive=False)


def stamp(e: dict[str, Any]) -> float:
    return datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()


def standby_build(log: Path, steps: list[dict[str, Any]], spawned: float) -> tuple[float, int, float]:
    """From the joiner's agent log and the job's step events: when its one standby worker was built, how many
    world-2 steps the job made meanwhile (from a second after the worker was spawned), and the time of the
    first step at world 3."""
    assert b"standby_start" in log.read_bytes(), f"no standby start; logs in {log.parent}"
    built = [stamp(e) for e in log_records(log, "model_built") if e.get("standby")]
    assert len(built) == 1, f"one standby worker on the joiner; logs in {log.parent}"
    assert spawned < built[0]
    during = [e for e in steps if e["world_size"] == 2 and spawned + 1.0 < e["time"] < built[0]]
    first3 = min(e["time"] for e in steps if e["world_size"] == 3)
    return built[0], len(during), first3


def start_joiner(job: ElasticJob, stderr: Path | None = None, **extra: str) -> subprocess.Popen:
    """``job.start_agent()`` with ``extra`` in the agent's (and so its workers') environment; its stderr
    apart when ``stderr`` names a file."""
    from elastic_train.config import load_job_config
    from elastic_train.launch.run import torchrun_argv

    cfg = load_job_config(str(job.config))
    argv = torchrun_argv(cfg, config_path=str(job.config), overrides={}, local_addr="127.0.0.1")
    argv += ["--audit", str(job.tmp / "audit")]
    log = open(job.tmp / f"agent{len(job.agents)}.log", "wb")  # noqa: SIM115 - lives with the process
    proc = job.reaper.popen(
        [sys.executable, "-m", "torch.distributed.run", *argv],
        cwd=job.tmp,
        stdout=log,
        stderr=open(stderr, "wb") if stderr else subprocess.STDOUT,  # noqa: SIM115 - lives with the process
        env=env(ELASTIC_TRAIN_EVENTS=str(job.events), **extra),
    )
    job.agents.append(proc)
    return proc


def test_a_joiner_builds_on_standby_and_is_admitted_at_a_step_boundary(
    tmp_path: Path, etcd_server: Any, reaper: Any
) -> None:
    job = hot_job(tmp_path, etcd_server.endpoint, reaper)
    job.config.write_text(job.config.read_text().replace("level: warning", "level: info"))
    expected = world1_reference(job, tmp_path)
    for _ in range(2):
        job.start_agent()
    job.wait_step(2, 5)
    survivors = job.agents[:2]
    before = wait_workers(survivors)
    job.hold.write_text(f"2 {HOT_STEPS - 10}")  # at world 2 the job waits for the joiner before its end
    joiner = start_joiner(job, **{BUILD_DELAY: str(BUILD_S)})
    started = wait_workers([joiner], timeout=120)[joiner.pid]  # the joiner's worker, as torchrun started it
    spawned = min(psutil_create_time(pid) for pid in started)
    grown = job.wait_step(3, 1, timeout=180)
    assert wait_workers([joiner])[joiner.pid] == started, "the joiner's worker was started again"
    assert wait_workers(survivors) == before, "a survivor's worker was restarted by the join"
    job.hold.unlink()
    for agent in job.agents:
        assert agent.wait(timeout=180) == 0, f"agent failed; logs in {tmp_path}"

    built, during, first3 = standby_build(tmp_path / "agent2.log", events_of(job, "step"), spawned)
    assert during >= 3, f"the job did not train while the joiner built ({during} steps)"
    print(
        f"joiner model_built -> first step at world 3: {first3 - built:.2f} s; "
        f"steps at world 2 during the joiner's build: {during}; grown at step {grown['step']}"
    )
    assert events_of(job, "done")[-1]["step"] == HOT_STEPS
    report = check_exactly_once(str(tmp_path / "audit"), steps=HOT_STEPS)
    assert report.ok, report.problems
    weights = final_model(tmp_path / "ck")
    for key, value in expected.items():
        rel = float((weights[key] - value).norm() / value.norm())
        assert rel < 1e-5, f"{key} differs by {rel:.2e} relative to the world-1 run"


def psutil_create_time(pid: int) -> float:
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.NoSuchProcess:
        return float("inf")


@pytest.mark.long
def test_a_standby_joiner_of_a_run_that_finishes_first_exits_0_with_one_line(
    tmp_path: Path, etcd_server: Any, reaper: Any
) -> None:
    job = hot_job(tmp_path, etcd_server.endpoint, reaper)
    for _ in range(2):
        job.start_agent()
    job.wait_step(2, 5)
    job.hold.write_text(f"2 {HOT_STEPS - 3}")  # the job waits near its end until the joiner is on standby
    job.wait_step(2, HOT_STEPS - 4, timeout=300)  # at the gate: its last steps take less than a build
    err = tmp_path / "joiner.err"
    joiner = start_joiner(job, err, **{BUILD_DELAY: "15"})
    wait_workers([joiner], timeout=120)  # started before any round with it: on standby
    job.hold.unlink()
    for agent in job.agents:
        assert agent.wait(timeout=180) == 0, f"agent failed; logs in {tmp_path}"
    lines = [line for line in err.read_text().splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("elastic-train: run train-elastic finished at step"), lines
    assert lines[0].endswith("; this node has nothing left to do"), lines
    assert {e["world_size"] for e in events_of(job, "step")} == {2}, "the joiner was admitted"
    assert events_of(job, "done")[-1]["step"] == HOT_STEPS


@pytest.mark.long
def test_a_joiner_that_cannot_build_leaves_and_the_job_trains_on(
    tmp_path: Path, etcd_server: Any, reaper: Any
) -> None:
    from elastic_train.rendezvous.standby import STANDBY_ATTEMPTS

    job = hot_job(tmp_path, etcd_server.endpoint, reaper)
    for _ in range(2):
        job.start_agent()
    first = job.wait_step(2, 5)
    job.hold.write_text(f"2 {HOT_STEPS - 10}")  # the job outlasts the joiner's attempts
    err = tmp_path / "joiner.err"
    joiner = start_joiner(job, err, **{BUILD_FAIL: "no room for the model on this node"})
    assert joiner.wait(timeout=240) == 1, f"logs in {tmp_path}"
    job.hold.unlink()
    for agent in job.agents[:2]:
        assert agent.wait(timeout=180) == 0, f"agent failed; logs in {tmp_path}"
    text = err.read_text()
    assert "Exception in thread" not in text, text[-3000:]  # the admission thread stopped with the node
    last = [line for line in text.splitlines() if line.strip()][-1]
    assert last.startswith(f"elastic-train: error: this node's workers failed {STANDBY_ATTEMPTS} times"), last
    assert last.endswith("the job trains on without this node"), last
    log = (tmp_path / "agent2.log").read_bytes()
    assert log.count(b"standby_start") == STANDBY_ATTEMPTS, f"logs in {tmp_path}"
    steps = events_of(job, "step")
    assert {e["world_size"] for e in steps} == {2}, "the joiner was admitted"
    assert {e["round"] for e in steps if e["step"] >= first["step"]} == {first["round"]}, "the job re-formed"
    assert events_of(job, "done")[-1]["step"] == HOT_STEPS


@pytest.mark.long
def test_plain_torchrun_own_loop_joiner_builds_on_standby(
    tmp_path: Path,
    etcd_server: Any,
    reaper: Any,
    reference: dict[str, torch.Tensor],  # noqa: F811 - the fixture imported above
) -> None:
    hold = tmp_path / "hold"  # the file gate of slow_own_loop.py
    script = [str(own.SLOW_SCRIPT), OWN_STEP_S, *own.ARGS, "--checkpoint", str(tmp_path / "ck")]
    variables = own.env(HOLD=str(hold), ELASTIC_TRAIN_LOG_LEVEL="info")  # model_built in the agents' logs
    job = TorchrunAgents(
        tmp_path, etcd_server.endpoint, reaper, "own-loop-standby", script, variables,
        rdzv_conf="lease_ttl=2,settle=1,hot=1",
    )  # fmt: skip
    for _ in range(2):
        job.start()
    job.wait_step(2, 5)
    survivors = job.procs[:2]
    before = wait_workers(survivors)
    hold.write_text(f"2 {own.STEPS - 10}")
    joiner = job.start(SLOW_BUILD=str(BUILD_S))
    started = wait_workers([joiner], timeout=120)[joiner.pid]
    spawned = min(psutil_create_time(pid) for pid in started)
    job.wait_step(3, 1)
    assert wait_workers([joiner])[joiner.pid] == started, "the joiner's worker was started again"
    assert wait_workers(survivors) == before, "a survivor's worker was restarted by the join"
    hold.unlink()
    job.wait_all(job.procs, timeout=300)
    events = read_events(str(job.events))
    steps = [e for e in events if e["event"] == "step"]
    built, during, first3 = standby_build(tmp_path / "agent2.log", steps, spawned)
    assert during >= 3, f"the job did not train while the joiner built ({during} steps)"
    print(f"own loop: joiner model_built -> first step at world 3: {first3 - built:.2f} s")
    assert events[-1]["event"] == "done" and events[-1]["step"] == own.STEPS
    report = check_exactly_once(str(tmp_path / "audit"), steps=own.STEPS)
    assert report.ok, report.problems
    weights = final_weights(tmp_path / "ck", "own-loop-standby", own.STEPS)
    assert_same_weights(weights, reference, torch.float64)


def test_a_joiner_waits_on_standby_only_when_every_live_member_re_forms_in_process(
    etcd_server: Any,
) -> None:
    from elastic_train.etcd.client import connect
    from elastic_train.rendezvous.protocol import Participant, ProtocolSettings
    from elastic_train.rendezvous.standby import standby_round

    def node(i: int) -> Participant:
        s = ProtocolSettings(run_id="standby-rule", min_nodes=2, max_nodes=3, lease_ttl=2.0, settle=0.3)
        return Participant(connect(etcd_server.endpoint), s, addr="127.0.0.1", node_id=f"n{i}")

    a, b, joiner = node(0), node(1), node(2)
    try:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as pool:
            assert {r.round for r in pool.map(lambda p: p.join(), [a, b])} == {1}
        joiner.start()
        assert standby_round(joiner) is None  # nobody says its workers re-form in-process
        a.advertise_inproc(True)
        time.sleep(0.3)
        assert standby_round(joiner) is None  # b's workers would not admit a standby node
        b.advertise_inproc(True)
        deadline = time.monotonic() + 10
        while standby_round(joiner) != 1:
            assert time.monotonic() < deadline, "the joiner never saw both members re-form in-process"
            time.sleep(0.05)
        a.advertise_inproc(False)
        deadline = time.monotonic() + 10
        while standby_round(joiner) is not None:
            assert time.monotonic() < deadline, "the joiner still waits on standby for a member that restarts"
            time.sleep(0.05)
        a.advertise_inproc(True)
        while standby_round(joiner) != 1:
            assert time.monotonic() < deadline, "the joiner never saw both members re-form in-process again"
            time.sleep(0.05)
        b.leave()  # a member of the round is gone: a re-forms without it and would admit the joiner later
        time.sleep(0.3)
        assert standby_round(joiner) == 1, "a lost member sent the joiner into the survivors' recovery round"
        a.advertise_inproc(False)  # ... unless the survivor restarts its workers
        deadline = time.monotonic() + 10
        while standby_round(joiner) is not None:
            assert time.monotonic() < deadline, "the joiner waits on standby for a member that restarts"
            time.sleep(0.05)
    finally:
        for p in (a, b, joiner):
            p.leave()
