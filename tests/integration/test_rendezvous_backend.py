"""Contract of the etcd3-dynamic RendezvousBackend (CAS with fencing tokens) and its Store, on real etcd."""

from __future__ import annotations

from datetime import timedelta

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousParameters, RendezvousStateError

from elastic_train.etcd.client import Etcd, connect
from elastic_train.rendezvous import create_backend
from elastic_train.rendezvous.backend import Etcd3RendezvousBackend, Etcd3Store


@pytest.fixture
def backend(any_etcd):
    etcd = Etcd(connect(any_etcd.endpoint))
    yield Etcd3RendezvousBackend(etcd, "contract"), etcd
    etcd.close()


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


def test_store_set_get_add_wait_compare_set(etcd_server):
    etcd = Etcd(connect(etcd_server.endpoint))
    store = Etcd3Store(etcd, "/elastic_train/s/store/", timeout=timedelta(seconds=2))
    store.set("k", b"v")
    assert store.get("k") == b"v"
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.check(["k"]) and not store.check(["nope"])
    store.multi_set(["a", "b"], [b"1", b"2"])
    assert store.multi_get(["a", "b"]) == [b"1", b"2"]
    assert store.compare_set("k", b"v", b"w") == b"w"
    assert store.compare_set("k", b"v", b"z") == b"w"
    with pytest.raises(LookupError, match="timed out"):
        store.wait(["never"], timedelta(seconds=0.3))
    etcd.close()


def test_create_backend_from_torchrun_params(etcd_server):
    params = RendezvousParameters("etcd3-dynamic", etcd_server.endpoint, "dyn", 1, 2, last_call_timeout="1")
    backend, store = create_backend(params)
    assert backend.name == "etcd3-dynamic"
    store.set("x", b"1")
    assert store.get("x") == b"1"
