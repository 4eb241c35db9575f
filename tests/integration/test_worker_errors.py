"""A failing worker's error reaches torchrun's failure summary (torch's ``@record`` on the worker entries).

Real torchrun agents on the etcd3 rendezvous run the real worker (``python -m elastic_train.worker``) with a
user task that raises, with a configuration mistake, and a user script through the node fork server; the
agent's summary must name the exception and show the traceback from the worker's error file, not only
"exit code 1".
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_train.worker.forkserver import ENV_PID, ENV_SOCKET

pytestmark = pytest.mark.slow

ROOT = str(Path(__file__).resolve().parents[2])

FAILING_TASK = """
def make(**_):
    raise RuntimeError("the dataset server is unreachable (injected by the test)")
"""

FAILING_SCRIPT = """
import torch.distributed as dist


def load_shard():
    raise KeyError("shard-7 missing (injected by the test)")


dist.init_process_group("gloo")
load_shard()
"""


def torchrun(
    endpoint: str, run_id: str, worker: list[str], env: dict[str, str]
) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=1",
        "--rdzv-backend=etcd3", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
        "--rdzv-conf=settle=0,lease_ttl=2", "--local-addr=127.0.0.1", "--max-restarts=0", *worker,
    ]  # fmt: skip
    env = dict(env, GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1", ELASTIC_TRAIN_LOG_LEVEL="warning")
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)


def summary(proc: subprocess.CompletedProcess) -> str:
    """torchrun's failure summary (the ChildFailedError block at the end of its stderr)."""
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "Root Cause (first observed failure)" in proc.stderr, proc.stderr[-3000:]
    return proc.stderr[proc.stderr.index("Root Cause (first observed failure)") :]


@pytest.fixture
def user_code(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "failing_task.py").write_text(FAILING_TASK)
    (tmp_path / "failing_script.py").write_text(FAILING_SCRIPT)
    path = os.pathsep.join(filter(None, [str(tmp_path), ROOT, os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path)


def _worker(task: str) -> list[str]:
    return ["-m", "elastic_train.worker", "--set", f"train.task={task}", "--set", "train.steps=5"]


def test_an_exception_in_the_worker_reaches_the_summary(etcd_server, user_code, tmp_path):
    proc = torchrun(etcd_server.endpoint, "rec-exc", _worker("failing_task:make"), user_code)
    text = summary(proc)
    assert "RuntimeError: the dataset server is unreachable" in text
    assert "Traceback (most recent call last)" in text and "failing_task.py" in text
    assert "error_file: <N/A>" not in text


def test_a_configuration_mistake_in_the_worker_reaches_the_summary(etcd_server, user_code):
    proc = torchrun(etcd_server.endpoint, "rec-cfg", ["-m", "elastic_train.worker", "--set", "train.stepz=3"],
                    user_code)  # fmt: skip
    text = summary(proc)
    assert "exitcode  : 2" in text
    # the one line stands in for a traceback: a configuration mistake is not a crash
    assert "traceback : ConfigError: train.stepz: unknown key (did you mean steps?)\n" in text


@pytest.fixture
def forkserver_env(tmp_path: Path, reaper, user_code: dict[str, str]) -> dict[str, str]:
    sock = str(tmp_path / "fs.sock")
    proc = reaper.popen(
        [sys.executable, "-m", "elastic_train.worker.forkserver", "--socket", sock], env=user_code
    )
    return dict(user_code, **{ENV_SOCKET: sock, ENV_PID: str(proc.pid)})


def test_through_the_fork_server_a_worker_exception_reaches_the_summary(etcd_server, forkserver_env):
    proc = torchrun(etcd_server.endpoint, "rec-fs", _worker("failing_task:make"), forkserver_env)
    text = summary(proc)
    assert "fork server unavailable" not in proc.stderr
    assert "RuntimeError: the dataset server is unreachable" in text and "failing_task.py" in text


def test_through_the_fork_server_a_user_script_exception_reaches_the_summary(
    etcd_server, forkserver_env, tmp_path
):
    script = str(tmp_path / "failing_script.py")
    proc = torchrun(
        etcd_server.endpoint, "rec-script", ["-m", "elastic_train.worker.standin", script], forkserver_env
    )
    text = summary(proc)
    assert "fork server unavailable" not in proc.stderr
    assert "KeyError: 'shard-7 missing (injected by the test)'" in text
    assert "load_shard" in text and "failing_script.py" in text
