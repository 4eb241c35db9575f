"""A script that fails the same way on every node before its first step (a usage error, exit 2) is not
retried: the run fails at once, no failure budget spent, and every node's top line is the script's own error.

Real etcd, two ``elastic-train run --entry`` nodes on loopback, real scripts using argparse.
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
