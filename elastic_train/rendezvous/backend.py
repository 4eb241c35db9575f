"""``etcd3-dynamic``: an etcd v3 ``RendezvousBackend`` and c10d Store for torch's DynamicRendezvousHandler.

The backend keeps torch's encoded rendezvous state in one key; torch's state token is the key's etcd mod
revision, and ``set_state`` is one compare-and-set transaction. The store is a c10d Store in Python over etcd
keys (blocking reads poll with a short backoff), used by the handler for its per-round prefix store. Both keep
the contracts torch's own ``c10d`` and ``etcd-v2`` backends keep (tests/integration/test_store_contract.py):
a timed-out read raises ``DistStoreError``, ``set_timeout`` and ``clone`` work through a ``PrefixStore``.

Expiry, as torch's etcd-v2 backend: everything a node writes (the state, store keys) carries that node's
etcd lease of ``state_ttl`` seconds (two hours by default), refreshed by its writes. Live nodes rewrite the
state every ``keep_alive_interval``, so a running job never expires; ``state_ttl`` after the last node stops,
the run's keys are gone and its run id starts afresh.

Inherited from DynamicRendezvousHandler (documented in docs/rendezvous.md): heartbeats by rewriting the state
blob (no watch), a ``last_call_timeout`` wait (30 s by default), and the shared-TCPStore pitfall (we default
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in the registry).
"""

from __future__ import annotations

import binascii
import random
import threading
import time
import uuid
from base64 import b64decode, b64encode
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import grpc
from etcd3 import etcdrpc
from torch.distributed import DistNetworkError, DistStoreError, QueueEmptyError, Store
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from elastic_train.etcd.client import Etcd, cmp_mod, cmp_version, op_delete, op_get, op_put
from elastic_train.etcd.errors import EtcdError
from elastic_train.etcd.keys import range_end
from elastic_train.log import get_logger
from elastic_train.rendezvous.config import run_prefix
from elastic_train.rendezvous.connect import open_etcd
from elastic_train.rendezvous.params import DEFAULT_STATE_TTL, ETCD3_DYNAMIC, parse_params

log = get_logger(__name__)

T = TypeVar("T")

BACKEND_NAME = ETCD3_DYNAMIC
#: Store timeout without ``read_timeout`` in the rdzv-conf: torch's c10d backend's default.
DEFAULT_READ_TIMEOUT = 60.0
#: Most operations etcd takes in one transaction (its default ``--max-txn-ops``).
MAX_TXN_OPS = 128
#: Longest pause between two polls of a blocking store read.
POLL_MAX = 0.05
#: What a store's queues live under, beside its keys: ``<store prefix without its "/">`` + this.
QUEUES_SUFFIX = "@queues/"


def queues_prefix(store_prefix: str) -> str:
    """The etcd prefix of the queues of the store at ``store_prefix`` (beside its keys, so that ``num_keys``
    and ``list_keys`` count keys only, as TCPStore's)."""
    return store_prefix.rstrip("/") + QUEUES_SUFFIX


def _is_lease_lost(exc: EtcdError) -> bool:
    cause = exc.__cause__
    if isinstance(cause, grpc.RpcError) and hasattr(cause, "code"):
        return bool(cause.code() == grpc.StatusCode.NOT_FOUND)
    return "lease not found" in str(exc)


class NodeLease:
    """The etcd lease one node's rendezvous writes carry: granted on first use, refreshed by later writes.

    A key written with it expires ``ttl`` seconds after this node's last write (up to 1% earlier: a write
    refreshes the lease only when the last refresh is older than ``ttl/100``). Thread-safe.
    """

    def __init__(self, etcd: Etcd, ttl: int = DEFAULT_STATE_TTL) -> None:
        assert ttl >= 1, ttl
        self.ttl = ttl
        self._etcd = etcd
        self._lock = threading.Lock()
        self._id: int | None = None
        self._refreshed = 0.0

    def current(self) -> int:
        """The lease id to attach to a write now (granting or refreshing it first when due).

        Raises:
            EtcdError: etcd failed.
        """
        with self._lock:
            now = time.monotonic()
            if self._id is not None and now - self._refreshed >= self.ttl / 100:
                if self._etcd.lease_keepalive(self._id) > 0:
                    self._refreshed = now
                else:
                    self._id = None
            if self._id is None:
                self._id = self._etcd.lease_grant(self.ttl)
                self._refreshed = now
            return self._id

    def write(self, op: Callable[[int], T]) -> T:
        """Run ``op(lease_id)``; if etcd no longer knows the lease (expired while this process was stopped
        longer than ``ttl``), grant a new one and run ``op`` once more.

        Raises:
            EtcdError: etcd failed.
        """
        lease = self.current()
        try:
            return op(lease)
        except EtcdError as exc:
            if not _is_lease_lost(exc):
                raise
            with self._lock:
                if self._id == lease:
                    self._id = None
            return op(self.current())


class Etcd3RendezvousBackend(RendezvousBackend):
    """Rendezvous state in ``/elastic_train/<run>/dynamic/state`` (base64), compared on its mod revision.

    Args:
        etcd: a connected client.
        run_id: the run; its state key lives under the run's prefix.
        ttl: seconds the state lives after the last write (``None`` or <= 0: two hours, as torch's etcd-v2
            backend). Ignored when ``lease`` is given.
        lease: the node's lease, shared with its :class:`Etcd3Store` so both expire together.
        store_prefix: the run's store prefix: the write that creates the state (a new run, or the first after
            the old state expired) deletes any store key and queue left under it in the same transaction, so
            a run id used again never reads a former job's store keys.

    Raises (every method):
        RendezvousConnectionError: etcd failed.
        RendezvousStateError: the stored state is not valid base64.
    """

    def __init__(
        self,
        etcd: Etcd,
        run_id: str,
        ttl: int | None = None,
        *,
        lease: NodeLease | None = None,
        store_prefix: str | None = None,
    ) -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        self._etcd = etcd
        self._key = run_prefix(run_id) + "dynamic/state"
        self._lease = lease or NodeLease(etcd, ttl if ttl and ttl > 0 else DEFAULT_STATE_TTL)
        self._store_prefix = store_prefix

    @property
    def name(self) -> str:
        return BACKEND_NAME

    @property
    def ttl(self) -> int:
        """Seconds the state lives after the last write."""
        return self._lease.ttl

    def get_state(self) -> tuple[bytes, Token] | None:
        try:
            kv = self._etcd.get(self._key)
        except EtcdError as exc:
            raise RendezvousConnectionError(f"etcd failed reading rendezvous state: {exc}") from exc
        if kv is None:
            return None
        return self._decode(kv.value), kv.mod_revision

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        if token is not None:
            try:
                revision = int(token)
            except (TypeError, ValueError):
                result = self.get_state()
                return (*result, False) if result is not None else None
            creates = revision <= 0
            compare = cmp_version(self._key, 0) if creates else cmp_mod(self._key, revision)
        else:
            creates, compare = True, cmp_version(self._key, 0)
        value = b64encode(state)
        cleanup = (
            [_op_delete_prefix(self._store_prefix), _op_delete_prefix(queues_prefix(self._store_prefix))]
            if creates and self._store_prefix
            else []
        )
        try:
            ok, resp = self._lease.write(
                lambda lease: self._etcd.txn(
                    [compare], [op_put(self._key, value, lease), *cleanup], [op_get(self._key)]
                )
            )
        except EtcdError as exc:
            raise RendezvousConnectionError(f"etcd failed writing rendezvous state: {exc}") from exc
        if ok:
            return state, int(resp.header.revision), True
        kvs = resp.responses[0].response_range.kvs
        if not kvs:
            return None
        return self._decode(kvs[0].value), int(kvs[0].mod_revision), False

    @staticmethod
    def _decode(raw: bytes) -> bytes:
        try:
            return b64decode(raw, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise RendezvousStateError("the rendezvous state stored in etcd is corrupt (not base64)") from exc


def _op_delete_prefix(prefix: str) -> Any:
    return etcdrpc.RequestOp(
        request_delete_range=etcdrpc.DeleteRangeRequest(key=prefix.encode(), range_end=range_end(prefix))
    )


def _count(prefix: str) -> Any:
    return etcdrpc.RequestOp(
        request_range=etcdrpc.RangeRequest(key=prefix.encode(), range_end=range_end(prefix), count_only=True)
    )


def _bytes(value: str | bytes | Sequence[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class Etcd3Store(Store):
    """A c10d Store on etcd v3 keys under ``prefix``.

    Semantics are torch's (as its TCPStore and the tests in torch's ``test_store.py``): blocking reads
    (``get``, ``wait``, ``multi_get``) wait up to the store timeout (``set_timeout``, also through a
    ``PrefixStore``) and then raise ``DistStoreError``; ``add`` and ``append`` are compare-and-set loops on
    the key's mod revision (concurrent callers never lose an update); ``compare_set`` with an empty expected
    value creates a missing key; ``multi_set`` is one transaction per 128 keys. An etcd failure raises
    ``DistNetworkError`` (a ``RuntimeError``, as a TCPStore whose server is gone).

    Queues, as TCPStore's: ``queue_push`` appends, ``queue_pop`` takes the oldest item (FIFO by etcd's create
    revision; concurrent poppers each get a different item), waiting up to the store timeout when the queue
    is empty (``DistStoreError``) or raising ``QueueEmptyError`` at once with ``block=False``; ``check`` and
    ``wait`` count a key whose queue holds an item as present. Items live beside the keys
    (:func:`queues_prefix`), so ``num_keys`` and ``list_keys`` count keys only. torch's ``PrefixStore`` does
    not forward queues or ``list_keys`` to a store written in Python (they raise torch's
    ``NotImplementedError`` through it); called on this object they work.

    Args:
        etcd: a connected client (thread-safe; clones share it).
        prefix: the etcd key prefix of every store key.
        timeout: the store timeout (c10d's default 300 s when ``None``).
        lease: the node's lease attached to every write (keys expire with it); ``None``: keys never expire.
    """

    def __init__(
        self,
        etcd: Etcd,
        prefix: str,
        timeout: timedelta | None = None,
        *,
        lease: NodeLease | None = None,
        _clones: list[Etcd3Store] | None = None,
    ) -> None:
        super().__init__()
        self._etcd = etcd
        self._prefix = prefix if prefix.endswith("/") else prefix + "/"
        self._lease = lease
        # A clone handed to C++ (PrefixStore.clone) is referenced by nothing in Python; pybind11 would drop
        # its Python half and every later call would fail. The family of clones keeps each one alive as long
        # as any member is.
        self._clones = [] if _clones is None else _clones
        if timeout is not None:
            self.set_timeout(timeout)

    def __repr__(self) -> str:
        return f"Etcd3Store(prefix={self._prefix!r}, timeout={self._timeout})"

    @property
    def _timeout(self) -> timedelta:
        # Held by the C++ base (not overridden here), so PrefixStore.set_timeout and torch's store_timeout()
        # reach it; torch's type stubs do not declare the property.
        timeout: timedelta = self.timeout  # type: ignore[attr-defined]
        return timeout

    @property
    def prefix(self) -> str:
        return self._prefix

    # -- helpers ---------------------------------------------------------------------------------------------

    def _k(self, key: str) -> str:
        return self._prefix + key

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        except EtcdError as exc:
            raise DistNetworkError(f"etcd store at {self._prefix}: {exc}") from exc

    def _write(self, pairs: Sequence[tuple[str, bytes]], compare: Sequence[Any] = ()) -> bool:
        """Put ``pairs`` (etcd keys, values) in one transaction (if ``compare`` holds) with the node lease;
        whether it applied."""

        def run(lease: int) -> bool:
            ok, _ = self._etcd.txn(list(compare), [op_put(k, v, lease) for k, v in pairs])
            return ok

        if self._lease is None:
            return self._call(run, 0)
        return self._call(self._lease.write, run)

    def _ranges(
        self, keys: Sequence[str], ops: Callable[[str], list[Any]]
    ) -> Iterator[tuple[str, list[Any]]]:
        """Each distinct key of ``keys`` with the range responses of its read operations ``ops(key)``, in as
        few transactions as etcd takes (:data:`MAX_TXN_OPS` operations each)."""
        unique = list(dict.fromkeys(keys))
        if not unique:
            return
        width = len(ops(unique[0]))
        per = MAX_TXN_OPS // width
        for i in range(0, len(unique), per):
            chunk = unique[i : i + per]
            _, resp = self._call(self._etcd.txn, [], [op for k in chunk for op in ops(k)])
            for j, key in enumerate(chunk):
                yield key, [r.response_range for r in resp.responses[j * width : (j + 1) * width]]

    def _read(self, keys: Sequence[str]) -> dict[str, Any]:
        """The keys of ``keys`` that exist now, with their etcd KVs (one transaction per 128 keys)."""
        return {key: kv.kvs[0] for key, (kv,) in self._ranges(keys, lambda k: [op_get(self._k(k))]) if kv.kvs}

    def _poll(self, look: Callable[[], list[str]], timeout: timedelta) -> None:
        """Call ``look()`` (the keys it still waits for) until it returns none, backing off from 2 ms to
        :data:`POLL_MAX` between looks.

        Raises:
            DistStoreError: keys still missing after ``timeout`` (torch's message: "wait timeout after ...").
        """
        deadline = time.monotonic() + timeout.total_seconds()
        delay = 0.002
        while missing := look():
            left = deadline - time.monotonic()
            if left <= 0:
                raise DistStoreError(
                    f"wait timeout after {timeout.total_seconds() * 1000:.0f}ms, keys: {missing} "
                    f"(etcd store at {self._prefix})"
                )
            time.sleep(min(delay, left))
            delay = min(delay * 2, POLL_MAX)

    def _wait_values(self, keys: Sequence[str], timeout: timedelta) -> list[bytes]:
        found: dict[str, bytes] = {}

        def look() -> list[str]:
            for key, kv in self._read([k for k in keys if k not in found]).items():
                found[key] = kv.value
            return [k for k in keys if k not in found]

        self._poll(look, timeout)
        return [found[k] for k in keys]

    def _queue(self, key: str) -> str:
        """The etcd prefix of ``key``'s queue items (the key hex-encoded: no queue's range holds another)."""
        return queues_prefix(self._prefix) + key.encode().hex() + "/"

    def _missing(self, keys: Sequence[str]) -> list[str]:
        """The keys of ``keys`` that neither exist nor have a queue item (what ``check`` and ``wait`` see):
        each key read and its queue counted in one transaction (per 64 keys)."""
        looks = self._ranges(keys, lambda k: [op_get(self._k(k)), _count(self._queue(k))])
        return [key for key, (kv, queued) in looks if not kv.kvs and not queued.count]

    def _pop(self, key: str) -> bytes | None:
        """Take the oldest item of ``key``'s queue, or ``None`` when it is empty (a concurrent popper that
        took the same item first makes this look again)."""
        prefix = self._queue(key)
        oldest = etcdrpc.RequestOp(
            request_range=etcdrpc.RangeRequest(
                key=prefix.encode(),
                range_end=range_end(prefix),
                limit=1,
                sort_order=etcdrpc.RangeRequest.ASCEND,
                sort_target=etcdrpc.RangeRequest.CREATE,
            )
        )
        while True:
            _, resp = self._call(self._etcd.txn, [], [oldest])
            kvs = resp.responses[0].response_range.kvs
            if not kvs:
                return None
            item = kvs[0]
            name = item.key.decode()
            taken, _ = self._call(self._etcd.txn, [cmp_mod(name, int(item.mod_revision))], [op_delete(name)])
            if taken:
                return bytes(item.value)

    def _cas_loop(self, key: str, update: Callable[[bytes | None], bytes | None]) -> bytes | None:
        """Apply ``update(current value or None)`` atomically; ``None`` from ``update`` writes nothing.

        Returns the value written, or ``None`` when ``update`` declined.
        """
        k = self._k(key)
        while True:
            kv = self._call(self._etcd.get, k)
            new = update(kv.value if kv is not None else None)
            if new is None:
                return None
            if self._write([(k, new)], [cmp_mod(k, kv.mod_revision if kv is not None else 0)]):
                return new
            time.sleep(random.uniform(0, 0.005))  # another writer won: back off a little before re-reading

    # -- c10d Store ------------------------------------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        self._write([(self._k(key), _bytes(value))])

    def get(self, key: str) -> bytes:
        return self._wait_values([key], self._timeout)[0]

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the decimal integer at ``key`` (0 when missing); the new value.

        Raises:
            ValueError: the value at ``key`` is not a decimal integer.
        """

        def plus(current: bytes | None) -> bytes:
            try:
                number = int(current) if current is not None else 0
            except ValueError:
                raise ValueError(f"etcd store: add: the value of {key!r} is not an integer") from None
            return str(number + amount).encode()

        result = self._cas_loop(key, plus)
        assert result is not None
        return int(result)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (or is missing and ``expected`` is empty).

        Returns ``desired`` when it was set; else the current value (``expected`` when the key is missing).
        """
        want, new = _bytes(expected), _bytes(desired)
        seen: list[bytes | None] = [None]

        def swap(current: bytes | None) -> bytes | None:
            seen[0] = current
            matches = current == want if current is not None else want == b""
            return new if matches else None

        if self._cas_loop(key, swap) is not None:
            return new
        return seen[0] if seen[0] is not None else want

    def append(self, key: str, value: str | bytes) -> None:
        tail = _bytes(value)
        self._cas_loop(key, lambda current: (current or b"") + tail)

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"etcd store: multi_set: {len(keys)} keys but {len(values)} values")
        pairs = [(self._k(k), _bytes(v)) for k, v in zip(keys, values, strict=True)]
        for i in range(0, len(pairs), MAX_TXN_OPS):
            self._write(pairs[i : i + MAX_TXN_OPS])

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return self._wait_values(list(keys), self._timeout)

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key exists, or has an item in its queue, now (never waits)."""
        return not self._missing(list(keys))

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        """Wait until every key exists or has an item in its queue."""
        keys = list(keys)
        self._poll(lambda: self._missing(keys), self._timeout if timeout is None else timeout)

    def list_keys(self) -> list[str]:
        """Every key of the store (under its prefix; queues are not keys)."""
        kvs, _ = self._call(self._etcd.get_prefix, self._prefix)
        return [kv.key[len(self._prefix) :] for kv in kvs]

    def queue_push(self, key: str, value: str | bytes) -> None:
        """Append ``value`` to ``key``'s queue."""
        self._write([(self._queue(key) + uuid.uuid4().hex, _bytes(value))])

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """Take the oldest item of ``key``'s queue, waiting up to the store timeout for one.

        Raises:
            QueueEmptyError: ``block`` is False and the queue is empty.
            DistStoreError: still empty after the store timeout.
        """
        if not block:
            value = self._pop(key)
            if value is None:
                raise QueueEmptyError(f"queue is empty: {key!r} (etcd store at {self._prefix})")
            return value
        got: list[bytes] = []

        def look() -> list[str]:
            value = self._pop(key)
            if value is None:
                return [key]
            got.append(value)
            return []

        self._poll(look, self._timeout)
        return got[0]

    def queue_len(self, key: str) -> int:
        """The number of items in ``key``'s queue (0 when it has none)."""
        _, resp = self._call(self._etcd.txn, [], [_count(self._queue(key))])
        return int(resp.responses[0].response_range.count)

    # PrefixStore forwards num_keys/delete_key to these C++ names (pybind11 looks them up on this class).

    def deleteKey(self, key: str) -> bool:
        """Delete ``key``; whether it existed."""
        _, resp = self._call(self._etcd.txn, [], [op_delete(self._k(key))])
        return int(resp.responses[0].response_delete_range.deleted) > 0

    def getNumKeys(self) -> int:
        """The number of keys in the store (every key under its prefix)."""
        _, resp = self._call(self._etcd.txn, [], [_count(self._prefix)])
        return int(resp.responses[0].response_range.count)

    delete_key = deleteKey
    num_keys = getNumKeys

    def has_extended_api(self) -> bool:
        return True

    def clone(self) -> Etcd3Store:
        """Another store on the same keys, connection and lease, with this store's timeout (thread-safe)."""
        twin = Etcd3Store(self._etcd, self._prefix, self._timeout, lease=self._lease, _clones=self._clones)
        self._clones.append(twin)
        return twin


def create_backend(params: RendezvousParameters) -> tuple[Etcd3RendezvousBackend, Store]:
    """The v3 backend and store for torch's DynamicRendezvousHandler, like torch's own ``create_backend``.

    ``params.config`` takes the rdzv-conf keys of docs/rendezvous.md: ``read_timeout`` (the store timeout,
    60 s by default as torch's c10d backend), ``state_ttl`` (7200 s, as torch's etcd-v2 state TTL), TLS and
    authentication (``ca_file``/``cert_file``/``key_file`` or etcd-v2's ``ca_cert``/``ssl_cert``/
    ``ssl_cert_key`` with ``protocol``; ``user``, ``password_env``, ``password_file``) and torch's dynamic
    handler keys; c10d's ``store_type`` and ``is_host`` are ignored with a warning.

    Raises:
        ConfigError: unknown rdzv-conf key or invalid value (one line).
        RendezvousConnectionError: etcd unreachable, TLS or authentication failure (one line).
    """
    parsed = parse_params(params, backend=BACKEND_NAME)
    for key, why in parsed.ignored.items():
        log.warning("rdzv_conf_ignored", backend=BACKEND_NAME, key=key, reason=why)
    try:
        etcd = open_etcd(parsed.config)
    except EtcdError as exc:
        raise RendezvousConnectionError(str(exc)) from exc
    lease = NodeLease(etcd, parsed.store.state_ttl)
    prefix = run_prefix(parsed.config.run_id) + "dynamic/store/"
    backend = Etcd3RendezvousBackend(etcd, parsed.config.run_id, lease=lease, store_prefix=prefix)
    timeout = parsed.store.read_timeout or DEFAULT_READ_TIMEOUT
    store = Etcd3Store(etcd, prefix, timedelta(seconds=timeout), lease=lease)
    return backend, store
