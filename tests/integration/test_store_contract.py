"""The c10d Store contract, written from torch's documented semantics, on every store our handlers hand out.

One mixin, :class:`StoreContract`, runs against:

- the ``etcd3-dynamic`` store as torch's DynamicRendezvousHandler hands it to the agent (a ``PrefixStore``
  over :class:`Etcd3Store`, from a real ``next_rendezvous``),
- :class:`Etcd3Store` used directly,
- the fast ``etcd3`` handler's store (a ``PrefixStore`` over the round's rank-0 TCPStore, from a real
  ``next_rendezvous``),

so the two handlers agree wherever their semantics overlap. The contract is torch's: blocking reads wait up to
the store timeout and raise ``DistStoreError`` (a ``RuntimeError`` whose message says "timeout"), the timeout
is set with ``set_timeout`` (also through ``PrefixStore``, as ``torch.distributed.elastic.utils.store`` does),
``compare_set``/``add``/``append``/``multi_*``/``num_keys``/``delete_key``/``clone`` behave as TCPStore's.
:class:`EtcdStoreOnly` adds what only the etcd stores promise; :class:`TestEtcd3Store` the queues and
``list_keys`` (torch's ``PrefixStore`` does not forward those to a store written in Python).
"""

from __future__ import annotations

import gc
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed import DistStoreError
from torch.distributed.elastic.rendezvous.api import RendezvousParameters
from torch.distributed.elastic.utils import store as store_util

from elastic_train.etcd.client import Etcd, connect
from elastic_train.etcd.server import EmbeddedEtcd
from elastic_train.rendezvous.backend import Etcd3Store
from elastic_train.rendezvous.registry import create_etcd3_dynamic_handler, create_etcd3_handler

#: Long enough that a wait which ignores a shorter timeout is caught; short enough to bound a broken test.
LONG = timedelta(seconds=30)
#: How late a timed-out wait may return on this shared, loaded machine.
SLACK = 4.0


@pytest.fixture(scope="module")
def etcd_endpoint() -> Iterator[str]:
    """One etcd for the module; every test works under its own run id or prefix."""
    with EmbeddedEtcd() as server:
        yield server.endpoint


def _run_id() -> str:
    return "sc-" + uuid.uuid4().hex[:12]


def _elapsed(fn: Any, *args: Any) -> tuple[float, BaseException | None]:
    start = time.monotonic()
    try:
        fn(*args)
    except BaseException as exc:  # the caller asserts on the type
        return time.monotonic() - start, exc
    return time.monotonic() - start, None


class StoreContract:
    """Subclasses provide a ``store`` fixture: an empty store with its timeout set to :data:`LONG`."""

    # -- set / get ----------------------------------------------------------------------------------------

    def test_set_get_str_bytes_empty_and_binary(self, store: dist.Store) -> None:
        store.set("s", "text")
        store.set("b", b"\x00\xff\x80binary")
        store.set("e", "")
        assert store.get("s") == b"text"
        assert store.get("b") == b"\x00\xff\x80binary"
        assert store.get("e") == b""
        store.set("s", "again")
        assert store.get("s") == b"again"

    def test_get_waits_for_a_key_set_later(self, store: dist.Store) -> None:
        threading.Timer(0.3, store.clone().set, ("late", "here")).start()
        took, exc = _elapsed(store.get, "late")
        assert exc is None and store.get("late") == b"here"
        assert 0.2 < took < LONG.total_seconds()

    # -- timeouts -----------------------------------------------------------------------------------------

    def test_wait_with_timeout_raises_dist_store_error(self, store: dist.Store) -> None:
        # torch's StoreTestBase._test_simple_wait, with the elapsed time bounded as well.
        took, exc = _elapsed(store.wait, ["bad_key"], timedelta(seconds=0.25))
        assert isinstance(exc, DistStoreError) and isinstance(exc, RuntimeError), repr(exc)
        assert "timeout" in str(exc).lower()
        assert 0.2 <= took < 0.25 + SLACK
        store.add("good_key", 1)
        store.wait(["good_key"])
        store.wait(["good_key"], timedelta(seconds=0.25))

    def test_set_timeout_bounds_get_wait_and_multi_get(self, store: dist.Store) -> None:
        store.set_timeout(timedelta(seconds=0.3))
        assert store.timeout == timedelta(seconds=0.3)
        for op, arg in ((store.get, "missing"), (store.wait, ["missing"]), (store.multi_get, ["missing"])):
            took, exc = _elapsed(op, arg)
            assert isinstance(exc, DistStoreError), (op, repr(exc))
            assert 0.25 <= took < 0.3 + SLACK, (op, took)

    def test_store_timeout_context_sets_and_restores(self, store: dist.Store) -> None:
        with store_util.store_timeout(store, 0.4):
            assert store.timeout == timedelta(seconds=0.4)
            took, exc = _elapsed(store.get, "missing")
            assert isinstance(exc, DistStoreError) and took < 0.4 + SLACK
        assert store.timeout == LONG

    def test_barrier_timeout_names_the_missing_rank(self, store: dist.Store) -> None:
        # The agent's exit barrier: torch catches DistStoreError to trace which ranks never arrived.
        took, exc = _elapsed(
            lambda: store_util.barrier(store, 2, "exit", barrier_timeout=0.5, rank=0, trace_timeout=0.2)
        )
        assert isinstance(exc, DistStoreError), repr(exc)
        assert "missing_ranks=[1]" in str(exc)
        assert took < 0.7 + SLACK

    def test_barrier_and_synchronize_across_clones(self, store: dist.Store) -> None:
        def member(rank: int) -> list[bytes]:
            mine = store.clone()
            data = store_util.synchronize(mine, f"r{rank}".encode(), rank, 2, "sync/", timeout=20)
            store_util.barrier(mine, 2, "done", barrier_timeout=20)
            return data

        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(member, (0, 1)))
        assert results == [[b"r0", b"r1"]] * 2

    # -- counters and compare-and-set ------------------------------------------------------------------

    def test_add_starts_at_zero_and_returns_the_new_value(self, store: dist.Store) -> None:
        assert store.add("n", 0) == 0
        assert store.add("n", 5) == 5
        assert store.add("n", -7) == -2
        assert store.get("n") == b"-2"
        store.set("m", "40")
        assert store.add("m", 2) == 42

    def test_concurrent_adds_lose_nothing(self, store: dist.Store) -> None:
        def adds(_: int) -> None:
            mine = store.clone()
            for _ in range(15):
                mine.add("counter", 1)

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(adds, range(4)))
        assert store.get("counter") == b"60"

    def test_compare_set(self, store: dist.Store) -> None:
        # torch's StoreTestBase._test_compare_set
        assert store.compare_set("cs_key0", "wrong_old_value", "new_value0") == b"wrong_old_value"
        assert not store.check(["cs_key0"])
        store.set("cs_key0", "value0")
        assert store.compare_set("cs_key0", "wrong_old_value", "new_value0") == b"value0"
        assert store.get("cs_key0") == b"value0"
        assert store.compare_set("cs_key0", "value0", "new_value0") == b"new_value0"
        assert store.get("cs_key0") == b"new_value0"
        assert store.compare_set("cs_key1", "", "new_value1") == b"new_value1"
        assert store.get("cs_key1") == b"new_value1"
        store.set("cs_empty", "")
        assert store.compare_set("cs_empty", "", "filled") == b"filled"

    def test_append(self, store: dist.Store) -> None:
        assert store.has_extended_api()
        store.set("foo", "po")
        store.append("foo", "tato")
        store.append("bar", "po")
        store.append("bar", "tato")
        assert store.get("foo") == b"potato"
        assert store.get("bar") == b"potato"

    # -- several keys ---------------------------------------------------------------------------------

    def test_multi_set_multi_get(self, store: dist.Store) -> None:
        store.multi_set(["foo", "bar"], ["po", b"tato"])
        assert store.get("foo") == b"po" and store.get("bar") == b"tato"
        assert store.multi_get(["bar", "foo", "bar"]) == [b"tato", b"po", b"tato"]

    def test_multi_get_waits_for_every_key(self, store: dist.Store) -> None:
        store.set("first", "1")
        store.set_timeout(timedelta(seconds=0.3))
        took, exc = _elapsed(store.multi_get, ["first", "second"])
        assert isinstance(exc, DistStoreError) and took < 0.3 + SLACK
        store.set_timeout(LONG)
        threading.Timer(0.3, store.clone().set, ("second", "2")).start()
        assert store.multi_get(["first", "second"]) == [b"1", b"2"]

    def test_check_never_waits(self, store: dist.Store) -> None:
        store.set("here", "1")
        took, exc = _elapsed(store.check, ["here", "absent"])
        assert exc is None and took < SLACK
        assert store.check(["here"]) and not store.check(["here", "absent"]) and store.check([])

    def test_delete_key_and_num_keys(self, store: dist.Store) -> None:
        before = store.num_keys()
        store.set("d1", "1")
        store.set("d2", "2")
        assert store.num_keys() == before + 2
        assert store.delete_key("d1") is True
        assert store.delete_key("d1") is False
        assert store.num_keys() == before + 1
        assert not store.check(["d1"]) and store.check(["d2"])

    # -- clone ----------------------------------------------------------------------------------------

    def test_clone_points_to_the_same_store(self, store: dist.Store) -> None:
        other = store.clone()
        gc.collect()  # nothing in Python holds a clone made inside a PrefixStore: it must still work
        assert isinstance(other, dist.Store)
        store.set("foo", "bar")
        assert other.get("foo") == b"bar"
        other.set("back", "1")
        assert store.get("back") == b"1"

    def test_clone_has_the_timeout_and_its_own(self, store: dist.Store) -> None:
        store.set_timeout(timedelta(seconds=11))
        other = store.clone()
        assert other.timeout == timedelta(seconds=11)
        other.set_timeout(timedelta(seconds=3))
        assert store.timeout == timedelta(seconds=11)


class EtcdStoreOnly:
    """What only the etcd stores promise."""

    def test_add_to_a_non_integer_is_a_value_error(self, store: dist.Store) -> None:
        store.set("word", "abc")
        with pytest.raises(ValueError, match="not an integer"):
            store.add("word", 1)
        assert store.get("word") == b"abc"

    def test_multi_set_beyond_one_transaction(self, store: dist.Store) -> None:
        keys = [f"k{i}" for i in range(300)]  # etcd takes at most 128 operations per transaction
        store.multi_set(keys, [str(i) for i in range(300)])
        assert store.multi_get(keys) == [str(i).encode() for i in range(300)]
        assert store.check(keys)


@pytest.fixture
def etcd(etcd_endpoint: str) -> Iterator[Etcd]:
    client = connect(etcd_endpoint)
    yield client
    client.close()


class TestDynamicHandlerStore(StoreContract, EtcdStoreOnly):
    """etcd3-dynamic: the store exactly as torch's DynamicRendezvousHandler hands it to the agent."""

    @pytest.fixture
    def store(self, etcd_endpoint: str) -> Iterator[dist.Store]:
        params = RendezvousParameters(
            "etcd3-dynamic", etcd_endpoint, _run_id(), 1, 1, local_addr="127.0.0.1", last_call_timeout="1"
        )
        handler = create_etcd3_dynamic_handler(params)
        info = handler.next_rendezvous()
        assert isinstance(info.store, dist.PrefixStore)
        info.store.set_timeout(LONG)
        yield info.store
        handler.shutdown()

    def test_queues_and_list_keys_do_not_pass_a_prefix_store(self, store: dist.Store) -> None:
        # torch's PrefixStore reaches a Python store through a trampoline that does not forward these: torch's
        # own NotImplementedError (torch's queue tests skip such a store).
        with pytest.raises(NotImplementedError, match="queue"):
            store.queue_push("q", "1")
        with pytest.raises(NotImplementedError, match="queue"):
            store.queue_len("q")
        with pytest.raises(NotImplementedError, match="listKeys"):
            store.list_keys()

    def test_default_timeout_is_c10d_read_timeout(self, etcd_endpoint: str) -> None:
        params = RendezvousParameters("etcd3-dynamic", etcd_endpoint, _run_id(), 1, 1, local_addr="127.0.0.1")
        handler = create_etcd3_dynamic_handler(params)
        try:
            assert handler.next_rendezvous().store.timeout == timedelta(seconds=60)
        finally:
            handler.shutdown()


class TestEtcd3Store(StoreContract, EtcdStoreOnly):
    """Etcd3Store used directly (no PrefixStore)."""

    @pytest.fixture
    def store(self, etcd: Etcd) -> Iterator[dist.Store]:
        yield Etcd3Store(etcd, f"/elastic_train/{_run_id()}/store/", LONG)

    def test_num_keys_counts_its_prefix_only(self, etcd: Etcd, store: Etcd3Store) -> None:
        etcd.put(store.prefix.rstrip("/") + "-sibling/x", b"1")
        assert store.num_keys() == 0
        store.set("a/b", "1")
        assert store.num_keys() == 1
        assert etcd.get(store.prefix + "a/b") is not None

    def test_default_timeout_is_c10d_default(self, etcd: Etcd) -> None:
        assert Etcd3Store(etcd, "/elastic_train/t/").timeout == timedelta(seconds=300)

    def test_list_keys_lists_its_keys_only(self, etcd: Etcd, store: Etcd3Store) -> None:
        etcd.put(store.prefix.rstrip("/") + "-sibling/x", b"1")
        store.set("foo", "bar")
        store.set("a/b", "c")
        store.queue_push("q", "1")
        assert sorted(store.list_keys()) == ["a/b", "foo"]
        assert store.num_keys() == 2

    def test_queue_is_first_in_first_out_and_check_and_wait_see_it(self, store: Etcd3Store) -> None:
        assert not store.check(["q"]) and store.queue_len("q") == 0
        store.queue_push("q", "1")
        store.queue_push("q", b"\x00\xff")
        assert store.check(["q"]) and store.queue_len("q") == 2
        store.wait(["q"], timedelta(seconds=1))
        assert store.queue_pop("q") == b"1"
        assert store.queue_pop("q") == b"\x00\xff"
        assert not store.check(["q"]) and store.queue_len("q") == 0
        with pytest.raises(DistStoreError, match="timeout"):
            store.wait(["q"], timedelta(seconds=0.2))

    def test_queues_are_apart_from_keys_and_from_each_other(self, store: Etcd3Store) -> None:
        store.set("q", "plain")
        store.queue_push("q/1", "x")  # a queue whose name extends another's is another queue
        assert store.queue_len("q") == 0 and store.queue_len("q/1") == 1
        with pytest.raises(dist.QueueEmptyError, match="empty"):
            store.queue_pop("q", block=False)
        assert store.get("q") == b"plain"
        store.queue_push("q", "item")
        assert store.get("q") == b"plain" and store.queue_pop("q", block=False) == b"item"

    def test_queue_pop_waits_for_a_push_and_times_out_as_a_read(self, store: Etcd3Store) -> None:
        other = store.clone()
        timer = threading.Timer(0.3, lambda: other.queue_push("late", "v"))
        timer.start()
        try:
            assert store.queue_pop("late") == b"v"
        finally:
            timer.cancel()
        store.set_timeout(timedelta(seconds=0.2))
        waited, err = _elapsed(store.queue_pop, "never")
        assert isinstance(err, DistStoreError) and "timeout" in str(err)
        assert 0.2 <= waited < 0.2 + SLACK

    def test_concurrent_pops_take_each_item_once(self, store: Etcd3Store) -> None:
        for i in range(60):
            store.queue_push("work", str(i))

        def drain(_: int) -> list[int]:
            mine, taken = store.clone(), []
            while True:
                try:
                    taken.append(int(mine.queue_pop("work", block=False)))
                except dist.QueueEmptyError:
                    return taken

        with ThreadPoolExecutor(4) as pool:
            taken = [i for part in pool.map(drain, range(4)) for i in part]
        assert sorted(taken) == list(range(60))


class TestEtcd3HandlerStore(StoreContract):
    """The fast etcd3 handler's store (a PrefixStore over the round's rank-0 TCPStore)."""

    @pytest.fixture
    def store(self, etcd_endpoint: str) -> Iterator[dist.Store]:
        params = RendezvousParameters(
            "etcd3", etcd_endpoint, _run_id(), 1, 1, local_addr="127.0.0.1", settle="0", lease_ttl="2"
        )
        handler = create_etcd3_handler(params)
        info = handler.next_rendezvous()
        info.store.set_timeout(LONG)
        yield info.store
        handler.shutdown()

    def test_read_timeout_sets_the_store_timeout(self, etcd_endpoint: str) -> None:
        params = RendezvousParameters(
            "etcd3", etcd_endpoint, _run_id(), 1, 1, local_addr="127.0.0.1", settle="0", read_timeout="7"
        )
        handler = create_etcd3_handler(params)
        try:
            assert handler.next_rendezvous().store.timeout == timedelta(seconds=7)
        finally:
            handler.shutdown()
