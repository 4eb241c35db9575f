"""Watch-driven view of one run's keys, and the lease that keeps a node alive.

:class:`RunView` lists the run prefix once, then follows a watch; every reader (``num_nodes_waiting`` on each
0.1 s monitor tick, the round-closing loop) reads the in-memory copy. When the watch breaks (etcd restart) it
re-lists and watches again. :class:`LeaseKeeper` refreshes a lease every TTL/3 (or the configured keep-alive
interval), each refresh bounded by that interval and failing over to another etcd member, and, when the
lease is gone (etcd lost it, or this process was stopped longer than the TTL), grants a new one and
re-writes the node's keys through a callback. An etcd that cannot answer (an election, lost quorum) is not a
lost lease: the keeper retries until etcd answers, and only a lease etcd reports gone is re-created.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from elastic_train.etcd.client import Etcd, KeyValue
from elastic_train.etcd.errors import EtcdError
from elastic_train.log import get_logger

log = get_logger(__name__)


class RunView:
    """An eventually consistent copy of every key under ``prefix``, updated by a watch.

    ``cond`` is notified after every change; ``last_change`` is the monotonic time of the last node or join
    key appearing, changing or disappearing (what the settle window measures). Keys are also indexed by
    their first path segment (``nodes/``, ``join/``), so :meth:`under` costs the size of that group, not of
    the whole run.
    """

    def __init__(self, etcd: Etcd, prefix: str, *, activity_prefixes: tuple[str, ...] = ()) -> None:
        self.etcd = etcd
        self.prefix = prefix
        self.keys: dict[str, KeyValue] = {}
        self._groups: dict[str, dict[str, KeyValue]] = {}
        self.revision = 0
        self.cond = threading.Condition()
        self.last_change = time.monotonic()
        self.connected = False
        self._activity = tuple(prefix + p for p in activity_prefixes)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._synced = threading.Event()

    def start(self, timeout: float = 10.0) -> None:
        """List the prefix (raising :class:`EtcdError` if etcd is unusable) and start following it."""
        self._resync()
        self._thread = threading.Thread(target=self._run, name=f"rdzv-watch{self.prefix}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self.cond:
            self.cond.notify_all()

    def _is_activity(self, key: str) -> bool:
        return key.startswith(self._activity)

    def _resync(self) -> None:
        kvs, rev = self.etcd.get_prefix(self.prefix)
        fresh = {kv.key: kv for kv in kvs}
        with self.cond:
            changed = {k for k in fresh.keys() ^ self.keys.keys() if self._is_activity(k)}
            changed |= {
                k
                for k in fresh.keys() & self.keys.keys()
                if self._is_activity(k) and fresh[k].mod_revision != self.keys[k].mod_revision
            }
            self.keys = fresh
            self._groups = {}
            for key, kv in fresh.items():
                group, name = self._split(key)
                self._groups.setdefault(group, {})[name] = kv
            self.revision = rev
            self.connected = True
            if changed:
                self.last_change = time.monotonic()
            self.cond.notify_all()

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                if failures:
                    self._resync()
                for batch in self.etcd.watch_prefix(self.prefix, self.revision + 1, self._stop):
                    failures = 0
                    self._apply(batch)
                if self._stop.is_set():
                    return
                failures += 1
            except EtcdError as exc:
                failures += 1
                with self.cond:
                    self.connected = False
                if failures in (1, 10) or failures % 100 == 0:
                    log.warning("watch_failed", prefix=self.prefix, error=str(exc), attempts=failures)
                self._stop.wait(min(1.0, 0.1 * failures))
            except Exception as exc:
                failures += 1
                log.error("watch_crashed", prefix=self.prefix, error=repr(exc))
                self._stop.wait(1.0)

    def _split(self, key: str) -> tuple[str, str]:
        """(first path segment with its slash, rest) of a key under the prefix."""
        rest = key[len(self.prefix) :]
        cut = rest.find("/") + 1
        return rest[:cut], rest[cut:]

    def _apply(self, batch: list) -> None:
        with self.cond:
            activity = False
            for ev in batch:
                group, name = self._split(ev.key)
                if ev.value is None:
                    self.keys.pop(ev.key, None)
                    self._groups.get(group, {}).pop(name, None)
                else:
                    kv = KeyValue(ev.key, ev.value, ev.mod_revision, ev.create_revision, ev.lease)
                    self.keys[ev.key] = kv
                    self._groups.setdefault(group, {})[name] = kv
                self.revision = max(self.revision, ev.mod_revision)
                activity = activity or self._is_activity(ev.key)
            if activity:
                self.last_change = time.monotonic()
            self.cond.notify_all()

    def under(self, sub: str) -> dict[str, KeyValue]:
        """Keys under ``prefix + sub`` keyed by the remainder of the key (call with ``cond`` held).

        ``sub`` is a first path segment with its trailing slash (``"nodes/"``), or any other key prefix
        (then every key is scanned).
        """
        if sub.endswith("/") and sub.find("/") == len(sub) - 1:
            return dict(self._groups.get(sub, {}))
        p = self.prefix + sub
        return {k[len(p) :]: kv for k, kv in self.keys.items() if k.startswith(p)}

    def get(self, sub: str) -> KeyValue | None:
        return self.keys.get(self.prefix + sub)


class LeaseKeeper:
    """Keeps one lease alive from a daemon thread; re-creates it (and the keys on it) when it is lost.

    Args:
        etcd: client.
        ttl: lease TTL in seconds (etcd rounds to whole seconds; at least 1).
        on_new_lease: called with the new lease id after (re-)granting, to (re-)write the keys on it.
        interval: seconds between keep-alives, and each one's deadline (default ``ttl / 3``, at least
            0.2 s); at most ``ttl / 2`` so that a failed one is retried before the lease expires.

    Raises:
        ValueError: ``interval`` does not fit ``ttl``.
    """

    def __init__(
        self,
        etcd: Etcd,
        ttl: float,
        on_new_lease: Callable[[int], None],
        *,
        interval: float | None = None,
    ) -> None:
        self.etcd = etcd
        self.ttl = max(1, round(ttl))
        self.interval = max(0.2, ttl / 3.0) if interval is None else interval
        if not 0 < self.interval <= max(ttl, 1) / 2:
            raise ValueError(
                f"keep-alive interval {self.interval:g} s does not fit lease TTL {ttl:g} s "
                "(at most half of it, so that a failed keep-alive is retried before the lease expires)"
            )
        self.on_new_lease = on_new_lease
        self.lease_id = 0
        #: Monotonic time etcd last confirmed the lease (granted or refreshed it).
        self.last_ok = time.monotonic()
        #: How often etcd answered that the lease was gone (each time it was granted anew): a node whose
        #: count moved was dropped by its peers meanwhile (:mod:`elastic_train.rendezvous.fence`).
        self.losses = 0
        self._slow_warned = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> int:
        """Grant the lease and write the keys (raising :class:`EtcdError`), then keep it alive."""
        self._renew()
        self._thread = threading.Thread(target=self._run, name="rdzv-lease", daemon=True)
        self._thread.start()
        return self.lease_id

    def _renew(self) -> None:
        with self._lock:
            self.lease_id = self.etcd.lease_grant(self.ttl)
            self.on_new_lease(self.lease_id)
            self.last_ok = time.monotonic()

    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(self.interval if not failures else min(self.interval, 0.25)):
            try:
                t0 = time.monotonic()
                left = self.etcd.lease_keepalive(self.lease_id, timeout=self.interval)
                took = time.monotonic() - t0
                if left > 0:
                    self.last_ok = time.monotonic()
                # After failures the call included reconnecting (a cut healing, etcd back): not slowness.
                if took > self.interval / 2 and not failures and not self._slow_warned:
                    self._slow_warned = True
                    log.warning(
                        "lease_keepalive_slow",
                        took_s=round(took, 3),
                        interval_s=round(self.interval, 3),
                        hint="etcd answers slowly for this lease TTL: raise rdzv-conf lease_ttl",
                    )
                if left <= 0:
                    log.warning("lease_lost", lease=self.lease_id)
                    self.losses += 1
                    self._renew()
                    log.info("lease_recreated", lease=self.lease_id)
                if failures:
                    log.info("lease_keepalive_recovered", attempts=failures, member=self.etcd.member)
                failures = 0
            except EtcdError as exc:
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:
                    log.warning("lease_keepalive_failed", error=str(exc), attempts=failures)
            except Exception as exc:
                failures += 1
                log.error("lease_keepalive_crashed", error=repr(exc))

    def stop(self, revoke: bool = True) -> None:
        """Stop refreshing; with ``revoke`` delete the lease (and its keys) at once so peers see us leave."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if revoke and self.lease_id:
            try:
                self.etcd.lease_revoke(self.lease_id)
            except EtcdError as exc:
                log.warning("lease_revoke_failed", error=str(exc))
