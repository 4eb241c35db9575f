"""A script that fails the same way on every node before its first step is not retried: the run fails at
once, no failure budget spent, and the line says the script's own error first. The same failure is the same
exit code and the same error: the exception's type and where it was raised when the worker said (its text may
differ by rank), else the last stderr line, else the exit code alone; under ``elastic-train run``,
``elastic-train local`` and plain torchrun.

Real etcd, two nodes on loopback, real scripts.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from elastic_train.etcd.client import connect
from elastic_train.rendezvous.status import read_status
from tests.operator.test_run_faults import base_env, error_lines

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

USAGE = """\
import argparse
p = argparse.ArgumentParser(prog="train.py")
p.add_argument("--lr", type=float, required=True)
p.parse_args()
"""
#: Fails with a line of its own on each node: not the same failure everywhere.
PER_NODE = """\
import os, sys
sys.exit(f"train.py: error: node {os.environ['GROUP_RANK']} cannot open its shard")
"""
#: An own-loop script whose first step raises, with the rank in the text (the same exception on every rank).
FIRST_STEP = """\
import elastic_train as et

def train(world):
    raise RuntimeError(f"rank {world.rank}: mat1 and mat2 must have the same dtype, but got Double and Float")

et.run(train)
"""
#: A script that tells nobody anything: it exits 3.
SILENT = "import sys\nsys.exit(3)\n"


def start_nodes(tmp: Path, endpoint: str, run_id: str, script: str, reaper: Any, *extra: str) -> list:
    path = tmp / "train.py"
    path.write_text(script)
    cmd = [
        sys.executable, "-m", "elastic_train", "--log-format", "json", "--log-level", "warning", "run",
        "--endpoint", endpoint, "--run-id", run_id, "--nodes", "2:2", "--local-addr", "127.0.0.1",
        "--set", "rendezvous.lease_ttl=2", "--set", "rendezvous.settle=0.5", *extra, "--entry", str(path),
    ]  # fmt: skip
    return [
        reaper.popen(cmd, env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp)
        for _ in range(2)
    ]


def fork_server_of(node: subprocess.Popen, timeout: float = 60) -> psutil.Process:
    """A node's worker fork server: a fork of the node's process, or a fresh ``...worker.forkserver``."""
    me = psutil.Process(node.pid)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in me.children():
            with contextlib.suppress(psutil.Error):
                cmd = child.cmdline()
                if cmd == me.cmdline() or "elastic_train.worker.forkserver" in cmd:
                    return child
        time.sleep(0.01)
    raise AssertionError(f"no fork server under node {node.pid}")


@pytest.mark.parametrize("slow_server", [False, True], ids=["alike", "one-fork-server-stalls"])
def test_a_usage_error_on_every_node_fails_the_run_at_once(
    etcd_server: Any, reaper: Any, tmp_path: Path, slow_server: bool
) -> None:
    """With ``one-fork-server-stalls``, one node's script starts 6 s after the other's failed (its fork server
    stopped, as on a loaded machine): it still gets to fail on its own before its node re-joins."""
    run_id = f"usage-err-{slow_server}"
    nodes = start_nodes(tmp_path, etcd_server.endpoint, run_id, USAGE, reaper)
    if slow_server:
        server = fork_server_of(nodes[1])
        server.suspend()
        try:
            time.sleep(6)
        finally:
            server.resume()
    line = "train.py: error: the following arguments are required: --lr"
    for node in nodes:
        _, err = node.communicate(timeout=240)
        assert node.returncode == 2, err
        assert "Traceback" not in err, err
        assert "usage: train.py [-h] --lr LR" in err  # the script's own output passes through unchanged
        ours = [ln for ln in error_lines(err) if ln.startswith("elastic-train")]
        assert ours == [
            f"elastic-train: error: run {run_id} failed: {line} (exit code 2 on all 2 nodes before the "
            "first step; not retried)"
        ], err
    with connect(etcd_server.endpoint) as etcd:
        st = read_status(etcd, run_id)
    assert (st.state, st.failures_used, st.round) == ("failed", 0, 1), st
    assert st.message.startswith(line)


def test_a_failure_that_differs_between_nodes_is_retried(
    etcd_server: Any, reaper: Any, tmp_path: Path
) -> None:
    nodes = start_nodes(
        tmp_path, etcd_server.endpoint, "per-node", PER_NODE, reaper, "--set", "rendezvous.failure_budget=1"
    )
    for node in nodes:
        _, err = node.communicate(timeout=240)
        assert node.returncode == 1, err
        assert "failure budget exhausted for run 'per-node'" in err, err
    with connect(etcd_server.endpoint) as etcd:
        st = read_status(etcd, "per-node")
    assert st.failures_used == 2, st  # retried once, then the budget ran out: the rule did not apply


def test_an_exception_in_the_first_step_under_local_ends_the_run_with_its_line_first(
    reaper: Any, tmp_path: Path
) -> None:
    """``elastic-train local``: the script's exception (its text differs by rank), one failure report per
    node, and the line says where the full error is."""
    script = tmp_path / "train.py"
    script.write_text(FIRST_STEP)
    cmd = [
        sys.executable, "-m", "elastic_train", "--log-format", "json", "--log-level", "warning", "local",
        "--nodes", "2", "--run-id", "first-step", "--timeout", "240", "--set", "rendezvous.lease_ttl=2",
        "--set", "rendezvous.settle=0.5", "--workdir", str(tmp_path / "work"), "--entry", str(script),
    ]  # fmt: skip
    proc = reaper.popen(cmd, env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                        cwd=tmp_path)  # fmt: skip
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err
    [line] = [ln for ln in error_lines(err) if ln.startswith("elastic-train")]
    assert line.startswith("elastic-train: error: run first-step failed: RuntimeError: rank "), line
    assert "(exit code 1 on all 2 nodes before the first step; not retried)" in line, line
    assert line.endswith(f"the node logs in {tmp_path / 'work'} have the full error"), line


def test_a_silent_script_under_plain_torchrun_ends_the_run_by_its_exit_code(
    etcd_server: Any, reaper: Any, tmp_path: Path
) -> None:
    """A script that reports nothing: what torchrun saw of its workers (the exit code) is the report."""
    script = tmp_path / "train.py"
    script.write_text(SILENT)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2:2", "--nproc-per-node=1",
        "--rdzv-backend=etcd3", f"--rdzv-endpoint={etcd_server.endpoint}", "--rdzv-id=silent",
        "--rdzv-conf=lease_ttl=2,settle=0.5", "--local-addr=127.0.0.1", "--monitor-interval=0.1",
        "--max-restarts=100", str(script),
    ]  # fmt: skip
    nodes = [reaper.popen(cmd, env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          cwd=tmp_path) for _ in range(2)]  # fmt: skip
    for node in nodes:
        _, err = node.communicate(timeout=240)
        assert node.returncode == 2, err
        assert "Traceback" not in err, err
        why = "exit code 3 on all 2 nodes before the first step; not retried"
        assert (
            f"elastic-train: error: run silent failed: the workers exited with exit code 3 ({why})" in err
        ), err
    with connect(etcd_server.endpoint) as etcd:
        st = read_status(etcd, "silent")
    assert (st.state, st.failures_used) == ("failed", 0), st
