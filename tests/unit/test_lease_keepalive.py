"""A keep-alive's answer decides whether a lease is gone: etcd's TTL 0 says so, a stream closed without an
answer (a connection torn down while a cut heals) does not, and the lease keeper counts only the first as a
loss (a loss fences the node's workers, :mod:`elastic_train.rendezvous.fence`)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from elastic_train.etcd.client import Etcd
from elastic_train.etcd.errors import EtcdError
from elastic_train.rendezvous.view import LeaseKeeper


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
