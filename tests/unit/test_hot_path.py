"""The hot path's executor: what it observes of its node (workers through the node's directory, the run
through a fake participant, the fence), what each action leaves in the directory, and the hand-over of a round
joined after it gave up. The rules themselves are tables in test_hotdecide.py."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from elastic_train.node import AgentChannel, Ready, WorkerChannel
from elastic_train.rendezvous.errors import RendezvousClosed
from elastic_train.rendezvous.hot import LOST_GRACE, Act, HotPath, StandbyState, decide
from elastic_train.rendezvous.protocol import RoundResult
from elastic_train.rendezvous.standby import Pending


class FakeParticipant:
    """This node in a run of ``members`` whose ``live`` nodes hold leases; ``asking`` maps a node to the round
    its join key asks for."""

    def __init__(self, members: list[str], node_id: str = "a") -> None:
        self.node_id, self.members = node_id, members
        self.live = set(members)
        self.asking: dict[str, int] = {}
        self.latest = 1
        self.inproc: bool | None = None
        self.joined = threading.Event()
        self.release = threading.Event()
        self.result: RoundResult | None = None
        self.closed: BaseException | None = None
        self.lease = SimpleNamespace(losses=0)  # how often this node's lease was found gone
        self.lost_during_join: str | None = None  # "before" or "after" the round closed
        self.losses_at_round = 0

    def lost_members(self) -> set[str]:
        return {m for m in self.members if m not in self.live}

    def asking_beyond(self, round_: int) -> set[str]:
        return {n for n, target in self.asking.items() if target > round_ and n in self.live}

    def num_waiting(self) -> int:
        return len(self.lost_members()) + len(self.asking_beyond(self.latest))

    def latest_round(self) -> int:
        return self.latest

    def advertise_inproc(self, on: bool) -> None:
        self.inproc = on

    def check_open(self) -> None:
        if self.closed is not None:
            raise self.closed

    def join(self) -> RoundResult:
        self.joined.set()
        assert self.release.wait(10)
        if self.lost_during_join == "before":  # the keys re-written on the new lease, then the round closed
            self.lease.losses += 1
        self.losses_at_round = self.lease.losses
        if self.lost_during_join == "after":
            self.lease.losses += 1
        assert self.result is not None
        return self.result


class FakeFence:
    blocked = False

    def __init__(self) -> None:
        self.joined_with: list[int] = []

    def workers_blocked(self) -> bool:
        return self.blocked

    def joined(self, losses: int) -> None:
        self.joined_with.append(losses)


class FakeStandby:
    pending_start: Pending | None = None
    started_at = 0.0

    def pending(self) -> Pending | None:
        return self.pending_start


def hot_path(tmp_path: Path, participant: FakeParticipant, *, nproc: int = 1, round_: int = 1) -> HotPath:
    """A hot path engaged in round ``round_`` for ``nproc`` local workers (as ``started()`` leaves it)."""
    standby: Any = FakeStandby()
    stores: Any = None  # a test that joins a round gives its own
    hp = HotPath(participant, AgentChannel(str(tmp_path)), FakeFence(), standby, stores,  # type: ignore[arg-type]
                 threading.Lock())  # fmt: skip
    hp.round, hp._nproc = round_, nproc
    return hp


def worker(hp: HotPath, local_rank: int = 0) -> WorkerChannel:
    """A local worker's side of the hot path's channel."""
    return WorkerChannel(hp.channel.directory, local_rank)


def tick(hp: HotPath) -> Act:
    """One look and the action it leads to, as the executor's thread does it."""
    observation = hp.observe()
    action = decide(observation)
    hp._act(action, observation)
    return action.act


def test_the_observation_is_what_the_workers_the_run_and_the_fence_say(tmp_path: Path) -> None:
    participant = FakeParticipant(["a", "b", "c"])
    hp = hot_path(tmp_path, participant, nproc=2, round_=2)
    assert not hp.observe().engaged  # no worker registered: torchrun's path
    worker(hp, 0).register(2, cut=True)
    worker(hp, 1).register(1)  # still forming round 2's group
    o = hp.observe()
    assert o.engaged and o.waiting == 0 and o.asked is None
    participant.live.discard("c")
    participant.asking["b"] = 3
    hp.fence.blocked = True  # type: ignore[attr-defined]
    o = hp.observe()
    assert (o.waiting, o.lost, o.left, o.forming, o.blocked, o.cuttable) == (
        2,
        ("c",),
        ("b",),
        True,
        True,
        False,
    )
    worker(hp, 1).request(2, "Connection reset by peer")
    o = hp.observe()
    assert o.asked == "Connection reset by peer" and o.dead == ()  # both registered workers are this process
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / "ready-1.json").write_text(json.dumps(Ready(2, gone.pid).encode()))
    assert hp.observe().dead == (1,)
    hp.close()


def test_workers_whose_training_ended_are_not_re_formed_whatever_the_membership_does(tmp_path: Path) -> None:
    """The final checkpoint committed and the workers exit: a lease lost now (this node's, as it was cut
    off) announces nothing, cuts nothing and gives nothing up, so the workers exit into torchrun's exit
    barrier with the other nodes' instead of being stopped for a round that never comes."""
    participant = FakeParticipant(["a", "b"])
    hp = hot_path(tmp_path, participant, nproc=2, round_=2)
    for r in range(2):
        worker(hp, r).register(2, cut=True)
    worker(hp, 0).mark_finished(40, 2, 2)
    participant.live.discard("a")  # this node's own lease expired
    hp.fence.blocked = True  # type: ignore[attr-defined]
    assert hp.observe().engaged and tick(hp) is Act.ANNOUNCE  # one worker still in the final checkpoint
    worker(hp, 1).mark_finished(40, 2, 2)
    o = hp.observe()
    assert not o.engaged and decide(o).act is Act.NOTHING
    assert hp.fallback is None
    hp.close()


def test_each_action_leaves_its_message_for_the_workers(tmp_path: Path) -> None:
    """A stopped peer: announced with the short grace, the gloo workers are asked to cut their links, and
    when they do not ask for the next round within the grace the node restarts them."""
    participant = FakeParticipant(["a", "b", "c"])
    participant.live.discard("c")
    hp = hot_path(tmp_path, participant)
    worker(hp).register(1, cut=True)
    assert tick(hp) is Act.ANNOUNCE
    assert worker(hp).change_after(1) and not worker(hp).change_after(2) and hp._grace == LOST_GRACE
    assert tick(hp) is Act.NOTHING  # the workers may still reach a boundary
    hp.fence.blocked = True  # type: ignore[attr-defined]
    assert tick(hp) is Act.CUT
    assert worker(hp).cut_asked(1) and not worker(hp).cut_asked(2)
    assert tick(hp) is Act.NOTHING  # the workers have the grace to fail and ask
    assert hp._cut_at is not None
    hp._cut_at -= 5
    assert tick(hp) is Act.GIVE_UP
    assert hp.fallback is not None and "after the cut" in hp.fallback
    assert worker(hp).fallback() == hp.fallback
    assert participant.inproc is False  # withdrawn at once: a peer restarting now starts as usual
    assert not hp.observe().engaged  # gave up: torchrun's path from here
    hp.close()


def test_standby_workers_are_observed_until_all_are_built(tmp_path: Path) -> None:
    participant = FakeParticipant(["b"])
    hp = hot_path(tmp_path, participant, nproc=2)
    assert hp.observe().standby is None  # no standby start
    hp.standby.pending_start = Pending(generation=4, needed=2)  # type: ignore[union-attr]
    worker(hp, 0).standby(1)
    assert hp.observe().standby == StandbyState(needed=2, ready=1, generation=4)
    worker(hp, 1).standby(1)
    assert decide(hp.observe()).act is Act.ADMIT
    participant.closed = RendezvousClosed("run r finished; this node has nothing left to do")
    assert hp.observe().standby == StandbyState(2, 2, finished=str(participant.closed), generation=4)
    hp.close()


def test_after_give_up_a_round_joined_meanwhile_is_handed_to_torchruns_path(tmp_path: Path) -> None:
    members = ["a", "b"]
    participant = FakeParticipant(members)
    participant.result = RoundResult(2, 0, 2, members, {})
    hp = hot_path(tmp_path, participant)
    hp._agent = object()  # type: ignore[assignment]  # under torchrun's agent (never reached here)
    bootstrapped: list[int] = []

    def bootstrap(result: RoundResult) -> tuple[Any, Any]:
        bootstrapped.append(result.round)
        return None, None

    hp.stores = SimpleNamespace(bootstrap=bootstrap)  # type: ignore[assignment]
    reform = threading.Thread(target=hp._reform, args=("Connection reset by peer",))
    reform.start()
    assert participant.joined.wait(5)
    hp.give_up("this node was fenced (cut_off)")  # the fence fires while the join waits for etcd
    participant.latest = 2
    participant.release.set()
    reform.join(5)
    assert not reform.is_alive()
    assert hp.channel.assignment() is None and bootstrapped == []  # nothing published, no rank exchange
    assert hp.take_handoff() == participant.result
    assert hp.take_handoff() is None  # once
    hp.close()


@pytest.mark.parametrize("why", ["newer", "lost"])
def test_a_handed_over_round_that_is_no_longer_current_is_joined_anew(tmp_path: Path, why: str) -> None:
    members = ["a", "b"]
    participant = FakeParticipant(members)
    hp = hot_path(tmp_path, participant)
    hp._handoff = RoundResult(2, 0, 2, members, {})
    participant.latest = 3 if why == "newer" else 2
    if why == "lost":
        participant.live.discard("b")
    assert hp.take_handoff() is None
    hp.close()


@pytest.mark.parametrize("lost", ["before", "joining", "after"])
def test_a_round_joined_in_process_tells_the_fence_which_lease_loss_it_put_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lost: str
) -> None:
    """A standby start whose lease was lost and re-created before its admission, or while its join waited
    for the round to close, joined the round with the new lease: that loss no longer fences it (it did: the
    admitted node fenced itself at once, and its peers fell back to the restart path). A loss after the
    round closed is ahead of the baseline and still fences."""
    from elastic_train.rendezvous import hot as hot_module

    members = ["a", "b"]
    participant = FakeParticipant(members)
    participant.result = RoundResult(2, 0, 2, members, {})
    participant.lease.losses = 1  # lost and re-created while the standby workers built
    participant.lost_during_join = {"joining": "before", "after": "after"}.get(lost)
    hp = hot_path(tmp_path, participant)
    hp._agent = object()  # type: ignore[assignment]
    info = SimpleNamespace(master_addr="127.0.0.1", master_port=1)
    hp.stores = SimpleNamespace(bootstrap=lambda result: (None, info))  # type: ignore[assignment]
    ranks = [SimpleNamespace(global_rank=0, world_size=2)]
    monkeypatch.setattr(hot_module, "exchange_ranks", lambda *a: ranks)
    participant.release.set()
    hp._reform("1 standby worker(s) ready")
    assert hp.round == 2 and hp.channel.assignment() is not None
    assert hp.fence.joined_with == [2 if lost == "joining" else 1]  # type: ignore[attr-defined]
    assert participant.lease.losses == (1 if lost == "before" else 2)
    hp.close()


def test_a_node_whose_workers_finished_while_torchrun_stopped_them_leaves_through_the_exit_barrier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fence fired as the workers wrote the final checkpoint, and they finished it before torchrun's
    SIGTERM reached them: torchrun asks for the next round, and the handler waits in the round's exit
    barrier (where the other agents wait for this node) and ends with status 0 instead of re-joining. Until
    every local worker finished, it goes on to the join; and a node whose workers finished reports no
    waiting node to torchrun's monitor, whatever its fence or eviction say."""
    from elastic_train.rendezvous import handler as handler_module
    from elastic_train.rendezvous.errors import RunFinished

    barriers: list[str] = []
    agent = SimpleNamespace(exit_barrier=lambda: barriers.append("exit"))
    monkeypatch.setattr(handler_module.TorchrunAgent, "find", classmethod(lambda cls: agent))
    h = object.__new__(handler_module.Etcd3RendezvousHandler)
    h._participant = object()  # type: ignore[assignment]
    h._node = AgentChannel(str(tmp_path))
    h._settings = SimpleNamespace(run_id="fin")  # type: ignore[assignment]
    h._eviction = object()  # type: ignore[assignment]  # evicted as slow: torchrun would stop the workers
    WorkerChannel(str(tmp_path), 0).mark_finished(90, 2, 4)
    h._end_if_workers_finished()  # one of two: the join goes on
    assert barriers == [] and h.num_nodes_waiting() == 1
    WorkerChannel(str(tmp_path), 1).mark_finished(90, 2, 4)
    assert h.num_nodes_waiting() == 0
    with pytest.raises(RunFinished) as exc:
        h._end_if_workers_finished()
    assert exc.value.code == 0 and "finished at step 90" in str(exc.value)
    assert barriers == ["exit"]
