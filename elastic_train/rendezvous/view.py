"""Watch-driven view of one run's keys, and the lease that keeps a node alive.

:class:`RunView` lists the run prefix once, then follows a watch; every reader (``num_nodes_waiting`` on each
0.1 s monitor tick, the round-closing loop) reads the in-memory copy. When the watch breaks (etcd restart) it
re-lists and watches again. Values are decoded once per change for every reader of the view
(:meth:`RunView.decoded`, :meth:`RunView.decoded_under`), and a reader that only cares about the run's
records (a closed round, the run's end) can sleep through the joins of a large job
(:meth:`RunView.wait_record`). :class:`LeaseKeeper` refreshes a lease every TTL/3 (or the configured
keep-alive interval), each refresh bounded by that interval and failing over to another etcd member, and, when
the lease is gone (etcd lost it, or this process was stopped longer than the TTL), grants a new one and
re-writes the node's keys through a callback. An etcd that cannot answer (an election, lost quorum) is not a
lost lease: the keeper retries until etcd answers, and only a lease etcd reports gone is re-created. A process
that holds many leases (the scale benchmark's hosts of simulated nodes) refreshes them over one stream per
interval (:class:`KeepAliveBatch`).
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from elastic_train.etcd.client import Etcd, KeyValue
from elastic_train.etcd.errors import EtcdError
from elastic_train.log import get_logger

log = get_logger(__name__)

T = TypeVar("T")

#: Decoding failures that leave a key out of :meth:`RunView.decoded_under` (untrusted values read from etcd).
DECODE_ERRORS = (ValueError, KeyError, TypeError, AttributeError)
#: Shared results (:meth:`RunView.memo`) a view keeps before it forgets the older ones.
MEMO_KEEP = 16
#: Most leases a :class:`KeepAliveBatch` refreshes over one stream, and most streams it runs at once.
BATCH_STREAM_LEASES = 32
BATCH_STREAMS = 16


class RunView:
    """An eventually consistent copy of every key under ``prefix``, updated by a watch.

    ``cond`` is notified after every change; ``last_change`` is the monotonic time of the last node or join
    key appearing, changing or disappearing (what the settle window measures). Keys are also indexed by
    their first path segment (``nodes/``, ``join/``), so :meth:`under` costs the size of that group, not of
    the whole run.

    The keys under ``activity_prefixes`` are written by every node of a large job (N joins per round, and
    as many deletions when leases expire at once); the others are the run's records (the last round, its
    end). A reader that waits for a record only (:meth:`wait_record`), or for the view to reach a revision
    (:meth:`wait_revision`), is not woken by each join: with a view shared by many participants of one
    process that would be N wake-ups per join. :attr:`generation` counts the records and the departures
    (a deleted key of any kind): what a shared picture of the run may not be stale by (:meth:`memo`).
    """

    def __init__(self, etcd: Etcd, prefix: str, *, activity_prefixes: tuple[str, ...] = ()) -> None:
        self.etcd = etcd
        self.prefix = prefix
        self.keys: dict[str, KeyValue] = {}
        self._groups: dict[str, dict[str, KeyValue]] = {}
        self.revision = 0
        #: Changes of a record, deletions, re-lists: what a picture of the run may not be stale by.
        self.generation = 0
        lock = threading.RLock()
        self.cond = threading.Condition(lock)
        self._records = threading.Condition(lock)
        self._lock = lock
        self._rev_waiters: list[tuple[int, int, threading.Condition]] = []
        self._seq = itertools.count()
        self._decoded_keys: dict[str, tuple[KeyValue, Any]] = {}
        self._decoded_groups: dict[str, tuple[Callable[[str, KeyValue], Any], dict[str, Any], set[str]]] = {}
        self._memo: dict[Hashable, tuple[int, int, float, Any]] = {}
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
            self._notify(records=True)

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
            self._decoded_groups = {}
            for key, kv in fresh.items():
                group, name = self._split(key)
                self._groups.setdefault(group, {})[name] = kv
            self.revision = rev
            self.connected = True
            if changed:
                self.last_change = time.monotonic()
            self.generation += 1
            self._notify(records=True)

    def _notify(self, *, records: bool) -> None:
        """Wake the readers a change concerns (``cond`` held): every :attr:`cond` waiter, the waiters for a
        revision the view reached, and with ``records`` (a key other than an activity key changed) every
        :meth:`wait_record` and :meth:`wait_revision` waiter."""
        self.cond.notify_all()
        if records:
            self._records.notify_all()
        waiters = self._rev_waiters
        while waiters and (records or waiters[0][0] <= self.revision):
            heapq.heappop(waiters)[2].notify()

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
            activity = records = departures = False
            for ev in batch:
                group, name = self._split(ev.key)
                if ev.value is None:
                    self.keys.pop(ev.key, None)
                    self._groups.get(group, {}).pop(name, None)
                else:
                    kv = KeyValue(ev.key, ev.value, ev.mod_revision, ev.create_revision, ev.lease)
                    self.keys[ev.key] = kv
                    self._groups.setdefault(group, {})[name] = kv
                decoded = self._decoded_groups.get(group)
                if decoded is not None:
                    decoded[2].add(name)
                self.revision = max(self.revision, ev.mod_revision)
                if self._is_activity(ev.key):
                    activity = True
                    departures = departures or ev.value is None
                else:
                    records = True
            if activity:
                self.last_change = time.monotonic()
            if records or departures:
                self.generation += 1
            self._notify(records=records)

    def wait_record(self, timeout: float) -> bool:
        """Wait (``cond`` held) until a key other than an activity key changes (a round closed, the run
        ended), the view re-lists or stops, or ``timeout`` seconds pass; joins and node keys (new or gone)
        do not wake it.

        Returns:
            False on timeout.
        """
        return self._records.wait(max(0.0, timeout))

    def wait_revision(self, revision: int, timeout: float) -> bool:
        """Wait (``cond`` held) until the view has reached ``revision`` (a write of this process shows), a
        record changes, or ``timeout`` seconds pass.

        Returns:
            Whether the view has reached ``revision``.
        """
        if self.revision >= revision:
            return True
        waiter = threading.Condition(self._lock)
        heapq.heappush(self._rev_waiters, (revision, next(self._seq), waiter))
        waiter.wait(max(0.0, timeout))
        return self.revision >= revision

    def decoded(self, sub: str, decode: Callable[[bytes], T]) -> T | None:
        """``decode`` of the value of ``prefix + sub`` (``None`` when absent), computed once per change of the
        key for every reader of the view (call with ``cond`` held; do not mutate the result).

        Raises:
            Whatever ``decode`` raises for a value it cannot read (nothing is remembered then).
        """
        kv = self.get(sub)
        if kv is None:
            return None
        hit = self._decoded_keys.get(sub)
        if hit is not None and hit[0] is kv:
            return hit[1]
        value = decode(kv.value)
        self._decoded_keys[sub] = (kv, value)
        return value

    def decoded_under(self, group: str, decode: Callable[[str, KeyValue], T]) -> dict[str, T]:
        """The keys of a group (a first path segment with its slash, ``"join/"``) decoded, by the rest of the
        key; each key is decoded once per change for every reader of the view, so a reader pays for what
        changed since it last looked, not for the size of the group. Keys ``decode`` cannot read
        (:data:`DECODE_ERRORS`) are left out.

        Call with ``cond`` held and pass the same ``decode`` every time; the result is the view's own copy,
        valid while ``cond`` is held: read it, do not mutate it.
        """
        entry = self._decoded_groups.get(group)
        keys = self._groups.get(group, {})
        if entry is None or entry[0] is not decode:
            values: dict[str, T] = {}
            for name, kv in keys.items():
                try:
                    values[name] = decode(name, kv)
                except DECODE_ERRORS:
                    continue
            self._decoded_groups[group] = (decode, values, set())
            return values
        _, values, dirty = entry
        for name in dirty:
            changed = keys.get(name)
            try:
                if changed is None:
                    raise KeyError(name)
                values[name] = decode(name, changed)
            except DECODE_ERRORS:
                values.pop(name, None)
        dirty.clear()
        return values

    def memo(self, key: Hashable, compute: Callable[[], T], max_age: float = 0.0) -> T:
        """``compute()`` shared by every reader of the view (call with ``cond`` held; do not mutate the
        result): reused while the view is still at the revision it was computed at, or for ``max_age``
        seconds while only activity keys were written since (no record changed, nothing was deleted): for a
        reader that looks at the run only every so often anyway.

        One participant per view (an agent) gains nothing but an equal revision; many participants of one
        process (the scale benchmark) share one O(N) computation per revision instead of paying one each.
        """
        now = time.monotonic()
        hit = self._memo.get(key)
        if hit is not None:
            revision, generation, at, value = hit
            if revision == self.revision or (generation == self.generation and now - at < max_age):
                return value
        value = compute()
        if len(self._memo) >= MEMO_KEEP and key not in self._memo:
            self._memo.pop(next(iter(self._memo)))
        self._memo[key] = (self.revision, self.generation, now, value)
        return value

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
            0.2 s); at most ``ttl / 2`` so that a failed keep-alive is retried before the lease expires.

    Attributes:
        batch: set before :meth:`start` to have a :class:`KeepAliveBatch` of this process refresh the lease
            (with the other leases of the batch, over one stream) instead of a thread of the keeper's own.

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
        self.batch: KeepAliveBatch | None = None
        self._slow_warned = False
        self._failures = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> int:
        """Grant the lease and write the keys (raising :class:`EtcdError`), then keep it alive."""
        self._renew()
        if self.batch is not None:
            self.batch.add(self)
        else:
            self._thread = threading.Thread(target=self._run, name="rdzv-lease", daemon=True)
            self._thread.start()
        return self.lease_id

    def _renew(self) -> None:
        with self._lock:
            self.lease_id = self.etcd.lease_grant(self.ttl)
            self.on_new_lease(self.lease_id)
            self.last_ok = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(self.interval if not self._failures else min(self.interval, 0.25)):
            t0 = time.monotonic()
            try:
                left = self.etcd.lease_keepalive(self.lease_id, timeout=self.interval)
            except EtcdError as exc:
                self.failed(exc)
                continue
            except Exception as exc:
                self.failed(exc)
                continue
            self.answered(left, time.monotonic() - t0)

    def answered(self, left: int, took: float) -> None:
        """Act on etcd's answer to a keep-alive that took ``took`` seconds (``nan``: not this keeper's to
        judge): ``left`` is the lease's remaining TTL; at most 0 means etcd no longer knows the lease, which
        is then granted anew and its keys re-written (errors count as a failed keep-alive)."""
        try:
            if left > 0:
                self.last_ok = time.monotonic()
            # After failures the call included reconnecting (a cut healing, etcd back): not slowness.
            if took > self.interval / 2 and not self._failures and not self._slow_warned:
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
            if self._failures:
                log.info("lease_keepalive_recovered", attempts=self._failures, member=self.etcd.member)
            self._failures = 0
        except Exception as exc:
            self.failed(exc)

    def failed(self, exc: Exception) -> None:
        """Count a keep-alive that failed (etcd did not answer, or re-creating the lease failed)."""
        self._failures += 1
        if not isinstance(exc, EtcdError):
            log.error("lease_keepalive_crashed", error=repr(exc))
        elif self._failures in (1, 10) or self._failures % 100 == 0:
            log.warning("lease_keepalive_failed", error=str(exc), attempts=self._failures)

    @property
    def retrying(self) -> bool:
        """Whether the last keep-alive failed (the next one comes sooner)."""
        return self._failures > 0

    def stop(self, revoke: bool = True) -> None:
        """Stop refreshing; with ``revoke`` delete the lease (and its keys) at once so peers see us leave."""
        self._stop.set()
        if self.batch is not None:
            self.batch.remove(self)
        if self._thread is not None:
            self._thread.join(timeout=5)
        if revoke and self.lease_id:
            try:
                self.etcd.lease_revoke(self.lease_id)
            except EtcdError as exc:
                log.warning("lease_revoke_failed", error=str(exc))


class KeepAliveBatch:
    """Refreshes the leases of many :class:`LeaseKeeper` of one process over a few keep-alive streams per
    interval (:meth:`Etcd.lease_keepalive_many`, at most :data:`BATCH_STREAM_LEASES` leases a stream, the
    streams concurrent), from one thread.

    An agent holds one lease and needs none of this. A process that simulates many nodes (the scale
    benchmark) would otherwise open one stream per lease per interval, about a millisecond of client CPU each
    in Python gRPC: at a few thousand nodes on a few cores that alone starves the keep-alives until leases
    expire. etcd sees the same keep-alive requests either way. Each keeper acts on its own answer as it
    would on its own thread's (a lost lease is granted anew, its keys re-written); a lease left unanswered
    counts as a failed keep-alive of its keeper, and the next exchange comes sooner and asks for the least
    recently confirmed leases first.

    Args:
        etcd: the client the batch's streams go through.
        interval: seconds between two refreshes, and each one's deadline (at most the keepers'
            :attr:`LeaseKeeper.interval`).
    """

    def __init__(self, etcd: Etcd, interval: float) -> None:
        self.etcd = etcd
        self.interval = interval
        self._keepers: dict[int, LeaseKeeper] = {}
        self._renewing: set[int] = set()
        #: Seconds the slowest exchange took, and leases left unanswered in all (the scale benchmark reports
        #: them).
        self.slowest = 0.0
        self.unanswered = 0
        self._slow_warned = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None

    def add(self, keeper: LeaseKeeper) -> None:
        """Refresh ``keeper``'s lease from the next interval on (starts the batch's thread once)."""
        with self._lock:
            self._keepers[id(keeper)] = keeper
            if self._thread is None:
                self._pool = ThreadPoolExecutor(BATCH_STREAMS, thread_name_prefix="rdzv-lease-stream")
                self._thread = threading.Thread(target=self._run, name="rdzv-lease-batch", daemon=True)
                self._thread.start()

    def remove(self, keeper: LeaseKeeper) -> None:
        with self._lock:
            self._keepers.pop(id(keeper), None)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def _exchange(self, leases: list[int]) -> dict[int, int] | Exception:
        try:
            return self.etcd.lease_keepalive_many(leases, timeout=self.interval)
        except Exception as exc:
            return exc

    def _run(self) -> None:
        assert self._pool is not None
        retry = False
        while not self._stop.wait(min(self.interval, 0.25) if retry else self.interval):
            with self._lock:
                # least recently confirmed first: a stream that etcd answers too slowly for the deadline cuts
                # off its last leases, and the same ones must not be last every time
                keepers = sorted(
                    (k for k in self._keepers.values() if id(k) not in self._renewing),
                    key=lambda k: k.last_ok,
                )
            by_lease = {k.lease_id: k for k in keepers}
            leases = list(by_lease)
            chunks = [leases[i : i + BATCH_STREAM_LEASES] for i in range(0, len(leases), BATCH_STREAM_LEASES)]
            t0 = time.monotonic()
            answers: dict[int, int] = {}
            errors: list[Exception] = []
            try:
                results = list(self._pool.map(self._exchange, chunks))
            except RuntimeError:  # the pool was shut down: stopping
                return
            for result in results:
                if isinstance(result, Exception):
                    errors.append(result)
                else:
                    answers.update(result)
            took = time.monotonic() - t0
            self.slowest = max(self.slowest, took)
            self.unanswered += len(leases) - len(answers)
            if took > self.interval / 2 and not retry and not self._slow_warned:
                self._slow_warned = True
                log.warning(
                    "lease_keepalive_slow", took_s=round(took, 3), interval_s=round(self.interval, 3),
                    leases=len(leases), hint="etcd, or this process, answers slowly for this many leases",
                )  # fmt: skip
            unanswered = EtcdError(f"no keep-alive answer within {self.interval:g} s ({len(leases)} leases)")
            lost = []
            for lease, keeper in by_lease.items():
                if keeper._stop.is_set():
                    continue
                if lease not in answers:
                    keeper.failed(errors[0] if errors else unanswered)
                elif answers[lease] > 0:
                    keeper.answered(answers[lease], math.nan)
                else:
                    lost.append(keeper)
            # leases etcd lost are granted anew and their keys re-written beside the exchanges (they are left
            # out of them meanwhile): one after the other, hundreds of them would hold the next exchange back
            # until more expired
            for keeper in lost:
                with self._lock:
                    self._renewing.add(id(keeper))
                try:
                    self._pool.submit(self._recreate, keeper)
                except RuntimeError:  # the pool was shut down: stopping
                    return
            retry = any(k.retrying for k in keepers)

    def _recreate(self, keeper: LeaseKeeper) -> None:
        try:
            keeper.answered(0, math.nan)
        finally:
            with self._lock:
                self._renewing.discard(id(keeper))
