"""etcd that does not answer is waited for and failed over; only certificates and credentials fail at once.

A partition as a node sees it, on loopback: a port that accepts connections and never sends a byte (a proxy
or firewall holding the traffic), a port whose SYNs are dropped (its accept queue full: gRPC reports "tcp
handshaker shutdown"), and a real etcd stopped with SIGSTOP (connections stay open, nothing answers).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from elastic_train.etcd.client import connect
from elastic_train.etcd.config import TLSConfig
from elastic_train.etcd.errors import EtcdError
from elastic_train.etcd.server import EmbeddedEtcd
from elastic_train.rendezvous.view import LeaseKeeper
from tests.helpers import make_ca, needs_openssl

ROOT = Path(__file__).resolve().parents[2]
#: How long the tests let a node wait for a silent etcd (the default is 60 s).
WAIT = 6.0


@contextlib.contextmanager
def silent_port(mode: str) -> Iterator[str]:
    """``HOST:PORT`` on loopback that never answers.

    ``accept``: connections are accepted and held, nothing is ever sent back. ``drop``: the listener's accept
    queue is full and it never accepts, so the kernel drops further SYNs and a connect times out.
    """
    server = socket.socket()
    held: list[socket.socket] = []
    stop = threading.Event()
    try:
        server.bind(("127.0.0.1", 0))
        port = server.getsockname()[1]
        if mode == "accept":
            server.listen(64)
            server.settimeout(0.2)

            def hold() -> None:
                while not stop.is_set():
                    with contextlib.suppress(TimeoutError, OSError):
                        held.append(server.accept()[0])

            threading.Thread(target=hold, daemon=True).start()
        else:
            server.listen(0)
            for _ in range(4):  # fill the accept queue (its length is backlog + 1) and then some
                c = socket.socket()
                c.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    c.connect(("127.0.0.1", port))
                held.append(c)
            time.sleep(0.3)
            probe = socket.socket()
            probe.settimeout(1.0)
            try:
                probe.connect(("127.0.0.1", port))
                pytest.skip("this kernel completes connections past a full accept queue (SYN cookies?)")
            except TimeoutError:
                pass
            finally:
                probe.close()
        yield f"127.0.0.1:{port}"
    finally:
        stop.set()
        for s in held:
            s.close()
        server.close()


@pytest.fixture(scope="module")
def ca_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    if not any(Path(p, "openssl").exists() for p in __import__("os").get_exec_path()):
        pytest.skip("openssl is needed to make a test CA")
    _key, cert = make_ca(tmp_path_factory.mktemp("ca"), "ca")
    return str(cert)


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.parametrize("mode", ["accept", "drop"])
def test_a_silent_etcd_is_waited_for_then_named_a_partition(mode: str, tls: bool, request: Any) -> None:
    """Before: "tcp handshaker shutdown" (drop) and "Handshake read failed (Endpoint closing)" (accept, TLS)
    counted as TLS failures, so a node gave up early with a false "TLS handshake ... failed"."""
    cfg = TLSConfig(ca_file=request.getfixturevalue("ca_file")) if tls else None
    with silent_port(mode) as ep:
        t0 = time.monotonic()
        with pytest.raises(EtcdError) as info:
            connect(ep, tls=cfg, timeout=5.0, connect_timeout=WAIT)
        took = time.monotonic() - t0
    msg = str(info.value)
    assert took >= WAIT, (took, msg)
    assert took < WAIT + 15, took
    assert msg.startswith(f"no answer from etcd at {ep} for "), msg
    assert "partitioned from it, or down?" in msg and "gave up after" in msg, msg
    assert "TLS" not in msg and "\n" not in msg


@pytest.mark.parametrize("mode", ["accept", "drop"])
def test_a_silent_member_is_failed_over(etcd_server: EmbeddedEtcd, mode: str) -> None:
    with silent_port(mode) as silent:
        for eps in ([silent, etcd_server.endpoint], [etcd_server.endpoint, silent]):
            for _ in range(2):  # the first member tried is random
                etcd = connect(",".join(eps), timeout=5.0, connect_timeout=0)
                try:
                    assert etcd.member == etcd_server.endpoint
                    etcd.put("/x", b"1")
                finally:
                    etcd.close()


@needs_openssl
def test_tls_against_plain_text_and_the_reverse_fail_at_once(etcd_server: EmbeddedEtcd, ca_file: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(EtcdError) as info:
        connect(etcd_server.endpoint, tls=TLSConfig(ca_file=ca_file), connect_timeout=60)
    assert time.monotonic() - t0 < 15
    assert str(info.value).startswith(
        f"etcd at {etcd_server.endpoint} serves plain text, but TLS is configured"
    )


@needs_openssl
def test_plain_text_against_tls_fails_at_once(tmp_path: Path) -> None:
    from tests.helpers import make_server_cert

    ca_key, ca = make_ca(tmp_path, "ca")
    cert, key = make_server_cert(tmp_path, ca_key, ca)
    with EmbeddedEtcd(tls=(str(cert), str(key), str(ca))) as server:
        t0 = time.monotonic()
        with pytest.raises(EtcdError) as info:
            connect(server.endpoint, connect_timeout=60)
        assert time.monotonic() - t0 < 15
        assert str(info.value).startswith(f"etcd at {server.endpoint} serves TLS, but no TLS is configured")


def test_a_node_started_while_etcd_is_silent_waits_connect_timeout_then_says_one_line(reaper: Any) -> None:
    """Plain torchrun with the etcd3 handler, etcd behind a port that drops every SYN (a full cut)."""
    with silent_port("drop") as ep:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=1",
            "--rdzv-backend=etcd3", f"--rdzv-endpoint={ep}", "--rdzv-id=cut-start",
            f"--rdzv-conf=connect_timeout={WAIT:g}", "--local-addr=127.0.0.1", "-m", "this",
        ]  # fmt: skip
        t0 = time.monotonic()
        proc = reaper.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        _, err = proc.communicate(timeout=120)
        took = time.monotonic() - t0
    assert proc.returncode == 1, err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("{")]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"torchrun: error: no answer from etcd at {ep} for "), lines
    assert "partitioned" in lines[0] and "TLS" not in lines[0], lines
    assert took >= WAIT, took


def test_hints_during_a_cut_name_a_partition(etcd_server: EmbeddedEtcd) -> None:
    """etcd stopped (SIGSTOP) under a live lease: what the keep-alive logs says partition, never "raise
    rpc_timeout" or "raise lease_ttl", also when the first keep-alive after the cut takes long."""
    etcd = connect(etcd_server.endpoint, timeout=1.0)
    keeper = LeaseKeeper(etcd, 2.0, lambda _lease: None)
    with structlog.testing.capture_logs() as logs:
        keeper.start()
        try:
            time.sleep(1.0)
            etcd_server.pause()
            try:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    failed = [e for e in logs if e["event"] == "lease_keepalive_failed"]
                    if len(failed) >= 2:  # attempts 1 and 10
                        break
                    time.sleep(0.2)
            finally:
                etcd_server.resume()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not any(
                e["event"] in ("lease_keepalive_recovered", "lease_recreated") for e in logs
            ):
                time.sleep(0.2)
        finally:
            keeper.stop()
            etcd.close()
    failed = [e for e in logs if e["event"] == "lease_keepalive_failed"]
    assert len(failed) >= 2, logs
    assert "partitioned from it" in failed[0]["error"], failed[0]
    assert failed[-1]["error"].startswith(f"no answer from etcd at {etcd_server.endpoint} for "), failed[-1]
    text = repr(logs)
    assert "rpc_timeout" not in text and "lease_ttl" not in text and "TLS" not in text, text
    assert not [e for e in logs if e["event"] == "lease_keepalive_slow"], logs
