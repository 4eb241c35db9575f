"""The etcd3-dynamic RendezvousBackend on real etcd.

CAS with fencing tokens, state expiry like torch's etcd-v2 backend, ``create_backend``'s rdzv-conf
(read_timeout, TLS under torch's etcd-v2 names, unknown and ignored keys), one-line errors under torchrun,
and a run id used again after its state expired. The store contract is in test_store_contract.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import structlog
from torch.distributed import DistNetworkError, DistStoreError
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousStateError,
)

from elastic_train.errors import ConfigError
from elastic_train.etcd.client import connect
from elastic_train.etcd.server import EmbeddedEtcd
from elastic_train.rendezvous import create_backend
from elastic_train.rendezvous.backend import Etcd3RendezvousBackend, Etcd3Store, NodeLease
from elastic_train.rendezvous.registry import create_etcd3_dynamic_handler
from tests.helpers import make_ca, make_server_cert, needs_openssl

ROOT = str(Path(__file__).resolve().parents[2])
WORKER = str(Path(__file__).with_name("rdzv_worker.py"))
STATE = "/elastic_train/{}/dynamic/state"


@pytest.fixture
def backend(any_etcd):
    etcd = connect(any_etcd.endpoint)
    yield Etcd3RendezvousBackend(etcd, "contract"), etcd
    etcd.close()


def params(endpoint: str, run_id: str = "dyn", **conf: str) -> RendezvousParameters:
    return RendezvousParameters("etcd3-dynamic", endpoint, run_id, 1, 2, local_addr="127.0.0.1", **conf)


# -- compare-and-set contract ------------------------------------------------------------------------------


def test_missing_state_is_none(backend):
    b, _ = backend
    assert b.get_state() is None


def test_none_token_sets_only_when_absent(backend):
    b, _ = backend
    state, token, ok = b.set_state(b"one")
    assert (state, ok) == (b"one", True)
    assert b.get_state() == (b"one", token)
    state2, token2, ok2 = b.set_state(b"two")
    assert (state2, token2, ok2) == (b"one", token, False)


def test_current_token_wins_old_token_loses(backend):
    b, _ = backend
    _, t1, _ = b.set_state(b"one")
    _, t2, ok = b.set_state(b"two", t1)
    assert ok and t2 != t1
    state, token, ok = b.set_state(b"three", t1)
    assert (state, token, ok) == (b"two", t2, False)
    assert b.get_state() == (b"two", t2)


def test_invalid_token_returns_current_state_unchanged(backend):
    b, _ = backend
    _, t1, _ = b.set_state(b"one")
    assert b.set_state(b"x", "not-a-token") == (b"one", t1, False)
    assert b.set_state(b"x", 10**9) == (b"one", t1, False)


def test_invalid_token_without_state_is_none(backend):
    b, _ = backend
    assert b.set_state(b"x", "bogus") is None


def test_corrupt_stored_state_raises_state_error(backend):
    b, etcd = backend
    etcd.put("/elastic_train/contract/dynamic/state", b"!!not base64!!")
    with pytest.raises(RendezvousStateError):
        b.get_state()
    with pytest.raises(RendezvousStateError):
        b.set_state(b"x")


def test_empty_run_id_is_refused_like_torchs_backends(etcd_server):
    etcd = connect(etcd_server.endpoint)
    with pytest.raises(ValueError, match="run id"):
        Etcd3RendezvousBackend(etcd, "")
    etcd.close()


# -- expiry (torch's etcd-v2 state TTL) --------------------------------------------------------------------


def test_state_ttl_defaults_to_torchs_two_hours(etcd_server):
    etcd = connect(etcd_server.endpoint)
    assert Etcd3RendezvousBackend(etcd, "r").ttl == 7200
    assert Etcd3RendezvousBackend(etcd, "r", ttl=0).ttl == 7200  # as torch: <= 0 means the default
    b = Etcd3RendezvousBackend(etcd, "r", ttl=30)
    b.set_state(b"s")
    kv = etcd.get(STATE.format("r"))
    assert kv is not None and kv.lease != 0
    ttl = etcd.raw.get_lease_info(kv.lease).TTL  # remaining seconds, read with the raw client
    assert 25 <= ttl <= 30
    etcd.close()


def test_state_expires_after_the_last_write_and_the_run_id_is_reusable(etcd_server):
    etcd = connect(etcd_server.endpoint)
    b = Etcd3RendezvousBackend(etcd, "ttl", ttl=3)
    _, token, _ = b.set_state(b"closed")
    time.sleep(2.0)
    _, token, ok = b.set_state(b"closed, rewritten", token)  # a write refreshes the TTL
    assert ok
    time.sleep(2.0)
    assert b.get_state() is not None, "expired 3 s after the first write, not after the last"
    deadline = time.monotonic() + 15
    while b.get_state() is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert b.get_state() is None, "the state never expired"
    fresh = Etcd3RendezvousBackend(etcd, "ttl", ttl=3)
    state, _, ok = fresh.set_state(b"new run")
    assert (state, ok) == (b"new run", True)
    etcd.close()


@pytest.mark.parametrize(
    ("ttl", "pause"),
    [
        pytest.param(
            7200, 0.0, id="lost-seen-by-the-write"
        ),  # no refresh due: the put fails, then a new lease
        pytest.param(
            5, 0.1, id="lost-seen-by-the-refresh"
        ),  # a refresh is due (> 5/100 s): keep-alive sees it
    ],
)
def test_a_lease_lost_while_stopped_is_replaced(etcd_server, ttl, pause):
    etcd = connect(etcd_server.endpoint)
    lease = NodeLease(etcd, ttl=ttl)
    b = Etcd3RendezvousBackend(etcd, "lost", lease=lease)
    b.set_state(b"one")
    lost = lease.current()
    etcd.lease_revoke(lost)  # as if this node was stopped longer than the TTL
    assert b.get_state() is None
    time.sleep(pause)
    state, _, ok = b.set_state(b"two")
    assert (state, ok) == (b"two", True)
    kv = etcd.get(STATE.format("lost"))
    assert kv is not None and kv.lease not in (0, lost)
    etcd.close()


def test_store_keys_expire_with_the_state_and_a_new_state_clears_them(etcd_server):
    backend, store = create_backend(
        params(etcd_server.endpoint, "exp", state_ttl="3", keep_alive_interval="1")
    )
    etcd = connect(etcd_server.endpoint)
    prefix = "/elastic_train/exp/dynamic/store/"
    backend.set_state(b"s")
    store.set("round0/key", "v")
    store.queue_push("round0/queue", "item")
    assert etcd.get(prefix + "round0/key").lease == etcd.get(STATE.format("exp")).lease != 0
    queued = etcd.get_prefix("/elastic_train/exp/dynamic/store@queues/")[0]
    assert [kv.lease for kv in queued] == [etcd.get(STATE.format("exp")).lease]
    deadline = time.monotonic() + 15
    while etcd.get_prefix("/elastic_train/exp/")[0] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert etcd.get_prefix("/elastic_train/exp/")[0] == [], "state and store keys outlived the TTL"

    etcd.put(prefix + "torch.rendezvous.exp.0/0", b"left over")  # e.g. written without a lease
    Etcd3Store(etcd, prefix).queue_push("q", "left over")
    backend.set_state(b"new generation")
    assert etcd.get_prefix(prefix)[0] == [], "creating the state clears the run's old store keys"
    assert store.queue_len("q") == 0, "creating the state clears the run's old queues"
    etcd.close()


# -- create_backend ----------------------------------------------------------------------------------------


def test_create_backend_defaults(etcd_server):
    backend, store = create_backend(params(etcd_server.endpoint, last_call_timeout="1"))
    assert backend.name == "etcd3-dynamic" and backend.ttl == 7200
    assert store.timeout == timedelta(seconds=60)  # torch's c10d read_timeout default
    store.set("x", b"1")
    assert store.get("x") == b"1"


def test_read_timeout_sets_the_store_timeout(etcd_server):
    _, store = create_backend(params(etcd_server.endpoint, read_timeout="1"))
    assert store.timeout == timedelta(seconds=1)
    start = time.monotonic()
    with pytest.raises(DistStoreError, match="timeout"):
        store.get("never")
    assert 0.9 < time.monotonic() - start < 5


@pytest.mark.parametrize(
    ("conf", "needle"),
    [
        ({"read_timeout": "soon"}, "rdzv-conf: read_timeout='soon' is not a number"),
        ({"read_timeout": "0"}, "read_timeout: 0 must be > 0"),
        ({"bogus": "1"}, "rdzv-conf: unknown key 'bogus'"),
        ({"state_ttl": "4", "keep_alive_interval": "5"}, "state_ttl: 4 s must exceed keep_alive_interval"),
        ({"last_call_timeout": "1.5"}, "last_call_timeout='1.5' is not a whole number"),
        ({"protocol": "https"}, "protocol=https needs ca_file"),
    ],
)
def test_bad_conf_is_one_config_error_before_connecting(conf, needle):
    with pytest.raises(ConfigError) as info:
        create_backend(params("127.0.0.1:1", **conf))  # nothing listens there: checked before connecting
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_c10d_store_keys_are_ignored_with_a_warning(etcd_server):
    with structlog.testing.capture_logs() as logs:
        create_backend(params(etcd_server.endpoint, store_type="file", is_host="true"))
    ignored = {e["key"] for e in logs if e["event"] == "rdzv_conf_ignored" and e["log_level"] == "warning"}
    assert ignored == {"store_type", "is_host"}


def test_unreachable_etcd_is_a_connection_error(etcd_server):
    port = etcd_server.endpoint.rsplit(":", 1)[1]
    etcd_server.stop()
    with pytest.raises(RendezvousConnectionError, match=f"127.0.0.1:{port}"):
        create_backend(params(etcd_server.endpoint, connect_timeout="2"))


def test_etcd_failure_mid_run_is_dist_network_error_and_connection_error(etcd_server):
    backend, store = create_backend(params(etcd_server.endpoint, read_timeout="2"))
    store.set("a", "1")
    etcd_server.stop()
    with pytest.raises(DistNetworkError, match="etcd"):
        store.set("b", "2")
    with pytest.raises(RendezvousConnectionError):
        backend.get_state()


@pytest.fixture
def tls_etcd(tmp_path: Path):
    """An etcd serving TLS with a certificate for 127.0.0.1 signed by a CA of the test's own."""
    ca_key, ca = make_ca(tmp_path, "test-ca")
    cert, key = make_server_cert(tmp_path, ca_key, ca)
    with EmbeddedEtcd(tls=(str(cert), str(key), str(ca))) as server:
        yield server, ca


@needs_openssl
def test_tls_under_torchs_etcd_v2_key_names(tls_etcd):
    server, ca = tls_etcd
    _, store = create_backend(params(server.endpoint, protocol="https", ca_cert=str(ca)))
    store.set("over", "tls")
    assert store.get("over") == b"tls"
    with pytest.raises(RendezvousConnectionError, match="TLS|handshake|certificate|reach"):
        create_backend(params(server.endpoint, connect_timeout="2"))  # plain text against a TLS server


# -- under torchrun ----------------------------------------------------------------------------------------


def _torchrun(
    endpoint: str, run_id: str, conf: str, *, nnodes: str = "2:2", backend: str = "etcd3-dynamic", **kw
) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", "--nproc-per-node=1",
        f"--rdzv-backend={backend}", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
        f"--rdzv-conf={conf}", "--local-addr=127.0.0.1", "--monitor-interval=0.2", "--max-restarts=0", WORKER,
    ]  # fmt: skip


@pytest.mark.parametrize("backend", ["etcd3-dynamic", "etcd3"])
@pytest.mark.parametrize(
    ("conf", "needle"),
    [
        ("read_timeout=abc", "rdzv-conf: read_timeout='abc' is not a number"),
        ("bogus=1", "rdzv-conf: unknown key 'bogus'"),
    ],
)
def test_bad_conf_under_torchrun_is_one_line(backend, conf, needle):
    proc = subprocess.run(
        _torchrun("127.0.0.1:1", "bad-conf", conf, nnodes="1", backend=backend),
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    assert lines[0].startswith("torchrun: error: ") and needle in lines[0]


@pytest.mark.long
@pytest.mark.slow
def test_finished_run_id_is_closed_until_its_state_expires(etcd_server, reaper, tmp_path):
    """torchrun --rdzv-backend=etcd3-dynamic: a job finishes; its run id is closed (as with torch's
    backends) until the state expires, then a new job under the same id trains (no leftover store key)."""
    run_id = "again-" + uuid.uuid4().hex[:6]
    conf = "last_call_timeout=1,keep_alive_interval=1,heartbeat_timeout=5,state_ttl=10"
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", RDZV_WORKER_STEPS="10", RDZV_WORKER_STEP_S="0.01")

    def job(tag: str) -> list[int]:
        agents = []
        for i in range(2):
            env_i = dict(env, RDZV_WORKER_OUT=str(tmp_path / f"{tag}.jsonl"))
            with open(tmp_path / f"{tag}{i}.log", "wb") as out:  # the agent keeps its own copy of the fd
                cmd = _torchrun(etcd_server.endpoint, run_id, conf)
                agents.append(reaper.popen(cmd, env=env_i, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT))
        return [a.wait(timeout=180) for a in agents]

    assert job("first") == [0, 0], (tmp_path / "first0.log").read_text()[-3000:]
    finished = time.monotonic()
    handler = create_etcd3_dynamic_handler(params(etcd_server.endpoint, run_id, keep_alive_interval="1"))
    with pytest.raises(RendezvousClosedError):
        handler.next_rendezvous()
    assert time.monotonic() - finished < 10, "checked too late: the state may have expired meanwhile"

    etcd = connect(etcd_server.endpoint)
    deadline = time.monotonic() + 30
    while etcd.get(STATE.format(run_id)) is not None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert etcd.get(STATE.format(run_id)) is None, "the finished run's state never expired"
    etcd.close()
    assert job("second") == [0, 0], (tmp_path / "second0.log").read_text()[-3000:]
    assert (tmp_path / "second.jsonl").read_text().count('"step": 9') == 1
