"""etcd over real networks: slow links (a latency proxy), etcd that starts late, a 3-member etcd that loses a
member, its leader or its quorum while a job trains, and torchrun's endpoint forms.

Every process runs on loopback; the slow link is :class:`tests.netproxy.LatencyProxy`.
"""

from __future__ import annotations

import io
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import structlog

from elastic_train.config import load_job_config
from elastic_train.etcd.client import connect
from elastic_train.etcd.errors import EtcdError
from elastic_train.etcd.server import EmbeddedEtcd, EtcdCluster
from elastic_train.launch.faults import Fault
from elastic_train.launch.local import QUORUM_LOSS_SECONDS, LocalJob, LocalOptions
from elastic_train.net import free_port
from elastic_train.procs import tree
from elastic_train.rendezvous.protocol import Participant, ProtocolSettings
from elastic_train.rendezvous.view import LeaseKeeper
from elastic_train.train.audit import check_exactly_once
from tests.integration.test_rendezvous_torchrun import Job
from tests.netproxy import LatencyProxy

ROOT = Path(__file__).resolve().parents[2]


def join_round(endpoint: str, run_id: str, n: int = 2) -> list[int]:
    """``n`` participants (each its own client) join one round through ``endpoint``; their world sizes."""
    settings = ProtocolSettings(run_id=run_id, min_nodes=n, max_nodes=n, lease_ttl=3.0, settle=0.5)
    ps = [
        Participant(connect(endpoint, timeout=5.0), settings, addr="127.0.0.1", node_id=f"n{i}")
        for i in range(n)
    ]
    sizes: list[int] = []
    errors: list[BaseException] = []

    def run(p: Participant) -> None:
        try:
            sizes.append(p.join().world_size)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(p,)) for p in ps]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        for p in ps:
            p.leave()
            p.etcd.close()
    assert not errors, errors
    return sizes


# -- slow links ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("delay_ms", [0, 50, 100, 250])
def test_rendezvous_through_a_slow_link(etcd_server: EmbeddedEtcd, delay_ms: int) -> None:
    """Connection set-up, every RPC, leases and the watch work at up to 500 ms round trip."""
    with LatencyProxy("127.0.0.1", etcd_server.client_port, delay=delay_ms / 1000) as proxy:
        t0 = time.monotonic()
        etcd = connect(proxy.endpoint)
        assert time.monotonic() - t0 >= 4 * delay_ms / 1000 * 0.9  # it did go through the delay
        etcd.put("/probe", b"1")
        etcd.close()
        assert join_round(proxy.endpoint, f"slow-{delay_ms}") == [2, 2]


@pytest.mark.slow
@pytest.mark.parametrize(
    "delay_ms",
    [pytest.param(d, marks=pytest.mark.long) for d in (0, 50, 100)] + [250],  # make test: the slowest link
)
def test_small_job_through_a_slow_link(
    etcd_server: EmbeddedEtcd, reaper: Any, tmp_path: Path, delay_ms: int
) -> None:
    """Two torchrun agents reach etcd through the proxy, train, and lose a node without stopping."""
    with LatencyProxy("127.0.0.1", etcd_server.client_port, delay=delay_ms / 1000) as proxy:
        job = Job(proxy.endpoint, f"slow-job-{delay_ms}", tmp_path, reaper)
        for _ in range(3):
            job.start_agent()
        first = job.wait_training(3, timeout=180)
        for p in tree(job.agents[2].pid):
            p.kill()
        job.wait_training(2, after_round=first["round"], timeout=180)


def test_keepalive_deadline_fits_the_lease(etcd_server: EmbeddedEtcd) -> None:
    """A keep-alive interval that leaves no retry inside the TTL is refused; the default fits."""
    etcd = connect(etcd_server.endpoint)
    try:
        with pytest.raises(ValueError, match="does not fit lease TTL"):
            LeaseKeeper(etcd, 3.0, lambda _lease: None, interval=2.0)
        keeper = LeaseKeeper(etcd, 3.0, lambda _lease: None)
        assert keeper.interval == pytest.approx(1.0)
    finally:
        etcd.close()


# -- waiting for etcd ---------------------------------------------------------------------------------------


def test_waits_for_an_etcd_that_starts_later() -> None:
    port = free_port()
    result: dict[str, Any] = {}

    def client() -> None:
        t0 = time.monotonic()
        try:
            result["etcd"] = connect(f"127.0.0.1:{port}", connect_timeout=60)
        except EtcdError as exc:
            result["error"] = exc
        result["seconds"] = time.monotonic() - t0

    with structlog.testing.capture_logs() as logs:
        t = threading.Thread(target=client)
        t.start()
        time.sleep(3.0)
        with EmbeddedEtcd(client_port=port) as server:
            t.join(timeout=60)
            assert "error" not in result, result
            result["etcd"].put("/late", b"ok")
            assert server.healthy()
            result["etcd"].close()
    assert result["seconds"] >= 3.0
    waiting = [e for e in logs if e["event"] == "etcd_waiting"]
    assert waiting, logs
    assert waiting[0]["message"] == f"waiting for etcd at 127.0.0.1:{port}: connection refused (0 s of 60 s)"


def test_unreachable_endpoint_list_is_one_line_after_connect_timeout() -> None:
    eps = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(EtcdError) as info:
        connect(eps, connect_timeout=3.0)
    took = time.monotonic() - t0
    assert 2.0 <= took < 15, took
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"cannot reach etcd at {eps}") and "connection refused" in msg and "gave up" in msg


def test_an_unreachable_member_is_skipped(etcd_server: EmbeddedEtcd) -> None:
    dead = f"127.0.0.1:{free_port()}"
    for _ in range(6):  # the first member tried is random
        eps = [dead, etcd_server.endpoint]
        random.shuffle(eps)
        etcd = connect(",".join(eps), connect_timeout=0)
        assert etcd.member == etcd_server.endpoint
        etcd.put("/x", b"1")
        etcd.close()


def test_credentials_and_tls_errors_are_not_retried(etcd_server: EmbeddedEtcd, tmp_path: Path) -> None:
    """A wrong password or a TLS client against a plain-text etcd fails at once, not after connect_timeout."""
    from elastic_train.etcd.config import TLSConfig
    from elastic_train.etcd.server import find_etcd_binary

    ctl = find_etcd_binary("etcdctl")
    ep = etcd_server.endpoint
    run = {"check": True, "capture_output": True, "timeout": 30, "env": {"ETCDCTL_API": "3"}}
    subprocess.run([ctl, f"--endpoints={ep}", "user", "add", "root", "--new-user-password=rootpw"], **run)
    subprocess.run([ctl, f"--endpoints={ep}", "auth", "enable"], **run)
    t0 = time.monotonic()
    with pytest.raises(EtcdError, match="authentication failed"):
        connect(ep, user="root", password="wrong-pw", connect_timeout=60)
    assert time.monotonic() - t0 < 10
    connect(ep, user="root", password="rootpw", connect_timeout=60).close()

    ca = tmp_path / "ca.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(tmp_path / "ca.key"), "-out", str(ca), "-days", "2", "-subj", "/CN=ca"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    t0 = time.monotonic()
    with pytest.raises(EtcdError, match="TLS"):
        connect(ep, tls=TLSConfig(ca_file=str(ca)), connect_timeout=60)
    assert time.monotonic() - t0 < 15


# -- the default port ---------------------------------------------------------------------------------------


def _loopback_2379() -> str:
    """A loopback address with port 2379 free on it (skips the test when none is found)."""
    for _ in range(20):
        host = f"127.{random.randrange(1, 250)}.{random.randrange(1, 250)}.{random.randrange(2, 250)}"
        with socket.socket() as s:
            try:
                s.bind((host, 2379))
                return host
            except OSError:
                continue
    pytest.skip("no loopback address with port 2379 free")


@pytest.mark.slow
def test_rdzv_endpoint_without_a_port_is_2379(reaper: Any, tmp_path: Path) -> None:
    """``--rdzv-endpoint=HOST`` reaches etcd on HOST:2379 through torchrun, as torch's etcd backends do."""
    host = _loopback_2379()
    with EmbeddedEtcd(host=host, client_port=2379):
        job = Job(host, "default-port", tmp_path, reaper)
        job.start_agent()
        job.start_agent()
        job.wait_training(2, timeout=180)
    # and with nothing there, the message names the port it tried
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=1",
         "--rdzv-backend=etcd3", f"--rdzv-endpoint={host}", "--rdzv-id=nothing-there",
         "--rdzv-conf=connect_timeout=0", "--local-addr=127.0.0.1", "-m", "json.tool", "/dev/null"],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode != 0
    assert f"cannot reach etcd at {host}:2379" in proc.stderr + proc.stdout


# -- a 3-member etcd ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_failover_and_lease_survive_a_leader_kill(etcd_cluster: EtcdCluster) -> None:
    """A client on the leader fails over when it dies; the lease kept alive meanwhile is never lost."""
    etcd = connect(etcd_cluster.endpoint)
    leader = etcd_cluster.leader()
    etcd.use_member(etcd_cluster.members[leader].endpoint)
    lost: list[int] = []
    keeper = LeaseKeeper(etcd, 3.0, lambda lease: lost.append(lease) or etcd.put("/alive", b"1", lease))
    keeper.start()
    try:
        first = keeper.lease_id
        etcd_cluster.kill(leader)
        deadline = time.monotonic() + 30
        while True:  # a write during the election may time out; the rendezvous retries the same way
            try:
                etcd.put("/after", b"1")
                break
            except EtcdError:
                assert time.monotonic() < deadline, "no member took the write within 30 s"
        assert etcd.member != etcd_cluster.members[leader].endpoint
        time.sleep(7.0)  # more than two TTLs
        assert keeper.lease_id == first and lost == [first], "the lease was re-created: it expired"
        assert etcd.get("/alive") is not None
        etcd_cluster.start_member(leader)
    finally:
        keeper.stop()
        etcd.close()


@pytest.mark.slow
def test_job_starts_with_one_member_down(etcd_cluster: EtcdCluster, reaper: Any, tmp_path: Path) -> None:
    etcd_cluster.kill(0)  # the first member of the list
    job = Job(etcd_cluster.endpoint, "member-down", tmp_path, reaper)
    job.start_agent()
    job.start_agent()
    job.wait_training(2, timeout=180)


def run_local(tmp: Path, run_id: str, faults: list[Fault], steps: int = 60) -> tuple[LocalJob, Any]:
    ov = {
        "rendezvous.run_id": run_id,
        "rendezvous.min_nodes": 2,
        "rendezvous.max_nodes": 2,
        "train.task": "tests.chaos.chaos_task:build",
        "train.task_args": {"step_delay": 0.1},
        "train.steps": steps,
        "train.global_batch": 24,
        "train.seed": 3,
        "train.audit_dir": str(tmp / "audit"),
        "checkpoint.url": str(tmp / "ckpt"),
        "checkpoint.every_steps": 10,
    }
    cfg = load_job_config(None, ov)
    opts = LocalOptions(
        config_path=None, overrides=ov, nodes=2, faults=faults, workdir=str(tmp / "work"), timeout=300,
        out=io.StringIO(), etcd_members=3,
    )  # fmt: skip
    job = LocalJob(cfg, opts)
    return job, job.run()


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind", ["kill-etcd-leader", pytest.param("etcd-quorum-loss", marks=pytest.mark.long)]
)
def test_training_goes_on_through_etcd_leader_or_quorum_loss(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job finishes with every sample trained exactly once and at most one recovery."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    fault = Fault(kind=kind, step=15)
    job, summary = run_local(tmp_path, f"cluster-{kind}", [fault])
    fault = summary.faults[0]  # what happened to the planned fault
    assert summary.succeeded and summary.completed_steps == 60, job.opts.out.getvalue()[-2000:]
    audit = check_exactly_once(str(tmp_path / "audit"), steps=60)
    assert audit.ok, audit.problems[:5]
    rounds = {e.get("round") for e in job.step_events}
    assert len(rounds) <= 2, f"more than one recovery: rounds {sorted(rounds)}"
    assert fault.fired_at is not None
    if kind == "etcd-quorum-loss":
        # nothing else changed: training went on, in the same round, while etcd could not serve
        assert len(rounds) == 1, f"a recovery without a membership change: rounds {sorted(rounds)}"
        during = [
            e
            for e in job.step_events
            if fault.fired_at < float(e["time"]) < fault.fired_at + QUORUM_LOSS_SECONDS
        ]
        assert len(during) >= 5, f"only {len(during)} steps while etcd had no quorum"
