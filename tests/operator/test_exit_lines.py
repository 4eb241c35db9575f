"""Every way a node of a finished run ends is one line and the documented exit status, never a traceback.

A node started again for a run that finished moments ago (a late pod, a second start with the same run id)
exits 0; after ``identity_wait`` it is refused with status 2; a node cut off from etcd while the others
finished leaves with status 0 once it learns so. Each under ``elastic-train run`` and plain
``torchrun --rdzv-backend=etcd3``: real etcd, real agents and workers, all on loopback.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from elastic_train.etcd.client import Etcd
from elastic_train.rendezvous.status import read_status
from tests.netproxy import LatencyProxy
from tests.operator.test_run_faults import RDZV_WORKER, ROOT, Runs, base_env, error_lines, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

#: Long enough for a second start on a loaded machine to reach etcd within the "late node" window.
LATE_WINDOW = 120
#: A log record of torch's own (glog style: level letter, date, time).
TORCH_LOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d")


def only_line(stderr: str) -> str:
    """The one line a person reads (structured log records aside); fails on a traceback."""
    assert "Traceback" not in stderr, stderr
    assert "is_failed" not in stderr, stderr
    lines = error_lines(stderr)
    assert len(lines) == 1, stderr
    return lines[0]


def agent_lines(stderr: str) -> list[str]:
    """What a torchrun agent printed besides torch's own log records (``E1201 12:00:00.0 ...``)."""
    assert "Traceback" not in stderr, stderr
    assert "is_failed" not in stderr, stderr
    return [ln for ln in error_lines(stderr) if not TORCH_LOG.match(ln)]


def torchrun(
    endpoint: str,
    run_id: str,
    out: Path,
    reaper: Any,
    *,
    steps: int,
    identity_wait: float = LATE_WINDOW,
    worker_logs: Path | None = None,
) -> subprocess.Popen:
    """A plain torchrun node (1 worker) of ``run_id``, nodes 1:2, training ``steps`` steps; with
    ``worker_logs`` the worker's output goes there instead of the agent's stderr."""
    redirect = [f"--log-dir={worker_logs}", "--redirects=3"] if worker_logs else []
    cmd = [
        sys.executable, "-m", "torch.distributed.run", *redirect, "--nnodes=1:2", "--nproc-per-node=1",
        "--rdzv-backend=etcd3", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
        f"--rdzv-conf=lease_ttl=2,settle=0.5,identity_wait={identity_wait:g}", "--local-addr=127.0.0.1",
        "--monitor-interval=0.1", "--max-restarts=3", RDZV_WORKER,
    ]  # fmt: skip
    env = base_env(
        MASTER_ADDR="127.0.0.1",
        RDZV_WORKER_OUT=str(out),
        RDZV_WORKER_STEPS=str(steps),
        RDZV_WORKER_STEP_S="0.02",
    )
    return reaper.popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def test_run_started_again_for_a_finished_run_exits_0_with_one_line(
    runs: Runs, etcd: Etcd, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ck"
    window = ("--set", f"rendezvous.identity_wait={LATE_WINDOW}")
    first = runs.start("fin-run", ckpt, steps=6, extra=window)
    _, err = first.communicate(timeout=180)
    assert first.returncode == 0, err
    again = runs.start("fin-run", ckpt, steps=6, extra=window)
    _, err = again.communicate(timeout=120)
    assert again.returncode == 0, err
    line = only_line(err)
    assert line.startswith("elastic-train: run fin-run finished at step 6 on "), line
    assert line.endswith("; this node has nothing left to do"), line
    st = read_status(etcd, "fin-run")
    assert (st.state, st.finished_step, st.round) == ("finished", 6, 1)  # the late node changed nothing
    shown = runs.status("fin-run")
    assert shown.returncode == 0 and "  rank 0: " in shown.stdout, shown
    assert "(lost)" not in shown.stdout, shown.stdout  # the finished run's ranks left, none was lost


def test_plain_torchrun_started_for_a_finished_run_exits_0_then_2(
    etcd_server: Any, etcd: Etcd, reaper: Any, tmp_path: Path
) -> None:
    ep = etcd_server.endpoint
    job = torchrun(ep, "fin-tr", tmp_path / "a.jsonl", reaper, steps=10)
    _, err = job.communicate(timeout=180)
    assert job.returncode == 0, err
    assert read_status(etcd, "fin-tr").state == "finished"

    late = torchrun(ep, "fin-tr", tmp_path / "b.jsonl", reaper, steps=10)
    _, err = late.communicate(timeout=120)
    assert late.returncode == 0, err
    line = only_line(err)
    assert line.startswith("elastic-train: run fin-tr finished on "), line
    assert line.endswith("; this node has nothing left to do"), line
    assert not (tmp_path / "b.jsonl").exists()  # no worker ran

    # past its identity_wait the same start is refused: a finished run id is not reused by accident
    time.sleep(1.5)
    again = torchrun(ep, "fin-tr", tmp_path / "c.jsonl", reaper, steps=10, identity_wait=1)
    _, err = again.communicate(timeout=120)
    assert again.returncode == 2, err
    line = only_line(err)
    assert line.startswith("elastic-train: error: run fin-tr finished on "), line
    assert "start a new run with another run id" in line, line


@pytest.mark.long
def test_a_node_cut_off_from_etcd_until_the_job_finished_exits_0_with_one_line(
    etcd_server: Any, etcd: Etcd, reaper: Any, tmp_path: Path
) -> None:
    """The victim reaches etcd through a proxy that is cut (connections reset, new ones refused); the other
    node re-forms alone and finishes; on the heal the victim learns the run is over and leaves."""
    out = tmp_path / "steps.jsonl"
    with LatencyProxy("127.0.0.1", etcd_server.client_port) as proxy:
        other = torchrun(etcd_server.endpoint, "cut-tr", out, reaper, steps=400)
        victim = torchrun(
            proxy.endpoint, "cut-tr", out, reaper, steps=400, worker_logs=tmp_path / "victim-workers"
        )

        def trained_at_world_2() -> bool:
            lines = out.read_text().splitlines() if out.exists() else []
            return any('"world_size": 2' in ln and '"step": 5,' in ln for ln in lines)

        wait_for(trained_at_world_2, 120, "both nodes to train together")
        proxy.cut()
        _, other_err = other.communicate(timeout=240)
        assert other.returncode == 0, other_err
        assert read_status(etcd, "cut-tr").state == "finished"
        assert victim.poll() is None, "the victim should still be cut off, not gone"
        proxy.heal()
        _, err = victim.communicate(timeout=120)
    assert victim.returncode == 0, err
    lines = agent_lines(err)  # the worker's own error (its peers went away) is in its log, not here
    assert len(lines) == 1 and lines[0].startswith("elastic-train: run cut-tr finished on "), err


def test_a_late_node_of_the_dynamic_backend_exits_0_with_one_line(
    etcd_server: Any, reaper: Any, tmp_path: Path
) -> None:
    """``--rdzv-backend=etcd3-dynamic`` (torch's DynamicRendezvousHandler on etcd v3): torch's handler
    raises for a closed rendezvous; the node still leaves with one line."""

    def node(out: str) -> subprocess.Popen:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=1",
            "--rdzv-backend=etcd3-dynamic", f"--rdzv-endpoint={etcd_server.endpoint}", "--rdzv-id=fin-dyn",
            "--rdzv-conf=last_call_timeout=1,keep_alive_interval=1,heartbeat_timeout=5,state_ttl=600",
            "--local-addr=127.0.0.1", "--monitor-interval=0.1", "--max-restarts=0", RDZV_WORKER,
        ]  # fmt: skip
        env = base_env(MASTER_ADDR="127.0.0.1", RDZV_WORKER_OUT=str(tmp_path / out), RDZV_WORKER_STEPS="5")
        return reaper.popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)

    first = node("a.jsonl")
    _, err = first.communicate(timeout=180)
    assert first.returncode == 0, err
    late = node("b.jsonl")
    _, err = late.communicate(timeout=120)
    assert late.returncode == 0, err
    assert agent_lines(err) == [
        "elastic-train: rendezvous of run fin-dyn is closed (its job ended); this node has nothing left to do"
    ], err
    assert not (tmp_path / "b.jsonl").exists()


def test_a_worker_killed_by_any_signal_leaves_no_traceback_of_ours(
    runs: Runs, etcd: Etcd, tmp_path: Path
) -> None:
    """SIGKILL, SIGTERM and SIGSEGV on the worker a fork server forked: its stand-in ends as the worker did,
    torchrun starts the next one, and the node's output has no traceback through elastic_train (a crash's
    own output, such as faulthandler's dump of where it stood, is the worker's)."""
    import glob
    import signal

    import psutil

    from elastic_train.node import AgentChannel
    from tests.operator.test_startup_failure import fork_server_of

    node = runs.start("sigs", tmp_path / "ck", steps=100000, delay=0.05)
    server = fork_server_of(node)

    def channel() -> AgentChannel | None:
        found = glob.glob(f"{tempfile.gettempdir()}/elastic_train-node-{node.pid}-*")
        return AgentChannel(found[0]) if found else None

    def trained_worker(seen: set[int]) -> psutil.Process | None:
        """The fork server's worker that committed a step in its round (a failure before would be one at
        start-up: the run would end)."""
        ch = channel()
        assignment, mark = (ch.assignment(), ch.trained()) if ch is not None else (None, None)
        if assignment is None or mark is None or mark.round != assignment.round:
            return None
        fresh = [p for p in server.children() if p.pid not in seen]
        return fresh[0] if len(fresh) == 1 else None

    def next_worker(seen: set[int], what: str) -> psutil.Process:
        deadline = time.monotonic() + 120
        while (worker := trained_worker(seen)) is None:
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            assert node.poll() is None, "the node ended"
            time.sleep(0.1)
        return worker

    seen: set[int] = set()
    for sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGSEGV):
        worker = next_worker(seen, f"a worker that trained, to send {sig.name}")
        seen.add(worker.pid)
        worker.send_signal(sig)
    next_worker(seen, "the worker after the last kill training")
    assert node.poll() is None, "the node ended"
    node.send_signal(signal.SIGTERM)  # how Kubernetes stops a pod: one line, the shell's code for it
    _, err = node.communicate(timeout=120)
    ours = [
        block for block in err.split("Traceback (most recent call last):")[1:] if "elastic_train/" in block
    ]
    assert not ours, err
    assert node.returncode == 128 + signal.SIGTERM and "elastic-train: node stopped by SIGTERM" in err, err
    assert read_status(etcd, "sigs").failures_used == 3
