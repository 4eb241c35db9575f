"""Real torchrun agents on the etcd3 rendezvous, a tiny gloo DDP worker, faults by PID (loopback only)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_train.etcd.client import connect
from elastic_train.procs import signal_tree, tree
from elastic_train.rendezvous.status import read_status

pytestmark = pytest.mark.slow

WORKER = str(Path(__file__).with_name("rdzv_worker.py"))
ROOT = str(Path(__file__).resolve().parents[2])


class Job:
    def __init__(self, endpoint: str, run_id: str, tmp: Path, reaper, conf: str = "") -> None:
        self.endpoint, self.run_id, self.tmp, self.reaper, self.conf = endpoint, run_id, tmp, reaper, conf
        self.out = tmp / "steps.jsonl"
        self.agents: list[subprocess.Popen] = []

    def start_agent(self, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        env = dict(
            os.environ, GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1", RDZV_WORKER_OUT=str(self.out)
        )
        env.update(extra_env or {})
        conf = f"lease_ttl=2,settle=1{',' + self.conf if self.conf else ''}"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2:4", "--nproc-per-node=1",
            "--rdzv-backend=etcd3", f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.run_id}",
            f"--rdzv-conf={conf}", "--local-addr=127.0.0.1", "--monitor-interval=0.1", "--max-restarts=100",
            WORKER,
        ]  # fmt: skip
        log = open(self.tmp / f"agent{len(self.agents)}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = self.reaper.popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.agents.append(proc)
        return proc

    def lines(self) -> list[dict]:
        if not self.out.exists():
            return []
        return [json.loads(x) for x in self.out.read_text().splitlines() if x.strip()]

    def wait_training(self, world: int, after_round: int = 0, timeout: float = 120.0) -> dict:
        """Wait for a step (>= 2) at world size ``world`` in a round after ``after_round``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in reversed(self.lines()[-50:]):
                if line["world_size"] == world and line["round"] > after_round and line["step"] >= 2:
                    return line
            time.sleep(0.2)
        raise AssertionError(f"no training at world {world} after round {after_round}: {self.lines()[-3:]}")


def test_start_kill_join_and_etcd_restart(etcd_server, reaper, tmp_path):
    job = Job(etcd_server.endpoint, "tr-kill", tmp_path, reaper)
    for _ in range(3):
        job.start_agent()
    first = job.wait_training(3)

    victim = job.agents[2]
    procs = tree(victim.pid)  # snapshot before killing: workers live in their own session
    for p in procs:
        p.kill()
    lost = job.wait_training(2, after_round=first["round"])

    job.start_agent()
    grown = job.wait_training(3, after_round=lost["round"])

    etcd = connect(etcd_server.endpoint)
    st = read_status(etcd, "tr-kill")
    assert st.world_size == 3 and st.round == grown["round"] and st.failures_used >= 1
    etcd.close()

    etcd_server.restart(down_for=2.0)
    step_before = job.lines()[-1]["step"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and job.lines()[-1]["step"] < step_before + 40:
        time.sleep(0.2)
    last = job.lines()[-1]
    assert last["step"] >= step_before + 40 and last["round"] == grown["round"], "training did not continue"


@pytest.mark.long
def test_sigstop_is_cut_out_and_sigcont_rejoins(etcd_server, reaper, tmp_path):
    job = Job(etcd_server.endpoint, "tr-stop", tmp_path, reaper)
    for _ in range(3):
        job.start_agent()
    first = job.wait_training(3)
    frozen = job.agents[1]
    try:
        signal_tree(frozen.pid, signal.SIGSTOP)
        cut = job.wait_training(2, after_round=first["round"])
    finally:
        signal_tree(frozen.pid, signal.SIGCONT)
    job.wait_training(3, after_round=cut["round"])


def test_failure_budget_exhausted_stops_every_agent(etcd_server, reaper, tmp_path):
    job = Job(etcd_server.endpoint, "tr-budget", tmp_path, reaper, conf="failure_budget=0")
    job.start_agent()
    job.start_agent({"RDZV_WORKER_CRASH_AT": "3"})
    codes = [a.wait(timeout=120) for a in job.agents]
    assert all(c != 0 for c in codes), codes
    for i in range(2):
        assert "failure budget exhausted" in (tmp_path / f"agent{i}.log").read_text()
