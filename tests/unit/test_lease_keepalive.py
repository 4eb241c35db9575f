"""A keep-alive's answer decides whether a lease is gone: etcd's TTL 0 says so, a stream closed without an
answer (a connection torn down while a cut heals) does not, and the lease keeper counts only the first as a
loss (a loss fences the node's workers, :mod:`elastic_train.rendezvous.fence`). The same holds for many
leases refreshed over shared streams (:class:`KeepAliveBatch`)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from elastic_train.etcd.client import Etcd
from elastic_train.etcd.errors import EtcdError
from elastic_train.rendezvous.view import BATCH_STREAM_LEASES, KeepAliveBatch, LeaseKeeper


class Granting(Etcd):
    """Grants lease ids 100, 101, ... without etcd."""

    granted = 0

    def lease_grant(self, ttl: int) -> int:
        self.granted += 1
        return 99 + self.granted


def client(answers: list[list[int]], drained: threading.Event | None = None) -> Granting:
    """An Etcd over a fake lease stub whose streams answer with the next list of TTLs (empty: no answer);
    ``drained`` is set when the last list is taken."""

    def keepalive(requests: Any, timeout: float, **_: Any) -> Any:
        list(requests)
        if not answers:
            time.sleep(timeout)
            return iter([SimpleNamespace(TTL=2)])
        ttls = answers.pop(0)
        if not answers and drained is not None:
            drained.set()
        return iter([SimpleNamespace(TTL=t) for t in ttls])

    raw: Any = SimpleNamespace(
        leasestub=SimpleNamespace(LeaseKeepAlive=keepalive),
        timeout=1.0,
        endpoints=["127.0.0.1:2379"],
        _current_endpoint_label="127.0.0.1:2379",
        call_credentials=None,
        metadata=None,
    )
    return Granting(raw, where="127.0.0.1:2379", user=None, password=None)


def test_an_answer_gives_the_ttl_and_a_stream_without_one_is_an_error() -> None:
    etcd = client([[2], [0], []])
    assert etcd.lease_keepalive(7) == 2
    assert etcd.lease_keepalive(7) == 0  # etcd's answer for a lease it does not know
    with pytest.raises(EtcdError, match="without an answer"):
        etcd.lease_keepalive(7)


def test_the_keeper_counts_a_loss_only_when_etcd_says_the_lease_is_gone() -> None:
    drained = threading.Event()
    etcd = client([[], [], [2], [0], [2]], drained)  # two unanswered streams, then etcd: lease 100 is gone
    granted: list[int] = []
    keeper = LeaseKeeper(etcd, 2.0, granted.append, interval=0.05)
    keeper.start()
    try:
        assert drained.wait(5.0)  # the answer after the loss was asked for: the loss was handled
        assert keeper.losses == 1 and granted == [100, 101]
        assert keeper.lease_id == 101
    finally:
        keeper.stop(revoke=False)


class Cancellable:
    """A keep-alive stream's answers, cancellable like gRPC's."""

    def __init__(self, answers: list[Any], then: BaseException | None = None) -> None:
        self._answers, self._then = iter(answers), then

    def __iter__(self) -> Cancellable:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._answers)
        except StopIteration:
            if self._then is not None:
                raise self._then from None
            raise

    def cancel(self) -> None:
        pass


def many_client(ttls: dict[int, int], cut: BaseException | None = None) -> Granting:
    """An Etcd whose keep-alive streams answer the leases in ``ttls`` (others: no answer), then end, or fail
    with ``cut``; each stream's requested lease ids are recorded in ``asked``."""
    asked: list[list[int]] = []

    def keepalive(requests: Any, timeout: float, **_: Any) -> Any:
        ids = [r.ID for r in requests]
        asked.append(ids)
        return Cancellable([SimpleNamespace(ID=i, TTL=ttls[i]) for i in ids if i in ttls], cut)

    raw: Any = SimpleNamespace(
        leasestub=SimpleNamespace(LeaseKeepAlive=keepalive),
        timeout=1.0,
        endpoints=["127.0.0.1:2379"],
        _current_endpoint_label="127.0.0.1:2379",
        call_credentials=None,
        metadata=None,
    )
    etcd = Granting(raw, where="127.0.0.1:2379", user=None, password=None)
    etcd.asked = asked  # type: ignore[attr-defined]
    return etcd


class Deadline(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return "Deadline Exceeded"


def test_many_leases_on_one_stream_keep_what_was_answered_before_a_cut() -> None:
    etcd = many_client({1: 5, 2: 0})
    assert etcd.lease_keepalive_many([1, 2, 1]) == {1: 5, 2: 0}
    assert etcd.asked == [[1, 2]]  # type: ignore[attr-defined]
    assert etcd.counts.keepalives == 2
    cut = many_client({1: 5}, Deadline())
    assert cut.lease_keepalive_many([1, 2]) == {1: 5}  # 2 unanswered: its fate unknown
    with pytest.raises(EtcdError):
        many_client({}, Deadline()).lease_keepalive_many([1, 2])


def test_a_batch_refreshes_its_keepers_and_each_acts_on_its_own_answer() -> None:
    etcd = many_client({100: 2, 101: 0})  # keeper b's lease is gone; c's is never answered
    granted: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    batch = KeepAliveBatch(etcd, 0.05)
    keepers = {}
    for name in granted:
        keepers[name] = LeaseKeeper(etcd, 2.0, granted[name].append, interval=0.05)
        keepers[name].batch = batch
        keepers[name].start()
    assert {k.lease_id for k in keepers.values()} == {100, 101, 102}
    try:
        deadline = time.monotonic() + 5.0
        while keepers["b"].losses == 0 or not keepers["c"].retrying:
            assert time.monotonic() < deadline, "no exchange within 5 s"
            time.sleep(0.01)
    finally:
        batch.stop()
    assert keepers["a"].losses == 0 and not keepers["a"].retrying
    assert keepers["b"].losses >= 1 and granted["b"][:2] == [101, 103]  # granted anew, keys re-written
    assert keepers["c"].losses == 0  # no answer is not a loss
    assert all(len(ids) <= BATCH_STREAM_LEASES for ids in etcd.asked)  # type: ignore[attr-defined]
