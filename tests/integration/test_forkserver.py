"""The worker fork server: stdio, exit codes and signals pass through the stand-in; nothing outlives it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from elastic_train.worker.forkserver import ENV_PID, ENV_SOCKET


@pytest.fixture
def forkserver(tmp_path: Path, reaper) -> Iterator[dict[str, str]]:
    sock = str(tmp_path / "fs.sock")
    proc = reaper.popen([sys.executable, "-m", "elastic_train.worker.forkserver", "--socket", sock])
    env = dict(os.environ, **{ENV_SOCKET: sock, ENV_PID: str(proc.pid)}, GLOO_SOCKET_IFNAME="lo")
    yield env
    proc.terminate()
    proc.wait(timeout=20)
    assert not os.path.exists(sock), "the server removes its socket on exit"


@pytest.fixture
def run_id(request: pytest.FixtureRequest) -> Iterator[str]:
    """A run id of the test's own; its snapshots (kept on purpose when a worker is killed) are removed after.

    Their owner is this pytest process (the stand-in's parent), so the stale-owner sweep cannot take them.
    """
    from elastic_train.checkpoint.shmfiles import snapshot_files

    rid = f"fs-{request.node.name.split('[')[0][-40:].replace('_', '-')}-{os.getpid()}"
    yield rid
    for path in snapshot_files("/dev/shm", rid):
        os.unlink(path)


def _worker_children(server_pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(server_pid).children()
    except psutil.NoSuchProcess:
        return []


def test_standin_passes_stdio_and_exit_code(forkserver: dict[str, str], tmp_path: Path) -> None:
    bad = tmp_path / "job.yaml"
    bad.write_text("train: {stepz: 3}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "elastic_train.worker", "--config", str(bad)],
        env=forkserver,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "train.stepz: unknown key (did you mean steps?)" in proc.stderr
    assert "fork server unavailable" not in proc.stderr


def test_worker_trains_and_signals_are_forwarded(
    forkserver: dict[str, str], tmp_path: Path, run_id: str
) -> None:
    env = dict(forkserver, ELASTIC_TRAIN_EVENTS=str(tmp_path / "events.jsonl"))
    args = [
        sys.executable, "-m", "elastic_train.worker", "--set", "train.task=regression",
        "--set", "train.steps=100000", "--checkpoint", str(tmp_path / "ckpt"), "--checkpoint-every", "0",
        "--set", f"rendezvous.run_id={run_id}",
    ]  # fmt: skip
    standin = subprocess.Popen(
        args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        events = tmp_path / "events.jsonl"
        while time.monotonic() < deadline and '"step"' not in (events.read_text() if events.exists() else ""):
            assert standin.poll() is None, standin.stderr.read() if standin.stderr else ""
            time.sleep(0.1)
        server_pid = int(forkserver[ENV_PID])
        workers = _worker_children(server_pid)
        assert len(workers) == 1, "the worker is a child of the fork server, not a fresh interpreter"
        worker = workers[0]
        standin.send_signal(signal.SIGTERM)
        code = standin.wait(timeout=60)
        assert code != 0, "the stand-in reports how the worker ended"
        assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
    finally:
        if standin.poll() is None:
            standin.kill()
            standin.wait()


def test_sigkill_of_standin_kills_worker(forkserver: dict[str, str], tmp_path: Path, run_id: str) -> None:
    env = dict(forkserver, ELASTIC_TRAIN_EVENTS=str(tmp_path / "events.jsonl"))
    args = [
        sys.executable, "-m", "elastic_train.worker", "--set", "train.task=regression",
        "--set", "train.steps=100000", "--checkpoint", str(tmp_path / "ckpt"), "--checkpoint-every", "0",
        "--set", f"rendezvous.run_id={run_id}",
    ]  # fmt: skip
    standin = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server_pid = int(forkserver[ENV_PID])
    deadline = time.monotonic() + 120
    while not _worker_children(server_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = _worker_children(server_pid)
    assert workers, "a worker was forked"
    standin.kill()
    standin.wait()
    _, alive = psutil.wait_procs(workers, timeout=20)
    assert not alive, "a worker must not outlive its stand-in"


def test_supervisor_restarts_a_dead_server(tmp_path: Path) -> None:
    from elastic_train.launch.run import ForkServerSupervisor

    environ: dict[str, str] = {}
    sup = ForkServerSupervisor(environ)
    try:
        first = int(environ[ENV_PID])
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while environ[ENV_PID] == str(first) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert environ[ENV_PID] != str(first), "a new server replaces the dead one"
        bad = tmp_path / "job.yaml"
        bad.write_text("train: {steps: 0}\n")
        proc = subprocess.run(
            [sys.executable, "-m", "elastic_train.worker", "--config", str(bad)],
            env=dict(os.environ, **environ),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2 and "train.steps: 0 must be >= 1" in proc.stderr
        assert "fork server unavailable" not in proc.stderr
    finally:
        sup.stop()
    assert sup.proc.poll() is not None


SCRIPT = """
import os, sys
import torch  # preloaded in the server: free
print("argv", sys.argv[1:], __name__, flush=True)
sys.exit(int(os.environ.get("EXIT_WITH", "0")))
"""


@pytest.mark.parametrize("with_server", [True, False])
def test_standin_runs_any_script(forkserver: dict[str, str], tmp_path: Path, with_server: bool) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(forkserver, EXIT_WITH="3")
    if not with_server:
        env.pop(ENV_SOCKET)
    proc = subprocess.run(
        [sys.executable, "-m", "elastic_train.worker.standin", str(script), "--lr", "0.1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 3, proc.stderr
    assert "argv ['--lr', '0.1'] __main__" in proc.stdout
    assert "fork server unavailable" not in proc.stderr


def test_standin_marks_its_script_pending_then_started_and_reports_how_long_it_ran(
    forkserver: dict[str, str], tmp_path: Path
) -> None:
    """The agent's start-up failure hold reads these: a script waiting for a slow fork server is pending."""
    from elastic_train.envvars import ENV_NODE_DIR
    from elastic_train.node import AgentChannel, Outcome
    from elastic_train.rendezvous.decide import exit_ran_s

    script = tmp_path / "train.py"
    script.write_text("import sys, time\ntime.sleep(0.3)\nsys.exit('train.py: error: no data')\n")
    outcomes = tmp_path / "node"
    outcomes.mkdir()
    agent = AgentChannel(str(outcomes))
    env = dict(forkserver, **{ENV_NODE_DIR: str(outcomes)}, RANK="0")
    server = int(forkserver[ENV_PID])
    os.kill(server, signal.SIGSTOP)  # a fork server still busy: the script cannot start
    try:
        command = [sys.executable, "-m", "elastic_train.worker.standin", str(script)]
        standin = subprocess.Popen(command, env=env, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while agent.script_clock() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        assert agent.script_clock() == (True, None)
        assert standin.poll() is None
    finally:
        resumed = time.monotonic()
        os.kill(server, signal.SIGCONT)
    _, err = standin.communicate(timeout=120)
    since_resumed = time.monotonic() - resumed
    assert standin.returncode == 1, err
    pending, started = agent.script_clock()  # type: ignore[misc]
    assert not pending and started is not None and started >= resumed
    [outcome] = agent.outcomes()
    assert outcome == Outcome(0, "exited", code=1, message="train.py: error: no data", ran_s=outcome.ran_s)
    # timed from the fork, not from the stand-in's start (which was over 0.5 s before the server resumed)
    assert 0.3 <= exit_ran_s([outcome]) <= since_resumed
