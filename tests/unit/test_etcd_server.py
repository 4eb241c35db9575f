"""The embedded etcd (one member or a 3-member cluster): found, started on free loopback ports, usable,
stopped by PID; the endpoint parser and the connection settings."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import psutil
import pytest

from elastic_train.etcd.client import connect, grpc_options
from elastic_train.etcd.endpoints import format_endpoints, parse_endpoints
from elastic_train.etcd.errors import EtcdError
from elastic_train.etcd.releases import below_production_minimum
from elastic_train.etcd.server import EmbeddedEtcd, EtcdCluster, find_etcd_binary
from elastic_train.rendezvous.config import run_prefix


def test_put_get_lease_round_trip(any_etcd: EmbeddedEtcd) -> None:
    assert any_etcd.host == "127.0.0.1"
    with connect(any_etcd.endpoint) as etcd:
        etcd.put("/t/plain", b"v1")
        assert etcd.get("/t/plain").value == b"v1"  # type: ignore[union-attr]
        lease = etcd.lease_grant(1)
        etcd.put("/t/leased", b"alive", lease)
        assert etcd.get("/t/leased").value == b"alive"  # type: ignore[union-attr]
        deadline = time.monotonic() + 10
        while etcd.get("/t/leased") is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert etcd.get("/t/leased") is None, "lease expiry must delete the key"


def test_stop_removes_process_and_data(etcd_server: EmbeddedEtcd) -> None:
    pid, data_dir = etcd_server.pid, etcd_server.data_dir
    assert pid is not None and psutil.pid_exists(pid)
    etcd_server.stop()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    import os

    assert not os.path.exists(data_dir)


def test_restart_keeps_data(etcd_server: EmbeddedEtcd) -> None:
    with connect(etcd_server.endpoint) as etcd:
        etcd.put("/t/durable", b"yes")
        # A single-member etcd below 3.5.5 / 3.4.21 (the bundled 3.5.1 is one) answers a put once it is
        # applied, possibly before its WAL write (etcd #14370): a kill right after can lose it. A second
        # put is applied only after the first one's WAL write, so its answer makes the first one durable.
        etcd.put("/t/barrier", b"")
    etcd_server.restart(down_for=0.2)
    with connect(etcd_server.endpoint) as etcd:
        assert etcd.get("/t/durable").value == b"yes"  # type: ignore[union-attr]


def test_a_member_says_its_release_and_status_warns_of_a_lossy_one(etcd_server: EmbeddedEtcd) -> None:
    with connect(etcd_server.endpoint) as etcd:
        assert etcd.server_version() == etcd_server.version
        etcd.put(run_prefix("seen") + "config", b"{}")  # a run etcd knows (its config unreadable)
    proc = subprocess.run(
        [sys.executable, "-m", "elastic_train", "status", "--endpoint", etcd_server.endpoint,
         "--run-id", "seen"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.startswith("run seen: "), proc.stdout + proc.stderr
    warned = [line for line in proc.stderr.splitlines() if line.startswith("elastic-train: warning: etcd ")]
    minimum = below_production_minimum(etcd_server.version)
    if minimum is None:
        assert warned == [], warned
    else:
        assert len(warned) == 1 and f"is older than {minimum}" in warned[0], warned


def test_missing_binary_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ETCD_BINARY", "/nonexistent/etcd")
    with pytest.raises(EtcdError, match="not an executable"):
        find_etcd_binary()


def test_cli_serves_real_etcd() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "elastic_train", "etcd", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "serving on 127.0.0.1:" in line, line
        endpoint = line.split("serving on ")[1].split()[0]
        with connect(endpoint) as etcd:
            etcd.put("/cli", b"ok")
            assert etcd.get("/cli").value == b"ok"  # type: ignore[union-attr]
        proc.send_signal(2)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_serves_a_three_member_cluster() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "elastic_train", "etcd", "--members", "3", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "(3 members, dev/test only) serving on " in line, line
        endpoint = line.split("serving on ")[1].split()[0]
        pids = [int(p) for p in line.split("(pid ")[1].split(")")[0].split(", ")]
        assert len(endpoint.split(",")) == 3 and len(pids) == 3
        etcd = connect(endpoint)
        etcd.put("/cli3", b"ok")
        for ep in endpoint.split(","):  # every member serves the same data
            one = connect(ep)
            assert one.get("/cli3").value == b"ok"  # type: ignore[union-attr]
            one.close()
        etcd.close()
        proc.send_signal(2)
        assert proc.wait(timeout=30) == 0
        assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cluster_elects_a_new_leader_and_a_killed_member_rejoins(etcd_cluster: EtcdCluster) -> None:
    assert len(etcd_cluster.endpoint.split(",")) == 3 and etcd_cluster.healthy()
    leader = etcd_cluster.leader()
    assert etcd_cluster.members[leader].is_leader()
    etcd = connect(etcd_cluster.endpoint)
    etcd.put("/before", b"1")
    etcd_cluster.kill(leader)
    new = etcd_cluster.leader(timeout=30)
    assert new != leader
    etcd.put("/during", b"2")  # fails over if it was on the killed member
    etcd_cluster.start_member(leader)
    only = connect(etcd_cluster.members[leader].endpoint, connect_timeout=10)  # gRPC may still back off
    deadline = time.monotonic() + 30
    while only.get("/during") is None and time.monotonic() < deadline:  # it catches up from its peers
        time.sleep(0.2)
    assert only.get("/during") is not None and only.get("/before") is not None
    only.close()
    etcd.close()


def test_cluster_pause_and_resume_a_member(etcd_cluster: EtcdCluster) -> None:
    m = etcd_cluster.members[0]
    etcd_cluster.pause(0)
    try:
        deadline = time.monotonic() + 5  # SIGSTOP is delivered asynchronously
        while psutil.Process(m.pid).status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
            time.sleep(0.02)
        assert psutil.Process(m.pid).status() == psutil.STATUS_STOPPED
        assert not m.healthy()
    finally:
        etcd_cluster.resume(0)
    deadline = time.monotonic() + 30
    while not m.healthy() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert m.healthy()


def test_cluster_rejects_a_bad_size() -> None:
    with pytest.raises(EtcdError, match="at least one member"):
        EtcdCluster(0)
    with pytest.raises(EtcdError, match="2 client ports given for 3 members"):
        EtcdCluster(3, client_ports=[1, 2])


@pytest.mark.parametrize(
    ("text", "pairs"),
    [
        ("h:1", [("h", 1)]),
        ("etcd-host", [("etcd-host", 2379)]),
        ("a:2380, b ,http://c:3/", [("a", 2380), ("b", 2379), ("c", 3)]),
        ("[::1]", [("::1", 2379)]),
        ("[::1]:2400", [("::1", 2400)]),
        ("10.0.0.7", [("10.0.0.7", 2379)]),
    ],
)
def test_parse_endpoints_defaults_the_port_to_2379(text: str, pairs: list[tuple[str, int]]) -> None:
    assert parse_endpoints(text) == pairs
    assert parse_endpoints(format_endpoints(pairs)) == pairs  # the canonical form reads back the same


@pytest.mark.parametrize("text", ["", "a:", "a:x", "a:0", "a:70000", "::1", "a,,b", "[::1", "a b:1"])
def test_parse_endpoints_rejects_bad_entries_in_one_line(text: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_endpoints(text)
    assert "\n" not in str(info.value)
    with pytest.raises(EtcdError, match="etcd endpoint"):  # the client says the same, as its own error
        connect(text)


def test_rendezvous_config_checks_timeouts_against_each_other() -> None:
    from elastic_train.errors import ConfigError
    from elastic_train.rendezvous.params import conf_to_config, rdzv_conf

    base = {"endpoint": "etcd-host", "run_id": "r", "min_nodes": 1, "max_nodes": 2}
    cfg = conf_to_config({"connect_timeout": "5", "rpc_timeout": "2", "keepalive_interval": "1"}, **base)
    assert (cfg.connect_timeout, cfg.rpc_timeout, cfg.keepalive_every) == (5.0, 2.0, 1.0)
    assert conf_to_config({}, **base).keepalive_every == pytest.approx(1.0)  # lease_ttl 3 / 3
    assert rdzv_conf(cfg)["keepalive_interval"] == "1" and rdzv_conf(cfg)["connect_timeout"] == "5"
    with pytest.raises(ConfigError, match=r"keepalive_interval: 2 s does not fit lease_ttl 3 s"):
        conf_to_config({"keepalive_interval": "2"}, **base)
    with pytest.raises(ConfigError, match="rpc_timeout"):
        conf_to_config({"rpc_timeout": "0"}, **base)
    with pytest.raises(ConfigError, match="connect_timeout"):
        conf_to_config({"connect_timeout": "-1"}, **base)
    with pytest.raises(ConfigError, match="endpoint: etcd endpoint 'a:x'"):
        conf_to_config({}, **{**base, "endpoint": "a:x"})


def test_grpc_connect_deadline_is_apart_from_the_reconnect_backoff() -> None:
    """gRPC core takes min_reconnect_backoff_ms as the connection deadline: it must allow slow links."""
    opts = dict(grpc_options())
    assert opts["grpc.min_reconnect_backoff_ms"] >= 2000
    assert opts["grpc.initial_reconnect_backoff_ms"] <= 200 and opts["grpc.max_reconnect_backoff_ms"] <= 2000


def _occupy(port: int) -> socket.socket:
    """Listen on ``port`` of loopback (as another process that took it between pick and bind)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_a_picked_port_taken_before_etcd_binds_it_moves_the_server_to_other_ports() -> None:
    server = EmbeddedEtcd()
    taken = server.client_port
    with _occupy(taken), server:
        assert server.client_port != taken
        with connect(server.endpoint) as etcd:
            etcd.raw.put("k", "v")


def test_a_picked_peer_port_taken_moves_the_whole_cluster_to_other_ports() -> None:
    cluster = EtcdCluster(3)
    taken = cluster.members[1].peer_port
    with _occupy(taken), cluster:
        assert taken not in [m.peer_port for m in cluster.members]
        assert cluster.healthy()


def test_a_given_port_in_use_is_an_error_not_a_move() -> None:
    server = EmbeddedEtcd()
    with _occupy(server.client_port) as s:
        fixed = EmbeddedEtcd(client_port=s.getsockname()[1])
        with pytest.raises(EtcdError, match="address already in use"):
            fixed.start(timeout=20)
        fixed.stop()
    server.stop()
