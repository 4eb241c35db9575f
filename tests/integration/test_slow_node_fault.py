"""The ``slow-node`` fault of ``elastic-train local``: a node's workers held stopped for ``1 - 1/factor`` of
every period and continued for the rest, for a span or until the job ends, while the agent runs untouched."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from elastic_train.config import JobConfig
from elastic_train.launch.faults import FaultRecord, parse_fault
from elastic_train.launch.local import SLOW_PERIOD, LocalJob, LocalOptions, Node

#: A stand-in node: an "agent" that starts one "worker" (a busy loop whose argv names the worker module,
#: as torchrun's workers do) and waits.
NODE = (
    "import subprocess, sys, time\n"
    "w = subprocess.Popen([sys.executable, '-c', 'while True: pass', 'elastic_train.worker'])\n"
    "time.sleep(60)\n"
)


def stopped_share(proc: psutil.Process, seconds: float) -> float:
    """The share of samples (every ~5 ms for ``seconds``) in which ``proc`` was stopped."""
    samples, stopped = 0, 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        samples += 1
        stopped += proc.status() == psutil.STATUS_STOPPED
        time.sleep(0.005)
    return stopped / samples


@contextmanager
def slowable(tmp_path: Path, reaper: Any, script: str) -> Iterator[tuple[LocalJob, Node]]:
    """A one-node ``LocalJob`` whose node is ``script`` run as its agent; when the block ends, the job ends
    as ``cleanup()`` ends it (every slowdown stopped, its processes continued), also when it fails."""
    agent = reaper.popen([sys.executable, "-c", script])
    job = LocalJob(JobConfig(), LocalOptions(config_path=None, overrides={}, nodes=1, workdir=str(tmp_path)))
    try:
        yield job, Node(index=0, proc=agent, log_path=str(tmp_path / "node-0.log"))
    finally:
        job._ending.set()
        for thread in job._slowing:
            thread.join(timeout=5)


def children(pid: int) -> list[psutil.Process]:
    """The processes ``pid`` started, once it started one (within 20 s)."""
    deadline = time.monotonic() + 20
    while not (found := psutil.Process(pid).children()):
        assert time.monotonic() < deadline, "the stand-in node did not start its process"
        time.sleep(0.002)
    return found


def held_once(proc: psutil.Process) -> None:
    """Return once ``proc`` is seen stopped (within 20 s)."""
    deadline = time.monotonic() + 20
    while proc.status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline, "the slowed process was never held"
        time.sleep(0.002)


def test_a_slowed_nodes_worker_is_held_for_its_share_and_runs_freely_after_the_span(tmp_path, reaper) -> None:  # type: ignore[no-untyped-def]
    with slowable(tmp_path, reaper, NODE) as (job, node):
        worker = children(node.proc.pid)[0]
        for_good = FaultRecord(fault=parse_fault("slow-node", "0@step=1,factor=4"))
        spanned = FaultRecord(fault=parse_fault("slow-node", "0@step=1,factor=4,for=1.5"))
        job._slow_node(spanned, node)
        held_once(worker)  # its driver started
        share = stopped_share(worker, 1.0)
        assert 0.5 < share < 0.95, f"held {share:.0%} of the time, factor 4 holds it 75%"
        assert psutil.Process(node.proc.pid).status() != psutil.STATUS_STOPPED  # the agent is left alone
        job._slowing[0].join(timeout=5)
        assert stopped_share(worker, 0.5) == 0.0  # the span is over
        assert spanned.extra["pids"] == [worker.pid] and spanned.extra["ended_s"] >= 1.5
        assert 0.5 * 1.5 < spanned.extra["stopped_s"] < 1.5  # type: ignore[operator]
        job._slow_node(for_good, node)
        time.sleep(5 * SLOW_PERIOD)
    assert stopped_share(worker, 0.3) == 0.0  # continued when the job ended
    assert for_good.extra["for_s"] is None and for_good.extra["factor"] == 4.0


def test_a_process_the_agent_starts_while_slowed_is_held_from_its_first_period(tmp_path, reaper) -> None:  # type: ignore[no-untyped-def]
    """A process started under a slowed node's agent (the agent's one-second health probe, a restarted
    worker) is as slow as the node from its first period: a node's slow hardware slows whatever runs on it,
    and a probe that ran free for part of its second would read the node healthier than it is."""
    late = "import time\ntime.sleep(1.0)\n" + NODE  # its process starts a second after the slowdown
    with slowable(tmp_path, reaper, late) as (job, node):
        job._slow_node(FaultRecord(fault=parse_fault("slow-node", "0@step=1,factor=4")), node)
        share = stopped_share(children(node.proc.pid)[0], 0.5)  # its first half second
        assert 0.5 < share < 0.95, f"held {share:.0%} of its first half second, factor 4 holds it 75%"


def test_a_slowed_node_that_hangs_stays_stopped_until_resumed(tmp_path, reaper) -> None:  # type: ignore[no-untyped-def]
    """A slowed node that hangs (``hang-node``: the agent and every process under it stopped) is not
    continued by its slowdown: a hung node's processes stay stopped until it is resumed, then are slowed
    again."""
    with slowable(tmp_path, reaper, NODE) as (job, node):
        worker = children(node.proc.pid)[0]
        slow = FaultRecord(fault=parse_fault("slow-node", "0@step=1,factor=4"))
        job._slow_node(slow, node)
        held_once(worker)  # its driver started
        assert 0.5 < stopped_share(worker, 0.5) < 0.95
        job._hang_node(FaultRecord(fault=parse_fault("hang-node", "0@step=1")), node)
        held_once(worker)  # a process waiting for a core stops once it runs
        assert stopped_share(worker, 1.0) == 1.0, "a hung node's worker ran"
        job._resume_node(FaultRecord(fault=parse_fault("resume-node", "0@step=1")), node)
        # Slowed again: neither left running free (0) nor left hung (1). The bound is looser than factor 4's
        # 75% above: right after the resume the whole tree runs again at once, and beside other tests on two
        # cores the driver, woken late for its holds, measured 44% in a one-second window once.
        share = stopped_share(worker, 2.0)
        assert 0.3 < share < 0.95, f"held {share:.0%} of the time after the resume"
    assert stopped_share(worker, 0.3) == 0.0  # continued when the job ended
    assert slow.extra["pids"] == [worker.pid] and slow.extra["stopped_s"] > 0.5, slow.extra
