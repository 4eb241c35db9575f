"""The embedded etcd: found, started on a free loopback port, usable through etcd3, stopped by PID."""

from __future__ import annotations

import subprocess
import sys
import time

import etcd3
import psutil
import pytest

from elastic_train.etcd.errors import EtcdError
from elastic_train.etcd.server import EmbeddedEtcd, find_etcd_binary


def test_put_get_lease_round_trip(any_etcd: EmbeddedEtcd) -> None:
    assert any_etcd.host == "127.0.0.1"
    client = etcd3.client(any_etcd.host, any_etcd.client_port, timeout=5)
    try:
        client.put("/t/plain", "v1")
        assert client.get("/t/plain")[0] == b"v1"
        lease = client.lease(1)
        client.put("/t/leased", "alive", lease=lease)
        assert client.get("/t/leased")[0] == b"alive"
        deadline = time.monotonic() + 10
        while client.get("/t/leased")[0] is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert client.get("/t/leased")[0] is None, "lease expiry must delete the key"
    finally:
        client.close()


def test_stop_removes_process_and_data(etcd_server: EmbeddedEtcd) -> None:
    pid, data_dir = etcd_server.pid, etcd_server.data_dir
    assert pid is not None and psutil.pid_exists(pid)
    etcd_server.stop()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    import os

    assert not os.path.exists(data_dir)


def test_restart_keeps_data(etcd_server: EmbeddedEtcd) -> None:
    client = etcd3.client(etcd_server.host, etcd_server.client_port, timeout=5)
    client.put("/t/durable", "yes")
    client.close()
    etcd_server.restart(down_for=0.2)
    client = etcd3.client(etcd_server.host, etcd_server.client_port, timeout=5)
    try:
        assert client.get("/t/durable")[0] == b"yes"
    finally:
        client.close()


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
        host, port = endpoint.rsplit(":", 1)
        client = etcd3.client(host, int(port), timeout=5)
        client.put("/cli", "ok")
        assert client.get("/cli")[0] == b"ok"
        client.close()
        proc.send_signal(2)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
