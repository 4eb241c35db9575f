"""The rank exchange of a round formed in-process, against a fake run view and a real TCPStore: the members
wait for each other without deadlock, and a member that is gone abandons the round at once."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from elastic_train.rendezvous import exchange
from elastic_train.rendezvous.exchange import RoundAbandoned, await_members
from elastic_train.rendezvous.protocol import RoundResult
from elastic_train.torchcompat import TorchrunAgent, role_info_key


class FakeParticipant:
    """The members of a round as a participant's watch holds them: ``live`` leases, ``asking`` join keys."""

    def __init__(self, node_id: str, members: list[str], live: set[str], asking: dict[str, int]) -> None:
        self.node_id, self.members, self.live, self.asking = node_id, members, live, asking

    def lost_members(self) -> set[str]:
        return {m for m in self.members if m not in self.live}

    def asking_beyond(self, round_: int) -> set[str]:
        return {n for n, target in self.asking.items() if target > round_ and n in self.live}


def refused_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def port() -> Iterator[int]:
    """A loopback port that accepts connections (an agent's store that is alive)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield int(s.getsockname()[1])


@pytest.fixture
def store() -> Iterator[dist.Store]:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield dist.PrefixStore("elastic_train/round/2/", server)


def agent() -> TorchrunAgent:
    return TorchrunAgent(None, SimpleNamespace(spec=SimpleNamespace(role="default", local_world_size=1)))


def round_result(rank: int, members: list[str], ports: dict[str, int]) -> RoundResult:
    nodes = {m: {"addr": "127.0.0.1", "store_port": ports[m]} for m in members}
    return RoundResult(2, rank, len(members), members, nodes)


def pause() -> None:
    time.sleep(0.005)


def test_the_members_of_a_round_exchange_without_waiting_on_each_other(store: Any, port: int) -> None:
    members = ["a", "b"]
    errors: list[BaseException] = []

    def exchange_as(i: int) -> None:
        participant: Any = FakeParticipant(members[i], members, set(members), {})
        try:
            await_members(
                agent(), participant, round_result(i, members, {"a": port, "b": port}), store, pause
            )
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=exchange_as, args=(i,)) for i in range(2)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(exchange.ASSIGN_TIMEOUT + 5)
    assert not errors and time.monotonic() - started < 2.0


def test_a_round_awaited_twice_by_one_agent_counts_its_part_once(store: Any, port: int) -> None:
    """The hot path may hand a round it already wrote its part of to torchrun's path, which awaits it again:
    the count of parts must not reach the round's size while a member has not written."""
    members = ["a", "b", "c"]
    participant: Any = FakeParticipant("a", members, set(members), {})
    result = round_result(0, members, dict.fromkeys(members, port))
    looks = [0]

    def give_up() -> None:
        looks[0] += 1
        if looks[0] > 2:
            raise TimeoutError

    for _ in range(2):
        with pytest.raises(TimeoutError):
            await_members(agent(), participant, result, store, give_up)
        looks[0] = 0
    assert store.add("elastic_train/parts/2", 0) == 1


@pytest.mark.parametrize("how", ["agent_gone", "lease_gone", "asks_newer_round"])
def test_a_member_gone_before_the_exchange_abandons_the_round_at_once(
    how: str, store: Any, port: int
) -> None:
    members, live, asking = ["a", "b"], {"a", "b"}, {}
    ports = {"a": port, "b": port}
    if how == "agent_gone":
        ports["b"] = refused_port()
    elif how == "lease_gone":
        live.discard("b")
    else:
        asking["b"] = 3
    participant: Any = FakeParticipant("a", members, live, asking)
    started = time.monotonic()
    with pytest.raises(RoundAbandoned, match="member b"):
        await_members(agent(), participant, round_result(0, members, ports), store, pause)
    assert time.monotonic() - started < 1.0


def test_a_round_record_without_a_usable_address_is_not_a_gone_member(store: Any, port: int) -> None:
    """The node addresses of a round record come from etcd: a malformed one is probed as unknown (alive)."""
    members = ["a", "b"]
    participant: Any = FakeParticipant("a", members, set(members), {})
    result = RoundResult(2, 0, 2, members, {"a": {"addr": "127.0.0.1", "store_port": port},
                                             "b": {"addr": None, "store_port": "x"}})  # fmt: skip
    calls = [0]

    def stop_after_a_few() -> None:
        calls[0] += 1
        if calls[0] > 5:
            raise TimeoutError
        time.sleep(0.005)

    with pytest.raises(TimeoutError):
        await_members(agent(), participant, result, store, stop_after_a_few)
    assert json.loads(store.get(role_info_key(0)))["rank"] == 0  # its own part written first


def test_a_rounds_store_is_rank_0s_behind_the_rounds_own_prefix() -> None:
    from datetime import timedelta

    from elastic_train.rendezvous.exchange import RoundStores

    wait = timedelta(seconds=10)
    server_a = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=wait)
    server_b = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=wait)
    a = RoundStores(server_a, "127.0.0.1", wait, "a")
    b = RoundStores(server_b, "127.0.0.1", wait, "b")
    nodes = {
        "a": {"addr": "127.0.0.1", "store_port": server_a.port},
        "b": {"addr": "127.0.0.1", "store_port": 1},
    }
    store_a, info = a.bootstrap(RoundResult(4, 0, 2, ["a", "b"], nodes))
    store_b, _ = b.bootstrap(RoundResult(4, 1, 2, ["a", "b"], nodes))
    store_a.set("k", b"from a")
    assert store_b.get("k") == b"from a"  # both on a's store, in round 4's prefix
    assert info.master_port > 0  # a fresh bootstrap port for the workers, from rank 0
    a.bootstrap(RoundResult(5, 0, 2, ["a", "b"], nodes))
    later, _ = b.bootstrap(RoundResult(5, 1, 2, ["a", "b"], nodes))
    assert not later.check(["k"])  # nothing of round 4 is seen in round 5
    malformed = {"a": {"addr": None, "store_port": "x"}}
    with pytest.raises(RuntimeError, match="names no store"):
        b.bootstrap(RoundResult(6, 1, 2, ["a", "b"], malformed))
