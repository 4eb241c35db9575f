"""An etcd v3 client factory that fails fast with one clear line, and a thin KV layer on its gRPC stubs.

:func:`connect` builds a ``python3-etcd3`` client tuned for a rendezvous: a short RPC timeout, quick gRPC
reconnects (an etcd restart is survived in about a second, not after gRPC's default 2-minute backoff), no
300 s "failed endpoint" quarantine, authentication and a probe call up front so that an unreachable endpoint,
a wrong password or a TLS problem surfaces at once as :class:`~elastic_train.etcd.errors.EtcdError`.

:class:`Etcd` wraps the raw v3 stubs (KV, Txn, Lease, Watch) with uniform error translation, re-authentication
when a token expires, and operation counters (benchmarks read them). The password is kept only in memory and
never appears in a message or a log event.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

# gRPC's C core logs a failed TLS handshake (and other transport trouble) to stderr itself; the failure
# reaches the user once, as an EtcdError line. Set before grpc is imported; an explicit setting wins.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

import etcd3
import grpc
from etcd3 import etcdrpc
from etcd3.client import Endpoint, MultiEndpointEtcd3Client

from elastic_train.errors import ConfigError
from elastic_train.etcd.errors import EtcdError
from elastic_train.log import get_logger
from elastic_train.rendezvous.config import RendezvousConfig, TLSConfig

log = get_logger(__name__)

T = TypeVar("T")

#: gRPC channel options: reconnect within ~1 s after an etcd restart, keep idle channels alive.
GRPC_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10000),
    ("grpc.keepalive_timeout_ms", 5000),
]


def parse_endpoints(endpoints: str) -> list[tuple[str, int]]:
    """Split ``"h1:2379,h2:2379"`` (an optional ``http(s)://`` scheme is dropped) into (host, port) pairs.

    Raises:
        EtcdError: an entry is not HOST:PORT.
    """
    out = []
    for raw in endpoints.split(","):
        ep = raw.strip()
        for scheme in ("http://", "https://"):
            if ep.startswith(scheme):
                ep = ep[len(scheme) :]
        host, sep, port = ep.rstrip("/").rpartition(":")
        if not sep or not host or not port.isdigit():
            raise EtcdError(f"etcd endpoint {raw.strip()!r} is not HOST:PORT")
        out.append((host.strip("[]"), int(port)))
    return out


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise EtcdError(f"TLS {what} {path!r} cannot be read ({exc.strerror or exc})") from exc


def describe_rpc_error(exc: BaseException, where: str, user: str | None = None) -> str:
    """One line that says what went wrong talking to etcd (never includes credentials)."""
    code = exc.code() if isinstance(exc, grpc.RpcError) and hasattr(exc, "code") else None
    details = ""
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "details"):
        details = (exc.details() or "").strip()
    low = details.lower()
    if code == grpc.StatusCode.UNAVAILABLE:
        if "ssl" in low or "handshake" in low or "certificate" in low or "tls" in low:
            return f"TLS handshake with etcd at {where} failed (check ca_file/cert_file/key_file): {details}"
        return f"cannot reach etcd at {where} (is it running? is the endpoint right?)"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"etcd at {where} did not answer in time"
    if code == grpc.StatusCode.UNAUTHENTICATED or "authentication failed" in low:
        return f"etcd authentication failed at {where} for user {user!r} (wrong user name or password?)"
    if code == grpc.StatusCode.PERMISSION_DENIED or "permission denied" in low:
        return f"etcd user {user!r} is not permitted this operation at {where} ({details})"
    if code == grpc.StatusCode.INVALID_ARGUMENT and "user name is empty" in low:
        return f"etcd at {where} requires authentication: set rdzv-conf user and a password"
    if code is not None:
        return f"etcd request to {where} failed: {code.name}: {details}"
    return f"etcd request to {where} failed: {type(exc).__name__}: {exc}"


def connect(
    endpoints: str,
    *,
    tls: TLSConfig | None = None,
    user: str | None = None,
    password: str | None = None,
    timeout: float = 5.0,
    probe_key: str | None = None,
) -> MultiEndpointEtcd3Client:
    """Return an authenticated, reachable etcd v3 client, or fail within about ``timeout`` seconds.

    Args:
        endpoints: ``HOST:PORT[,HOST:PORT...]``.
        tls: CA bundle and optional client certificate; plain text when ``None`` or empty.
        user: etcd user for password authentication.
        password: that user's password (from an env var or file; never from a command line).
        timeout: seconds for each RPC, the probe included.
        probe_key: a key to read as the reachability/permission probe (default: the cluster status, which
            needs no key permission).

    Raises:
        EtcdError: bad endpoint, unreadable TLS file, unreachable etcd, TLS handshake failure, authentication
            or permission failure; one line, no credentials.
    """
    pairs = parse_endpoints(endpoints)
    creds = None
    if tls is not None and tls.enabled:
        if tls.ca_file is None:
            raise EtcdError("TLS client certificate given without ca_file")
        ca = _read(tls.ca_file, "ca_file")
        key = _read(tls.key_file, "key_file") if tls.key_file else None
        cert = _read(tls.cert_file, "cert_file") if tls.cert_file else None
        creds = grpc.ssl_channel_credentials(ca, key, cert)
    if (user is None) != (password is None):
        raise EtcdError("etcd authentication needs both a user and a password")
    where = endpoints
    eps = [
        Endpoint(host, port, secure=creds is not None, creds=creds, time_retry=0.5, opts=GRPC_OPTIONS)
        for host, port in pairs
    ]
    try:
        client = MultiEndpointEtcd3Client(
            endpoints=eps, timeout=timeout, user=user, password=password, failover=len(eps) > 1
        )
        if creds is None:
            # gRPC refuses call credentials on a plain-text channel; the token travels in the metadata.
            client.call_credentials = None
        if probe_key is not None:
            client.kvstub.Range(
                etcdrpc.RangeRequest(key=probe_key.encode()),
                timeout,
                credentials=client.call_credentials,
                metadata=client.metadata,
            )
        else:
            client.maintenancestub.Status(
                etcdrpc.StatusRequest(),
                timeout,
                credentials=client.call_credentials,
                metadata=client.metadata,
            )
    except (grpc.RpcError, etcd3.exceptions.Etcd3Exception, ValueError) as exc:
        for ep in eps:
            ep.close()
        raise EtcdError(describe_rpc_error(exc, where, user)) from None
    client._et_user = user
    client._et_password = password
    client._et_where = where
    return client


def reauthenticate(client: MultiEndpointEtcd3Client) -> None:
    """Fetch a fresh auth token (tokens expire, and an etcd restart invalidates simple tokens)."""
    user = getattr(client, "_et_user", None)
    password = getattr(client, "_et_password", None)
    if user is None or password is None:
        return
    resp = client.authstub.Authenticate(
        etcdrpc.AuthenticateRequest(name=user, password=password), client.timeout
    )
    client.metadata = (("token", resp.token),)
    if client.call_credentials is not None:
        client.call_credentials = grpc.metadata_call_credentials(
            etcd3.client.EtcdTokenCallCredentials(resp.token)
        )


def read_password(cfg: RendezvousConfig) -> str | None:
    """The etcd password: env var ``cfg.password_env``, else ``cfg.password_file``; None without a user.

    Raises:
        ConfigError: a user is set but no password is found, or the file cannot be read.
    """
    if cfg.user is None:
        return None
    value = os.environ.get(cfg.password_env)
    if value:
        return value
    if cfg.password_file:
        try:
            with open(cfg.password_file, encoding="utf-8") as f:
                return f.read().rstrip("\r\n")
        except OSError as exc:
            raise ConfigError(f"password_file {cfg.password_file!r} cannot be read ({exc.strerror})") from exc
    raise ConfigError(
        f"etcd user {cfg.user!r} is set but no password: set ${cfg.password_env} or rdzv-conf password_file"
    )


def connect_config(cfg: RendezvousConfig, timeout: float = 5.0) -> MultiEndpointEtcd3Client:
    """:func:`connect` with a job's rendezvous settings (endpoint, TLS, user, password from env/file).

    The probe reads the run's own ``config`` key, so a user limited to the run prefix passes it.

    Raises:
        EtcdError: unreachable, TLS or authentication failure (one line).
        ConfigError: a user without a password.
    """
    return connect(
        cfg.endpoint,
        tls=cfg.tls,
        user=cfg.user,
        password=read_password(cfg),
        timeout=timeout,
        probe_key=f"/elastic_train/{cfg.run_id}/config",
    )


@dataclass(slots=True)
class KeyValue:
    """One key as read from etcd."""

    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int


@dataclass(slots=True)
class WatchEvent:
    """A put (``value`` set) or delete (``value`` None) seen by a watch."""

    key: str
    value: bytes | None
    mod_revision: int
    create_revision: int
    lease: int


@dataclass(slots=True)
class OpCounts:
    """RPCs issued through one :class:`Etcd` (benchmarks report them per rendezvous round)."""

    reads: int = 0
    writes: int = 0
    txns: int = 0
    leases: int = 0
    watch_events: int = 0


def _kv(kv: Any) -> KeyValue:
    return KeyValue(kv.key.decode(), kv.value, kv.mod_revision, kv.create_revision, kv.lease)


def range_end(prefix: str) -> bytes:
    """The exclusive end of the key range that holds every key starting with ``prefix``."""
    b = bytearray(prefix.encode())
    b[-1] += 1
    return bytes(b)


class Etcd:
    """KV, Txn, Lease and Watch on an etcd v3 client, with one error type (:class:`EtcdError`).

    Thread-safe (gRPC channels are). Calls that fail with an expired token re-authenticate and retry once.
    """

    def __init__(self, client: MultiEndpointEtcd3Client) -> None:
        self.client = client
        self.counts = OpCounts()
        self._lock = threading.Lock()
        self.where = getattr(client, "_et_where", "etcd")

    def _call(self, fn: Callable[[], T]) -> T:
        for attempt in (0, 1):
            try:
                return fn()
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                text = (exc.details() or "") if hasattr(exc, "details") else ""
                if attempt == 0 and (code == grpc.StatusCode.UNAUTHENTICATED or "invalid auth token" in text):
                    with contextlib.suppress(grpc.RpcError):
                        reauthenticate(self.client)
                    continue
                raise EtcdError(
                    describe_rpc_error(exc, self.where, getattr(self.client, "_et_user", None))
                ) from exc
            except ValueError as exc:  # python3-etcd3: "Trying to use a failed node"
                raise EtcdError(f"cannot reach etcd at {self.where}: {exc}") from exc
        raise AssertionError("unreachable")

    def _md(self) -> dict[str, Any]:
        return {"credentials": self.client.call_credentials, "metadata": self.client.metadata}

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """All keys under ``prefix`` and the store revision they were read at."""
        self.counts.reads += 1
        req = etcdrpc.RangeRequest(key=prefix.encode(), range_end=range_end(prefix))
        resp = self._call(lambda: self.client.kvstub.Range(req, self.client.timeout, **self._md()))
        return [_kv(kv) for kv in resp.kvs], resp.header.revision

    def get(self, key: str) -> KeyValue | None:
        self.counts.reads += 1
        req = etcdrpc.RangeRequest(key=key.encode())
        resp = self._call(lambda: self.client.kvstub.Range(req, self.client.timeout, **self._md()))
        return _kv(resp.kvs[0]) if resp.kvs else None

    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """Write ``key``; returns the new store revision."""
        self.counts.writes += 1
        req = etcdrpc.PutRequest(key=key.encode(), value=value, lease=lease)
        resp = self._call(lambda: self.client.kvstub.Put(req, self.client.timeout, **self._md()))
        return int(resp.header.revision)

    def delete(self, key: str, prefix: bool = False) -> None:
        self.counts.writes += 1
        req = etcdrpc.DeleteRangeRequest(key=key.encode(), range_end=range_end(key) if prefix else b"")
        self._call(lambda: self.client.kvstub.DeleteRange(req, self.client.timeout, **self._md()))

    def txn(
        self,
        compare: list[Any],
        success: list[Any],
        failure: list[Any] | None = None,
    ) -> tuple[bool, Any]:
        """Run a transaction of raw ``etcdrpc`` Compare/RequestOp messages; returns (succeeded, response).

        Helpers :func:`cmp_mod`, :func:`op_put`, :func:`op_get`, :func:`op_delete` build the messages.
        """
        self.counts.txns += 1
        req = etcdrpc.TxnRequest(compare=compare, success=success, failure=failure or [])
        resp = self._call(lambda: self.client.kvstub.Txn(req, self.client.timeout, **self._md()))
        if resp.succeeded:
            self.counts.writes += sum(1 for op in success if op.WhichOneof("request") != "request_range")
        return bool(resp.succeeded), resp

    def lease_grant(self, ttl: int) -> int:
        self.counts.leases += 1
        req = etcdrpc.LeaseGrantRequest(TTL=ttl)
        resp = self._call(lambda: self.client.leasestub.LeaseGrant(req, self.client.timeout, **self._md()))
        return int(resp.ID)

    def lease_keepalive(self, lease_id: int) -> int:
        """Refresh a lease once; returns its remaining TTL (<= 0: the lease no longer exists)."""
        self.counts.leases += 1

        def once() -> int:
            it = self.client.leasestub.LeaseKeepAlive(
                iter([etcdrpc.LeaseKeepAliveRequest(ID=lease_id)]), self.client.timeout, **self._md()
            )
            for resp in it:
                return int(resp.TTL)
            return 0

        return self._call(once)

    def lease_revoke(self, lease_id: int) -> None:
        self.counts.leases += 1
        req = etcdrpc.LeaseRevokeRequest(ID=lease_id)
        self._call(lambda: self.client.leasestub.LeaseRevoke(req, self.client.timeout, **self._md()))

    def watch_prefix(
        self, prefix: str, start_revision: int, stop: threading.Event
    ) -> Iterator[list[WatchEvent]]:
        """Yield batches of events under ``prefix`` from ``start_revision`` until ``stop`` is set.

        Raises:
            EtcdError: the stream broke (etcd restarted, compacted, unreachable); the caller re-lists and
                watches again.
        """
        create = etcdrpc.WatchCreateRequest(
            key=prefix.encode(), range_end=range_end(prefix), start_revision=start_revision
        )
        requests: Any = _RequestQueue(etcdrpc.WatchRequest(create_request=create), stop)
        stub = etcdrpc.WatchStub(self.client.channel)
        self.counts.reads += 1
        try:
            stream = stub.Watch(requests, **self._md())
            requests.stream = stream
            for resp in stream:
                if stop.is_set():
                    return
                if resp.compact_revision:
                    raise EtcdError(f"watch of {prefix} compacted at revision {resp.compact_revision}")
                if resp.canceled:
                    raise EtcdError(f"watch of {prefix} canceled by etcd: {resp.cancel_reason}")
                if not resp.events:
                    continue
                self.counts.watch_events += len(resp.events)
                batch = []
                for ev in resp.events:
                    deleted = ev.type == 1  # DELETE
                    batch.append(
                        WatchEvent(
                            ev.kv.key.decode(),
                            None if deleted else ev.kv.value,
                            ev.kv.mod_revision,
                            ev.kv.create_revision,
                            ev.kv.lease,
                        )
                    )
                yield batch
        except grpc.RpcError as exc:
            if stop.is_set():
                return
            code = exc.code() if hasattr(exc, "code") else None
            if code == grpc.StatusCode.UNAUTHENTICATED or "auth" in str(
                getattr(exc, "details", lambda: "")()
            ):
                with contextlib.suppress(grpc.RpcError):
                    reauthenticate(self.client)
            raise EtcdError(
                describe_rpc_error(exc, self.where, getattr(self.client, "_et_user", None))
            ) from exc
        finally:
            requests.close()

    def close(self) -> None:
        self.client.close()


class _RequestQueue:
    """Request iterator of a watch stream: sends the create request, then blocks until stopped."""

    def __init__(self, first: Any, stop: threading.Event) -> None:
        self._first: Any = first
        self._stop = stop
        self._closed = threading.Event()
        self.stream: Any = None

    def __iter__(self) -> _RequestQueue:
        return self

    def __next__(self) -> Any:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        while not (self._stop.is_set() or self._closed.is_set()):
            self._stop.wait(0.2)
        if self.stream is not None and not self._closed.is_set():
            self.stream.cancel()
        raise StopIteration

    def close(self) -> None:
        self._closed.set()
        if self.stream is not None:
            with contextlib.suppress(Exception):  # cancelling a finished stream
                self.stream.cancel()


def cmp_mod(key: str, revision: int) -> Any:
    """Compare: ``key``'s mod revision equals ``revision`` (0: the key does not exist)."""
    return etcdrpc.Compare(
        result=etcdrpc.Compare.EQUAL, target=etcdrpc.Compare.MOD, key=key.encode(), mod_revision=revision
    )


def cmp_version(key: str, version: int) -> Any:
    """Compare: ``key``'s version equals ``version`` (0: the key does not exist)."""
    return etcdrpc.Compare(
        result=etcdrpc.Compare.EQUAL, target=etcdrpc.Compare.VERSION, key=key.encode(), version=version
    )


def op_put(key: str, value: bytes, lease: int = 0) -> Any:
    return etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=key.encode(), value=value, lease=lease))


def op_get(key: str) -> Any:
    return etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=key.encode()))


def op_delete(key: str) -> Any:
    return etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=key.encode()))
