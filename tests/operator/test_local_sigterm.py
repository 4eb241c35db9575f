"""``elastic-train local`` stopped with SIGTERM (a CI timeout, ``kill``) ends its job as Ctrl-C does: its
nodes (each in a session of its own, which would otherwise train on unwatched), their workers and etcd are
gone, and no shared-memory snapshot of the run is left."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from elastic_train.checkpoint.shmfiles import snapshot_files

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


def test_sigterm_stops_every_node_of_a_local_job(tmp_path: Path) -> None:
    workdir = tmp_path / "work"
    run_id = "local-sigterm"
    cmd = [
        sys.executable, "-m", "elastic_train", "local", "--nodes", "2", "--workdir", str(workdir),
        "--set", f'rendezvous.run_id="{run_id}"', "--set", "train.steps=100000",
        "--set", f'checkpoint.url="{tmp_path / "ckpt"}"', "--timeout", "250",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    started: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 200
        events = workdir / "events.jsonl"
        while not (events.exists() and '"step"' in events.read_text()):
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the job did not start training"
            time.sleep(0.2)
        started = psutil.Process(proc.pid).children(recursive=True)
        nodes = [p for p in started if "run" in p.cmdline() and "elastic_train" in " ".join(p.cmdline())]
        assert len(nodes) >= 2, [p.cmdline() for p in started]
        # the nodes' own trees (agents in sessions of their own: not the launcher's descendants any more
        # once it is gone)
        for node in nodes:
            started += node.children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM
        _gone, alive = psutil.wait_procs(started, timeout=30)
        assert not alive, f"left running: {[p.cmdline()[:4] for p in alive]}"
        assert snapshot_files("/dev/shm", run_id) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in started:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
