"""A node partitioned from etcd while the job trains: plain torchrun etcd3 and ``elastic-train run``.

Each node reaches etcd through a loopback link of its own; the victim's goes silent (bytes held, no reset)
for a while, then heals. Asserted: the others train at world 2 within TTL + a few seconds, the victim's
workers are gone within TTL + grace, the victim rejoins on heal, the healed cut spends one unit of the failure
budget, and no agent prints a traceback.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from elastic_train.config import load_job_config
from elastic_train.etcd.client import connect
from elastic_train.launch.faults import Fault
from elastic_train.launch.local import LocalJob, LocalOptions
from elastic_train.procs import tree
from elastic_train.rendezvous.fence import FENCE_GRACE, KILL_GRACE
from elastic_train.rendezvous.status import read_status
from elastic_train.train.events import read_events
from tests.helpers import wait_world
from tests.netproxy import LatencyProxy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(Path(__file__).with_name("rdzv_worker.py"))
TTL = 2.0
CUT_S = 8.0
#: How soon after the cut the victim's workers must be gone: on an etcd-only cut they train until the others
#: see the lease expire and re-form (a TTL and a round close, 1 s), then the fence needs etcd silence and a
#: stall of TTL + grace each, then its kill grace.
GONE_WITHIN = TTL + 1.0 + TTL + FENCE_GRACE + KILL_GRACE


def test_torchrun_node_cut_off_from_etcd_is_fenced_and_rejoins(etcd_server, reaper, tmp_path: Path) -> None:
    host, _, port = etcd_server.endpoint.rpartition(":")
    out = tmp_path / "steps.jsonl"
    proxies = [LatencyProxy(host, int(port)).start() for _ in range(3)]
    try:
        agents = []
        for i, proxy in enumerate(proxies):
            env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", RDZV_WORKER_OUT=str(out), PYTHONPATH=str(ROOT))
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes=2:3", "--nproc-per-node=1",
                "--rdzv-backend=etcd3", f"--rdzv-endpoint={proxy.endpoint}", "--rdzv-id=part-tr",
                f"--rdzv-conf=lease_ttl={TTL:g},settle=1", "--local-addr=127.0.0.1", "--monitor-interval=0.1",
                "--max-restarts=100", WORKER,
            ]  # fmt: skip
            log = open(tmp_path / f"agent{i}.log", "wb")  # noqa: SIM115 - closed with the process
            agents.append(reaper.popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT)))
        first = wait_world(out, 3, 0, 120)
        victim = agents[2]
        workers = tree(victim.pid)[1:]
        assert workers

        proxies[2].silence()
        cut = time.monotonic()
        _, alive = psutil.wait_procs(workers, timeout=GONE_WITHIN + 2)
        gone_s = time.monotonic() - cut
        assert not alive and gone_s <= GONE_WITHIN, f"victim's workers gone after {gone_s:.1f}s"
        etcd = connect(etcd_server.endpoint)

        def reformed() -> bool:
            kv = etcd.get("/elastic_train/part-tr/round")
            return kv is not None and len(json.loads(kv.value)["members"]) == 2

        while not reformed():  # the others re-form without it within TTL + a few seconds ...
            assert time.monotonic() - cut <= TTL + 4, "the others did not re-form at world 2"
            time.sleep(0.05)
        reformed_s = time.monotonic() - cut
        smaller = wait_world(out, 2, first["round"], 60)  # ... and train (their workers start from scratch)
        print(f"torchrun partition: workers gone {gone_s:.2f}s, re-formed {reformed_s:.2f}s after the cut")

        time.sleep(max(0.0, CUT_S - (time.monotonic() - cut)))
        proxies[2].heal()
        wait_world(out, 3, smaller["round"], 60)  # the victim is back
        kv = etcd.get("/elastic_train/part-tr/failures")
        assert kv is not None and int(kv.value) == 1
        assert victim.poll() is None
        for i in range(3):  # the agents print none (a worker whose peers reset it may: that is the script's)
            agent_lines = [
                line
                for line in (tmp_path / f"agent{i}.log").read_text(errors="replace").splitlines()
                if not line.startswith("[rank")
            ]
            assert not [line for line in agent_lines if "Traceback" in line], f"agent{i}"
    finally:
        for proxy in proxies:
            proxy.stop()


@pytest.mark.long
def test_elastic_train_run_node_cut_off_from_etcd_is_fenced_and_rejoins(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    steps = 400
    ov = {
        "rendezvous.run_id": "part-run",
        "rendezvous.min_nodes": 2,
        "rendezvous.max_nodes": 3,
        "rendezvous.lease_ttl": TTL,
        "train.task": "tests.fault_task:build",
        "train.task_args": {"step_delay": 0.05},
        "train.steps": steps,
        "checkpoint.url": str(tmp_path / "ckpt"),
        "checkpoint.every_steps": 10,
    }
    cfg = load_job_config(None, ov)
    job = LocalJob(
        cfg,
        LocalOptions(
            config_path=None, overrides=ov, nodes=3, faults=[Fault(kind="partition-etcd", node=2, step=20)],
            workdir=str(tmp_path / "work"), timeout=240.0, out=io.StringIO(),
        ),
    )  # fmt: skip
    summary = job.run()
    assert summary.succeeded and summary.completed_steps == steps, f"logs in {tmp_path / 'work'}"
    (record,) = summary.faults
    print("elastic-train run partition:", json.dumps(record.to_json()))
    assert record.extra["workers_gone_s"] <= GONE_WITHIN, record.to_json()
    assert record.resumed_world_size == 2 and record.resumed_at is not None and record.fired_at is not None
    assert record.resumed_at - record.fired_at <= TTL + 8, record.to_json()
    assert record.extra["healed_s"] >= record.to_json()["resumed_s"]  # type: ignore[operator]
    events = read_events(os.path.join(job.opts.workdir, "events.jsonl"))
    healed_at = record.fired_at + float(record.extra["healed_s"])  # type: ignore[arg-type]
    assert any(e["event"] == "step" and e["world_size"] == 3 and e["time"] > healed_at for e in events)
    assert job.final_status is not None and job.final_status.failures_used == 1
    for n in job.nodes:  # the agents print none (a worker whose peers reset it may: torch's own report)
        lines = Path(n.log_path).read_text(errors="replace").splitlines()
        agent_lines = [line for line in lines if not line.startswith("[rank")]
        assert not [line for line in agent_lines if "Traceback" in line], n.log_path


SLOW_OWN_LOOP = str(Path(__file__).with_name("slow_own_loop.py"))
LINGER_S = 8.0


def test_a_node_cut_off_as_its_workers_finish_ends_with_the_others(
    etcd_server, reaper, tmp_path: Path
) -> None:
    """Both workers committed the final checkpoint and take a while to exit (``LINGER_S``); node 1 is cut
    off from etcd then, so its lease expires while they linger. Its workers are done: its agent lets them
    exit into torchrun's exit barrier, where the other agent waits for it, instead of stopping them for a
    round that never comes (that agent would then end the run without the barrier, and the other would
    wait out torchrun's ``exit_barrier_timeout``, 300 s). Both agents end with status 0 soon after the
    workers and the heal; the run is ``finished``."""
    host, _, port = etcd_server.endpoint.rpartition(":")
    marks = tmp_path / "finalized"
    proxies = [LatencyProxy(host, int(port)).start() for _ in range(2)]
    try:
        agents = []
        for i, proxy in enumerate(proxies):
            env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(ROOT), LINGER=f"{LINGER_S:g}",
                       LINGER_MARK=str(marks))  # fmt: skip
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                "--rdzv-backend=etcd3", f"--rdzv-endpoint={proxy.endpoint}", "--rdzv-id=fin-cut",
                f"--rdzv-conf=lease_ttl={TTL:g},settle=0.5", "--local-addr=127.0.0.1",
                "--monitor-interval=0.1", "--max-restarts=3", SLOW_OWN_LOOP, "0.05", "--epochs=1",
                "--workers=0", f"--checkpoint={tmp_path / 'ckpt'}",
            ]  # fmt: skip
            log = open(tmp_path / f"agent{i}.log", "wb")  # noqa: SIM115 - closed with the process
            agents.append(reaper.popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(tmp_path)))
        deadline = time.monotonic() + 120
        while not (marks.exists() and len(marks.read_text().split()) == 2):
            assert time.monotonic() < deadline, "no final checkpoint"
            assert all(a.poll() is None for a in agents), "an agent ended before the final checkpoint"
            time.sleep(0.05)
        proxies[1].silence()  # the workers linger for LINGER_S: the lease (TTL) expires meanwhile
        cut = time.monotonic()
        time.sleep(LINGER_S + 2)
        proxies[1].heal()
        codes = [a.wait(timeout=60) for a in agents]
        ended_s = time.monotonic() - cut
        logs = [(tmp_path / f"agent{i}.log").read_text(errors="replace") for i in range(2)]
        assert codes == [0, 0], logs
        assert ended_s <= LINGER_S + 2 + 35, f"the agents ended {ended_s:.1f} s after the cut"
        # neither node stopped its finished workers for a new round (each rank trained to the end once)
        assert "node_fenced" not in logs[1] and "hot_fallback" not in logs[0], logs
        assert sum(log.count('"training_done"') for log in logs) == 2, logs
        assert "exit barrier" not in " ".join(logs).lower(), logs
        etcd = connect(etcd_server.endpoint)
        assert read_status(etcd, "fin-cut").state == "finished"
    finally:
        for proxy in proxies:
            proxy.stop()
