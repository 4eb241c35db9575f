"""The project's etcd v3 client: one connection type with clear errors, on the raw gRPC stubs.

:func:`connect` is the one way to get a client. It builds a ``python3-etcd3`` channel tuned for a
rendezvous: a per-RPC deadline, a connection deadline of several seconds (slow links), quick gRPC reconnects
(an etcd restart is survived in about a second, not after gRPC's default 2-minute backoff), no 300 s "failed
endpoint" quarantine, and authentication and a probe call up front. An etcd that is not reachable yet is
waited for up to ``connect_timeout``; a wrong password or a TLS problem surfaces at once as
:class:`~elastic_train.etcd.errors.EtcdError`.

:class:`Etcd`, what it returns, holds the endpoint list and the credentials and wraps the v3 stubs (KV, Txn,
Lease, Watch) with uniform error translation, failover between the members of an endpoint list,
re-authentication when a token expires, and operation counters (benchmarks read them). The password is
kept only in memory and never appears in a message, a ``repr`` or a log event.
"""

from __future__ import annotations

import contextlib
import random
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import etcd3
import grpc
from etcd3 import etcdrpc
from etcd3.client import Endpoint, MultiEndpointEtcd3Client

from elastic_train.etcd.causes import (
    TRANSIENT,
    Cause,
    classify,
    describe,
    details_of,
    is_transient,
    not_sent,
    wait_reason,
)
from elastic_train.etcd.config import EtcdConfig, TLSConfig
from elastic_train.etcd.endpoints import format_endpoint, format_endpoints, parse_endpoints
from elastic_train.etcd.errors import EtcdError
from elastic_train.etcd.keys import range_end
from elastic_train.log import get_logger

log = get_logger(__name__)

T = TypeVar("T")

#: Deadline of one gRPC connection attempt (TCP, TLS and HTTP/2 handshakes); tolerates round trips of
#: well over 500 ms. The RPC deadline raises it when it is longer.
CONNECT_ATTEMPT_TIMEOUT = 5.0
#: First and longest pause between two gRPC connection attempts to a member that is down.
RECONNECT_BACKOFF = (0.1, 1.0)
#: Longest pause between two attempts of :func:`connect` to reach etcd while it waits for it.
CONNECT_RETRY_MAX = 5.0
#: Seconds between two "waiting for etcd" log lines.
WAIT_LOG_EVERY = 10.0


def grpc_options(connect_attempt_timeout: float = CONNECT_ATTEMPT_TIMEOUT) -> list[tuple[str, int]]:
    """gRPC channel options: reconnect within about a second after an etcd restart, keep channels alive.

    gRPC core reads ``grpc.min_reconnect_backoff_ms`` as the *minimum connection timeout* (the reconnect
    pauses come from the initial/max backoff and a 1.6 multiplier), so it carries the connect-attempt
    deadline: a small value there makes every etcd more than that round trip away unreachable.
    """
    return [
        ("grpc.initial_reconnect_backoff_ms", int(RECONNECT_BACKOFF[0] * 1000)),
        ("grpc.max_reconnect_backoff_ms", int(RECONNECT_BACKOFF[1] * 1000)),
        ("grpc.min_reconnect_backoff_ms", int(connect_attempt_timeout * 1000)),
        ("grpc.keepalive_time_ms", 10000),
        ("grpc.keepalive_timeout_ms", 5000),
    ]


#: The channel options with the default connection deadline.
GRPC_OPTIONS = grpc_options()


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise EtcdError(f"TLS {what} {path!r} cannot be read ({exc.strerror or exc})") from exc


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

    requests: int = 0
    """Requests etcd served other than keep-alives: reads, writes, transactions, lease grants and revokes,
    watch set-ups."""
    keepalives: int = 0
    """Lease keep-alive requests (one per lease refreshed, batched or not)."""
    reads: int = 0
    writes: int = 0
    txns: int = 0
    leases: int = 0
    """Lease grants, revokes and keep-alive requests."""
    watch_events: int = 0
    watch_bytes: int = 0
    """Bytes of the watch responses that carried events (protobuf size, without gRPC's framing)."""
    failovers: int = 0


def _kv(kv: Any) -> KeyValue:
    return KeyValue(kv.key.decode(), kv.value, kv.mod_revision, kv.create_revision, kv.lease)


class Etcd:
    """A connection to etcd: the endpoint list, the credentials, and KV, Txn, Lease and Watch on the v3 stubs
    with one error type (:class:`EtcdError`).

    Get one from :func:`connect` (or :func:`connect_config`), which also authenticates and probes it.
    Thread-safe (gRPC channels are). Calls that fail with an expired token re-authenticate and retry once;
    a member that fails is left for the next one in the list.

    Attributes:
        raw: the ``python3-etcd3`` client under this one, for RPCs not wrapped here (its stubs, e.g.
            ``raw.authstub``, through :meth:`unary` keep this class's error handling).
        where: the endpoint list as ``HOST:PORT,...``, for messages.
        user: the etcd user, or ``None`` without authentication.
        counts: RPCs issued so far.
    """

    __slots__ = ("_last_answer", "_lock", "_password", "counts", "raw", "user", "where")

    def __init__(
        self, raw: MultiEndpointEtcd3Client, *, where: str, user: str | None, password: str | None
    ) -> None:
        self.raw = raw
        self.where = where
        self.user = user
        self._password = password
        self.counts = OpCounts()
        self._lock = threading.Lock()
        self._last_answer = time.monotonic()

    def __repr__(self) -> str:
        return f"Etcd(where={self.where!r}, user={self.user!r}, member={self.member!r})"

    @property
    def timeout(self) -> float:
        """Deadline of each RPC, in seconds."""
        return float(self.raw.timeout)

    @property
    def member(self) -> str:
        """HOST:PORT of the member requests go to now."""
        return str(self.raw._current_endpoint_label)

    @property
    def members(self) -> list[str]:
        """HOST:PORT of every member of the endpoint list, in its order."""
        return list(self.raw.endpoints)

    def use_member(self, member: str) -> None:
        """Send later requests to ``member`` (one of :attr:`members`), logged in there.

        Raises:
            ValueError: ``member`` is not in the endpoint list.
        """
        if member not in self.raw.endpoints:
            raise ValueError(f"{member} is not one of the etcd endpoints {self.where}")
        self.raw._current_endpoint_label = member
        if self.user is not None:
            with contextlib.suppress(grpc.RpcError):  # simple auth tokens are per member
                self.reauthenticate()

    def reauthenticate(self) -> None:
        """Fetch a fresh auth token (tokens expire, and an etcd restart invalidates simple tokens).

        Raises:
            grpc.RpcError: etcd refused or did not answer (callers decide whether that matters).
        """
        if self.user is None or self._password is None:
            return
        resp = self.raw.authstub.Authenticate(
            etcdrpc.AuthenticateRequest(name=self.user, password=self._password), self.raw.timeout
        )
        self.raw.metadata = (("token", resp.token),)
        if getattr(self.raw.endpoint_in_use, "secure", False):
            self.raw.call_credentials = grpc.metadata_call_credentials(
                etcd3.client.EtcdTokenCallCredentials(resp.token)
            )

    def _probe(self, probe_key: str | None) -> None:
        """Authenticate on the current member (tokens may be per member) and issue the probe request."""
        self.reauthenticate()
        if probe_key is not None:
            request = etcdrpc.RangeRequest(key=probe_key.encode())
            self.raw.kvstub.Range(request, self.raw.timeout, **self._md())
        else:
            self.raw.maintenancestub.Status(etcdrpc.StatusRequest(), self.raw.timeout, **self._md())

    def _call(self, fn: Callable[[], T], *, idempotent: bool = True) -> T:
        """Run one RPC; re-authenticate once on an expired token; fail over to another member.

        A member that is unreachable or cannot serve (no leader, shutting down) is left for the next one in
        the endpoint list, and the request is resent there when that cannot apply it twice: always for
        reads and keep-alives (``idempotent``), for writes only when the first member never received it.
        """
        reauth = True
        tries = len(self.raw.endpoints)
        while True:
            label = self.member
            try:
                result = fn()
                self._last_answer = time.monotonic()
                return result
            except grpc.RpcError as exc:
                if reauth and classify(exc) is Cause.AUTH:
                    reauth = False
                    with contextlib.suppress(grpc.RpcError):
                        self.reauthenticate()
                    continue
                if is_transient(exc) and self.failover(label):
                    tries -= 1
                    if tries > 0 and (idempotent or not_sent(exc)):
                        reauth = True
                        continue
                raise EtcdError(self.describe(exc)) from exc
            except ValueError as exc:  # python3-etcd3: "Trying to use a failed node"
                raise EtcdError(f"cannot reach etcd at {self.where}: {exc}") from exc

    def failover(self, failed: str) -> bool:
        """Move later requests from member ``failed`` to the next one in the list; False with one member."""
        labels = self.members
        if len(labels) < 2:
            return False
        with self._lock:
            if self.member == failed:
                nxt = labels[(labels.index(failed) + 1) % len(labels)]
                self.raw._current_endpoint_label = nxt
                self.counts.failovers += 1
                log.info("etcd_failover", failed=failed, now=nxt)
        if self.user is not None:
            with contextlib.suppress(grpc.RpcError):  # simple auth tokens are per member
                self.reauthenticate()
        return True

    @property
    def silent_for(self) -> float:
        """Seconds since etcd last answered this client (any call, or a watch message)."""
        return time.monotonic() - self._last_answer

    def describe(self, exc: BaseException) -> str:
        """The one line for a failed call: its cause, and a likely partition when etcd has been silent."""
        return describe(exc, self.where, self.user, silent_for=self.silent_for)

    def _md(self) -> dict[str, Any]:
        return {"credentials": self.raw.call_credentials, "metadata": self.raw.metadata}

    def unary(self, method: Callable[..., T], request: Any, *, idempotent: bool = True) -> T:
        """Call one unary RPC of a stub this class does not wrap (``raw.authstub``, ``raw.maintenancestub``)
        with its deadline, credentials, re-authentication, failover and error translation.

        Args:
            method: a stub method, e.g. ``etcd.raw.authstub.UserAdd``.
            request: its request message.
            idempotent: whether resending it to another member after a failure is safe.

        Raises:
            EtcdError: the call failed; ``__cause__`` holds gRPC's error (:func:`rpc_details` reads it).
        """
        return self._call(lambda: method(request, self.raw.timeout, **self._md()), idempotent=idempotent)

    def server_version(self) -> str:
        """The etcd release of the member requests go to (``"3.5.1"``).

        Raises:
            EtcdError: the member did not answer.
        """
        status = self.unary(self.raw.maintenancestub.Status, etcdrpc.StatusRequest())
        return str(status.version)

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """All keys under ``prefix`` and the store revision they were read at."""
        self.counts.reads += 1
        self.counts.requests += 1
        req = etcdrpc.RangeRequest(key=prefix.encode(), range_end=range_end(prefix))
        resp = self._call(lambda: self.raw.kvstub.Range(req, self.raw.timeout, **self._md()))
        return [_kv(kv) for kv in resp.kvs], resp.header.revision

    def get(self, key: str, timeout: float | None = None) -> KeyValue | None:
        """The value of ``key`` (None when absent); ``timeout`` (default: the RPC timeout) is the request's
        deadline, for a caller that must answer sooner than an unanswered request would."""
        self.counts.reads += 1
        self.counts.requests += 1
        req = etcdrpc.RangeRequest(key=key.encode())
        deadline = timeout if timeout is not None else self.raw.timeout
        resp = self._call(lambda: self.raw.kvstub.Range(req, deadline, **self._md()))
        return _kv(resp.kvs[0]) if resp.kvs else None

    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """Write ``key``; returns the new store revision."""
        self.counts.writes += 1
        self.counts.requests += 1
        req = etcdrpc.PutRequest(key=key.encode(), value=value, lease=lease)
        resp = self._call(lambda: self.raw.kvstub.Put(req, self.raw.timeout, **self._md()), idempotent=False)
        return int(resp.header.revision)

    def delete(self, key: str, prefix: bool = False) -> None:
        self.counts.writes += 1
        self.counts.requests += 1
        req = etcdrpc.DeleteRangeRequest(key=key.encode(), range_end=range_end(key) if prefix else b"")
        self._call(lambda: self.raw.kvstub.DeleteRange(req, self.raw.timeout, **self._md()), idempotent=False)

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
        self.counts.requests += 1
        req = etcdrpc.TxnRequest(compare=compare, success=success, failure=failure or [])
        read_only = all(op.WhichOneof("request") == "request_range" for op in success + (failure or []))
        resp = self._call(
            lambda: self.raw.kvstub.Txn(req, self.raw.timeout, **self._md()), idempotent=read_only
        )
        if resp.succeeded:
            self.counts.writes += sum(1 for op in success if op.WhichOneof("request") != "request_range")
        return bool(resp.succeeded), resp

    def lease_grant(self, ttl: int) -> int:
        """A new lease (a lease granted twice by a resend is never used and expires after ``ttl``)."""
        self.counts.leases += 1
        self.counts.requests += 1
        req = etcdrpc.LeaseGrantRequest(TTL=ttl)
        resp = self._call(lambda: self.raw.leasestub.LeaseGrant(req, self.raw.timeout, **self._md()))
        return int(resp.ID)

    def lease_keepalive(self, lease_id: int, timeout: float | None = None) -> int:
        """Refresh a lease once; returns its remaining TTL (<= 0: the lease no longer exists).

        ``timeout`` (default: the RPC timeout) bounds the whole exchange, failover included; a keep-alive
        must not outlast the lease it refreshes.

        Raises:
            EtcdError: etcd failed, or closed the stream without an answer (the lease's fate is unknown).
        """
        self.counts.leases += 1
        self.counts.keepalives += 1
        deadline = time.monotonic() + (timeout if timeout is not None else self.raw.timeout)

        def once() -> int:
            left = max(0.05, deadline - time.monotonic())
            it = self.raw.leasestub.LeaseKeepAlive(
                iter([etcdrpc.LeaseKeepAliveRequest(ID=lease_id)]), left, **self._md()
            )
            for resp in it:
                return int(resp.TTL)
            # etcd answers a lease it does not know with TTL 0; a stream closed without an answer says
            # nothing about the lease (a connection torn down while it healed) and must not count as lost
            raise EtcdError(f"etcd closed the keep-alive of lease {lease_id:x} without an answer")

        return self._call(once)

    def lease_keepalive_many(self, lease_ids: Sequence[int], timeout: float | None = None) -> dict[int, int]:
        """Refresh several leases over one keep-alive stream: what a process holding many leases (the scale
        benchmark's hosts of simulated nodes) sends instead of one stream per lease.

        etcd answers the requests of one stream one after the other (a renewal waits for etcd to apply what
        it committed), so a caller with many leases splits them over a few concurrent streams. ``timeout``
        (default: the RPC timeout) bounds the whole exchange, failover included.

        Returns:
            Each lease answered before the deadline, with its remaining TTL (<= 0: the lease no longer
            exists); a lease left out was not answered (its fate is unknown).

        Raises:
            EtcdError: etcd failed, or closed the stream, before answering any lease.
        """
        ids = list(dict.fromkeys(lease_ids))
        if not ids:
            return {}
        self.counts.leases += len(ids)
        self.counts.keepalives += len(ids)
        deadline = time.monotonic() + (timeout if timeout is not None else self.raw.timeout)
        out: dict[int, int] = {}

        def once() -> dict[int, int]:
            left = max(0.05, deadline - time.monotonic())
            requests = (etcdrpc.LeaseKeepAliveRequest(ID=i) for i in ids if i not in out)
            it = self.raw.leasestub.LeaseKeepAlive(requests, left, **self._md())
            try:
                for resp in it:
                    out[int(resp.ID)] = int(resp.TTL)
                    if len(out) == len(ids):
                        it.cancel()
                        return out
            except grpc.RpcError:
                if out:  # the deadline (or the member) cut it short: what was answered stands
                    return out
                raise
            if out:
                return out
            raise EtcdError(f"etcd closed a keep-alive stream of {len(ids)} leases without an answer")

        return self._call(once)

    def lease_revoke(self, lease_id: int) -> None:
        self.counts.leases += 1
        self.counts.requests += 1
        req = etcdrpc.LeaseRevokeRequest(ID=lease_id)
        self._call(lambda: self.raw.leasestub.LeaseRevoke(req, self.raw.timeout, **self._md()))

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
        stub = etcdrpc.WatchStub(self.raw.channel)
        self.counts.reads += 1
        self.counts.requests += 1
        md = self._md()
        # etcd ends the stream of a member that loses its leader (a partition, lost quorum) instead of
        # leaving it silent; the caller then re-lists through another member.
        md["metadata"] = (*(md["metadata"] or ()), ("hasleader", "true"))
        label = self.member
        try:
            stream = stub.Watch(requests, **md)
            requests.stream = stream
            for resp in stream:
                self._last_answer = time.monotonic()
                if stop.is_set():
                    return
                if resp.compact_revision:
                    raise EtcdError(f"watch of {prefix} compacted at revision {resp.compact_revision}")
                if resp.canceled:
                    raise EtcdError(f"watch of {prefix} canceled by etcd: {resp.cancel_reason}")
                if not resp.events:
                    continue
                self.counts.watch_events += len(resp.events)
                self.counts.watch_bytes += resp.ByteSize()
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
                    self.reauthenticate()
            elif is_transient(exc):
                self.failover(label)
            raise EtcdError(self.describe(exc)) from exc
        finally:
            requests.close()

    def close(self) -> None:
        self.raw.close()

    def __enter__(self) -> Etcd:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


def rpc_details(exc: BaseException) -> str:
    """gRPC's details text of a failed call (of an :class:`EtcdError` from :meth:`Etcd.unary`: its cause)."""
    cause = exc.__cause__ if isinstance(exc, EtcdError) else exc
    return details_of(cause) if cause is not None else ""


def connect(
    endpoints: str,
    *,
    tls: TLSConfig | None = None,
    user: str | None = None,
    password: str | None = None,
    timeout: float = 5.0,
    probe_key: str | None = None,
    connect_timeout: float = 0.0,
) -> Etcd:
    """Return an authenticated, reachable etcd client.

    Every member of the list is tried in turn (from a random one, to spread clients); the first that
    authenticates and answers the probe is used, and later requests fail over to the others. While none is
    reachable, the whole list is tried again with a growing pause until ``connect_timeout`` seconds have
    passed, with a ``waiting for etcd at ...`` warning every :data:`WAIT_LOG_EVERY` seconds. Errors waiting
    cannot fix (credentials, permissions, TLS) end it at once.

    Args:
        endpoints: ``HOST[:PORT][,HOST[:PORT]...]`` (port 2379 when absent).
        tls: CA bundle and optional client certificate; plain text when ``None`` or empty.
        user: etcd user for password authentication.
        password: that user's password (from an env var or file; never from a command line).
        timeout: deadline of each RPC, the probe included (also raises the connection-attempt deadline).
        probe_key: a key to read as the reachability/permission probe (default: the cluster status, which
            needs no key permission).
        connect_timeout: seconds to keep trying an unreachable etcd (0: one pass over the list).

    Raises:
        EtcdError: bad endpoint, unreadable TLS file, etcd unreachable for ``connect_timeout``, TLS
            handshake failure, authentication or permission failure; one line, no credentials.
    """
    try:
        pairs = parse_endpoints(endpoints)
    except ValueError as exc:
        raise EtcdError(str(exc)) from None
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
    where = format_endpoints(pairs)
    opts = grpc_options(max(CONNECT_ATTEMPT_TIMEOUT, timeout))
    eps = [
        Endpoint(
            f"[{host}]" if ":" in host else host,
            port,
            secure=creds is not None,
            creds=creds,
            time_retry=0.5,
            opts=opts,
        )
        for host, port in pairs
    ]
    raw = MultiEndpointEtcd3Client(endpoints=eps, timeout=timeout, failover=len(eps) > 1)
    if creds is None:
        # gRPC refuses call credentials on a plain-text channel; the token travels in the metadata.
        raw.call_credentials = None
    etcd = Etcd(raw, where=where, user=user, password=password)
    labels = etcd.members
    first = labels.index(etcd.member)
    order = labels[first:] + labels[:first]
    started = time.monotonic()
    pause = 0.5
    last_log = -WAIT_LOG_EVERY
    asked: set[str] = set()
    while True:
        last_exc: BaseException | None = None
        for label in order:
            raw._current_endpoint_label = label
            try:
                etcd._probe(probe_key)
                return etcd
            except grpc.RpcError as exc:
                if not is_transient(exc):
                    etcd.close()
                    raise EtcdError(describe(exc, label if len(order) > 1 else where, user)) from None
                if classify(exc) is Cause.CLOSED and label not in asked:
                    asked.add(label)
                    host, port = pairs[labels.index(label)]
                    mismatch = other_protocol(host, port, secure=creds is not None, timeout=min(2.0, timeout))
                    if mismatch is not None:
                        etcd.close()
                        raise EtcdError(mismatch) from None
                last_exc = exc
        assert last_exc is not None
        waited = time.monotonic() - started
        if waited >= connect_timeout:
            etcd.close()
            gave_up = f" (gave up after {waited:.0f} s; rdzv-conf connect_timeout)" if connect_timeout else ""
            raise EtcdError(describe(last_exc, where, user, silent_for=waited) + gave_up) from None
        if time.monotonic() - last_log >= WAIT_LOG_EVERY:
            last_log = time.monotonic()
            reason = wait_reason(last_exc)
            log.warning(
                "etcd_waiting",
                message=f"waiting for etcd at {where}: {reason} ({waited:.0f} s of {connect_timeout:.0f} s)",
                endpoint=where,
                reason=reason,
                waited_s=round(waited, 1),
                connect_timeout_s=connect_timeout,
            )
        # the last pause ends at the deadline, for one more pass over the list there
        time.sleep(min(pause * random.uniform(0.8, 1.2), connect_timeout - waited))
        pause = min(pause * 2, CONNECT_RETRY_MAX)


def other_protocol(host: str, port: int, *, secure: bool, timeout: float) -> str | None:
    """Whether a member that closed the connection during the handshake speaks the other protocol.

    A TLS client against a plain-text etcd (or the reverse) sees the connection closed, as it would on a
    network that resets connections; only asking the member in the other protocol tells the two apart.

    Returns:
        The one line naming the mismatch, or ``None`` when the member does not answer that way either.
    """
    target = format_endpoint(host, port)
    if secure:
        channel = grpc.insecure_channel(target)
        try:
            etcdrpc.MaintenanceStub(channel).Status(etcdrpc.StatusRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            if classify(exc) in TRANSIENT:
                return None  # no plain-text answer either (a refusal of ours is an answer)
        finally:
            channel.close()
        return (
            f"etcd at {target} serves plain text, but TLS is configured (ca_file/cert_file/key_file): "
            "drop the TLS settings or enable TLS on etcd"
        )
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with (
            socket.create_connection((host, port), timeout=timeout) as sock,
            context.wrap_socket(sock, server_hostname=host),
        ):
            pass
    except ssl.SSLError as exc:
        if "ALERT" not in str(exc).upper():  # an alert (e.g. "certificate required") is TLS speaking
            return None
    except OSError:
        return None
    return (
        f"etcd at {target} serves TLS, but no TLS is configured: set ca_file (rdzv-conf ca_file, "
        "rendezvous.tls.ca_file)"
    )


def connect_config(
    cfg: EtcdConfig,
    *,
    probe_key: str | None = None,
    timeout: float | None = None,
    connect_timeout: float | None = None,
) -> Etcd:
    """:func:`connect` with a config's settings (endpoints, TLS, user, password from env/file).

    The RPC deadline and the wait for an unreachable etcd default to ``cfg.rpc_timeout`` and
    ``cfg.connect_timeout``.

    Raises:
        EtcdError: unreachable for ``connect_timeout``, TLS or authentication failure (one line).
        ConfigError: a user without a password.
    """
    return connect(
        cfg.endpoint,
        tls=cfg.tls,
        user=cfg.user,
        password=cfg.read_password(),
        timeout=cfg.rpc_timeout if timeout is None else timeout,
        probe_key=probe_key,
        connect_timeout=cfg.connect_timeout if connect_timeout is None else connect_timeout,
    )
