"""The agent's hot path against a fake run view and a real TCPStore: the rank exchange of a round formed
in-process waits for its members without deadlock, abandons the round at once when a member is gone, and
after ``give_up`` nothing is published while a round joined meanwhile goes to torchrun's path."""

from __future__ import annotations

import json
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from elastic_train.node import AgentChannel, WorkerChannel
from elastic_train.rendezvous import hot as hot_mod
from elastic_train.rendezvous.hot import HotPath, RoundAbandoned
from elastic_train.rendezvous.protocol import RoundRecord, RoundResult
from elastic_train.torchcompat import TorchrunAgent


class FakeView:
    """The keys of a run as a participant's watch holds them (relative keys)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.keys: dict[str, bytes] = {}

    def get(self, key: str) -> Any:
        value = self.keys.get(key)
        return None if value is None else SimpleNamespace(value=value)

    def under(self, sub: str) -> dict[str, Any]:
        return {k[len(sub) :]: SimpleNamespace(value=v) for k, v in self.keys.items() if k.startswith(sub)}


class FakeParticipant:
    def __init__(self, node_id: str, members: list[str], view: FakeView) -> None:
        self.node_id = node_id
        self.members = members
        self.view = view
        self.joined = threading.Event()
        self.release = threading.Event()
        self.result: RoundResult | None = None

    def lost_members(self) -> set[str]:
        return {m for m in self.members if "nodes/" + m not in self.view.keys}

    def num_waiting(self) -> int:
        return 0

    def advertise_inproc(self, on: bool) -> None:
        self.inproc = on

    def join(self) -> RoundResult:
        self.joined.set()
        assert self.release.wait(10)
        assert self.result is not None
        return self.result


def refused_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def round_result(rank: int, members: list[str], ports: dict[str, int], round_: int = 2) -> RoundResult:
    nodes = {m: {"addr": "127.0.0.1", "store_port": ports[m]} for m in members}
    return RoundResult(round_, rank, len(members), members, nodes)


@pytest.fixture
def port() -> Iterator[int]:
    """A loopback port that accepts connections (an agent's store that is alive)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield int(s.getsockname()[1])


@pytest.fixture
def view() -> FakeView:
    return FakeView()


@pytest.fixture
def store() -> Iterator[dist.Store]:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield dist.PrefixStore("elastic_train/round/2/", server)


def hot_path(participant: FakeParticipant, monkeypatch: pytest.MonkeyPatch) -> HotPath:
    channel = AgentChannel(tempfile.mkdtemp(prefix="hot-path-"))
    hp = HotPath(lambda: participant, lambda r: (None, None), threading.Lock(), channel)  # type: ignore[arg-type,return-value]
    hp._agent = TorchrunAgent(None, SimpleNamespace(spec=SimpleNamespace(role="default", local_world_size=1)))
    hp.round = 1
    return hp


def worker(hp: HotPath, local_rank: int = 0) -> WorkerChannel:
    """A local worker's side of the hot path's channel."""
    return WorkerChannel(hp.channel.directory, local_rank)


def live(view: FakeView, *nodes: str) -> None:
    for n in nodes:
        view.keys["nodes/" + n] = b"{}"


def test_the_members_of_a_round_exchange_without_waiting_on_each_other(
    view, store, port, monkeypatch
) -> None:
    members = ["a", "b"]
    live(view, *members)
    ports = {m: port for m in members}
    paths = [hot_path(FakeParticipant(m, members, view), monkeypatch) for m in members]
    errors: list[BaseException] = []

    def exchange(i: int) -> None:
        try:
            paths[i]._await_members(round_result(i, members, ports), store)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=exchange, args=(i,)) for i in range(2)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(hot_mod.ASSIGN_TIMEOUT + 5)
    assert not errors and time.monotonic() - started < 2.0
    for p in paths:
        p.close()


@pytest.mark.parametrize("how", ["agent_gone", "lease_gone", "asks_newer_round"])
def test_a_member_gone_before_the_exchange_abandons_the_round_at_once(
    how, view, store, port, monkeypatch
) -> None:
    members = ["a", "b"]
    live(view, *members)
    ports = {"a": port, "b": port}
    if how == "agent_gone":
        ports["b"] = refused_port()
    elif how == "lease_gone":
        del view.keys["nodes/b"]
    else:
        view.keys["join/b"] = json.dumps({"target": 3, "reason": "failure"}).encode()
    hp = hot_path(FakeParticipant("a", members, view), monkeypatch)
    started = time.monotonic()
    with pytest.raises(RoundAbandoned, match="member b"):
        hp._await_members(round_result(0, members, ports), store)
    assert time.monotonic() - started < 1.0
    hp.close()


def test_after_give_up_a_round_joined_meanwhile_is_handed_to_torchruns_path(view, monkeypatch) -> None:
    members = ["a", "b"]
    live(view, *members)
    participant = FakeParticipant("a", members, view)
    participant.result = round_result(0, members, {"a": 1, "b": 1})
    hp = hot_path(participant, monkeypatch)
    bootstrapped: list[int] = []

    def bootstrap(result: RoundResult) -> tuple[Any, Any]:
        bootstrapped.append(result.round)
        return None, None

    hp._bootstrap = bootstrap
    reform = threading.Thread(target=hp._reform, args=("Connection reset by peer",))
    reform.start()
    assert participant.joined.wait(5)
    hp.give_up("this node was fenced (cut_off)")  # the fence fires while the join waits for etcd
    view.keys["round"] = RoundRecord(2, members, {}, False).encode()
    participant.release.set()
    reform.join(5)
    assert not reform.is_alive()
    assert hp.channel.assignment() is None and bootstrapped == []  # nothing published, no rank exchange
    assert hp.take_handoff() == participant.result
    assert hp.take_handoff() is None  # once
    hp.close()


def test_a_handed_over_round_that_is_no_longer_the_newest_is_joined_anew(view, monkeypatch) -> None:
    members = ["a", "b"]
    live(view, *members)
    participant = FakeParticipant("a", members, view)
    hp = hot_path(participant, monkeypatch)
    hp._handoff = round_result(0, members, {"a": 1, "b": 1})
    view.keys["round"] = RoundRecord(3, ["b"], {}, True).encode()
    assert hp.take_handoff() is None
    hp.close()


def test_a_member_that_leaves_the_forming_round_shortens_the_step_grace(view, monkeypatch) -> None:
    members = ["a", "b", "c"]
    live(view, *members)
    participant: Any = FakeParticipant("a", members, view)
    hp = hot_path(participant, monkeypatch)
    hp.round = 2
    worker(hp).register(1)  # the worker forms round 2's group: registered for round 1 only
    assert hp._no_boundary_coming(participant) is None
    view.keys["join/c"] = json.dumps({"target": 3, "reason": "failure"}).encode()
    assert "['c'] asked for a newer round" in str(hp._no_boundary_coming(participant))
    worker(hp).register(2)  # formed: the workers stop at their next step
    assert hp._no_boundary_coming(participant) is None
    hp.close()


def test_a_member_that_left_a_formed_round_shortens_the_grace_once_the_workers_are_blocked(
    view, monkeypatch
) -> None:
    """Formed with the member's workers, which are gone since (its node was fenced just after the round
    closed): the workers wait on them and finish no step. A member asking while the workers step is one that
    reached the step boundary first, and the grace stays."""
    members = ["a", "b", "c"]
    live(view, *members)
    participant: Any = FakeParticipant("a", members, view)
    participant.num_waiting = lambda: 1
    hp = hot_path(participant, monkeypatch)
    hp.round, hp._nproc = 2, 1
    worker(hp).register(2)
    blocked = [False]
    hp.blocked = lambda: blocked[0]
    view.keys["join/c"] = json.dumps({"target": 3, "reason": "rejoin"}).encode()
    hp._tick()  # announced with the step grace: c is alive and asks
    assert hp._announced is not None and hp._announced[1] == hot_mod.STEP_GRACE
    hp._tick()
    assert hp._announced[1] == hot_mod.STEP_GRACE and hp.fallback is None
    blocked[0] = True
    hp._tick()  # shortened ...
    assert hp._announced[1] == hot_mod.LOST_GRACE and hp.fallback is None
    hp._announced = (hp._announced[0] - hot_mod.LOST_GRACE - 0.01, hot_mod.LOST_GRACE)
    hp._tick()  # ... and past it, the restart path
    assert hp.fallback is not None and "step boundary" in hp.fallback
    hp.close()


def test_workers_blocked_after_a_member_lost_its_lease_fall_back_at_once(view, monkeypatch) -> None:
    members = ["a", "b", "c"]
    live(view, "a", "b")  # c's lease expired (a stopped node)
    participant: Any = FakeParticipant("a", members, view)
    participant.num_waiting = lambda: 1
    hp = hot_path(participant, monkeypatch)
    hp._nproc = 1
    worker(hp).register(1)
    blocked = [False]
    hp.blocked = lambda: blocked[0]
    hp._tick()  # announces, with the lost-member grace
    assert worker(hp).change_after(1) and hp.fallback is None
    hp._tick()  # the workers still step: they may reach a boundary within the grace
    assert hp.fallback is None
    blocked[0] = True  # no step for a stall's length: they wait in a collective with the stopped peer
    hp._tick()
    assert hp.fallback is not None and "blocked in a collective" in hp.fallback
    assert hp.channel.fallback() == hp.fallback
    assert participant.inproc is False  # withdrawn at once: a peer restarting now starts as usual
    hp.close()


def test_gloo_workers_blocked_with_a_stopped_peer_are_asked_to_cut_their_links_first(
    view, monkeypatch
) -> None:
    """Workers that cut their group's connections when asked (gloo) get the cut, not the restart path; only
    when they have not asked for the next round a grace after it does the node restart them."""
    members = ["a", "b", "c"]
    live(view, "a", "b")  # c stopped: its lease expired
    participant: Any = FakeParticipant("a", members, view)
    participant.num_waiting = lambda: 1
    hp = hot_path(participant, monkeypatch)
    hp._nproc = 1
    worker(hp).register(1, cut=True)
    hp.blocked = lambda: True
    assert not worker(hp).cut_asked(1)
    hp._tick()  # announced
    hp._tick()  # blocked with a lost member: cut
    assert worker(hp).cut_asked(1) and not worker(hp).cut_asked(2)
    assert hp.fallback is None
    hp._tick()
    assert hp.fallback is None  # the workers have the grace to fail and ask
    assert hp._cut_at is not None
    hp._cut_at -= hot_mod.CUT_GRACE + 0.01
    hp._tick()
    assert hp.fallback is not None and "after the cut" in hp.fallback
    hp.close()


def test_a_cut_is_asked_only_when_every_registered_worker_can_cut(view, monkeypatch) -> None:
    participant: Any = FakeParticipant("a", ["a"], view)
    hp = hot_path(participant, monkeypatch)
    assert not hp.channel.cuttable()  # nobody registered
    worker(hp).register(1, cut=True)
    assert hp.channel.cuttable()
    worker(hp, 1).register(1)  # e.g. an NCCL worker
    assert not hp.channel.cuttable()
    hp.close()
