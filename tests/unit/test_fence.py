"""The fencing rule (pure), and the workers' progress as the fence reads it from their beats."""

from __future__ import annotations

from pathlib import Path

from elastic_train.node import AgentChannel, Beat
from elastic_train.rendezvous.fence import FENCE_GRACE, STALL_MIN, fence_reason

TTL = 3.0


def test_a_lost_lease_fences_at_once() -> None:
    assert fence_reason(lease_lost=True, etcd_silent_s=0.0, stalled_s=0.0, ttl=TTL) == "lease_lost"


def test_etcd_silence_alone_never_fences_while_steps_complete() -> None:
    # etcd down for everyone: no world can form without this node, training goes on
    assert fence_reason(lease_lost=False, etcd_silent_s=600.0, stalled_s=0.1, ttl=TTL) is None


def test_a_stall_alone_never_fences_while_etcd_answers() -> None:
    assert fence_reason(lease_lost=False, etcd_silent_s=0.5, stalled_s=600.0, ttl=TTL) is None


def test_silent_and_stalled_past_ttl_and_grace_fences() -> None:
    limit = TTL + FENCE_GRACE
    assert fence_reason(lease_lost=False, etcd_silent_s=limit - 0.01, stalled_s=limit, ttl=TTL) is None
    assert fence_reason(lease_lost=False, etcd_silent_s=limit, stalled_s=limit - 0.01, ttl=TTL) is None
    assert fence_reason(lease_lost=False, etcd_silent_s=limit, stalled_s=limit, ttl=TTL) == "cut_off"


def test_workers_that_count_no_steps_are_only_fenced_by_a_lost_lease() -> None:
    assert fence_reason(lease_lost=False, etcd_silent_s=600.0, stalled_s=None, ttl=TTL) is None
    assert fence_reason(lease_lost=True, etcd_silent_s=0.0, stalled_s=None, ttl=TTL) == "lease_lost"


def test_once_a_step_time_is_known_a_short_stall_fences_a_silent_node() -> None:
    kw = dict(lease_lost=False, etcd_silent_s=TTL + FENCE_GRACE, ttl=TTL)
    assert fence_reason(stalled_s=STALL_MIN - 0.01, step_s=0.05, **kw) is None  # type: ignore[arg-type]
    assert fence_reason(stalled_s=STALL_MIN, step_s=0.05, **kw) == "cut_off"  # type: ignore[arg-type]
    # slow steps are not a stall: four step times
    assert fence_reason(stalled_s=3.9, step_s=1.0, **kw) is None  # type: ignore[arg-type]
    assert fence_reason(stalled_s=4.0, step_s=1.0, **kw) == "cut_off"  # type: ignore[arg-type]


def test_the_step_time_comes_from_steps_and_other_progress_only_moves_the_clock(tmp_path: Path) -> None:
    """A worker waiting on its own durable writer beats without a step: progress (no stall), not a step
    time (which would make the stall limit shorter)."""
    from elastic_train.rendezvous.fence import Fence, _Progress

    fence = Fence.__new__(Fence)
    fence.channel, fence._procs = AgentChannel(str(tmp_path)), {}
    fence._progress = _Progress({}, 0.0)
    beat = Beat(str(tmp_path))
    beat.step()
    fence._read_progress(100.0)  # the first step: its time includes start-up, no sample
    assert fence._progress.step_s is None and fence._progress.moved_at == 100.0
    beat.progress()
    fence._read_progress(100.5)  # progress, not a step
    assert fence._progress.step_s is None and fence._progress.moved_at == 100.5
    beat.step()
    beat.step()
    fence._read_progress(101.0)  # two steps in a second since the last step
    assert fence._progress.step_s == 0.5 and fence._progress.moved_at == 101.0
    beat.close()


def test_workers_blocked_needs_step_counters_and_a_stall() -> None:
    import time

    from elastic_train.rendezvous.fence import STALL_MIN, Fence, _Progress

    fence = Fence.__new__(Fence)
    fence.ttl = 2.0
    now = time.monotonic()
    fence._progress = _Progress({}, now - 100)
    assert not fence.workers_blocked()  # nothing counts steps: nothing to tell
    fence._progress = _Progress({1: 5}, now, step_s=0.1)
    assert not fence.workers_blocked()  # a step just finished
    fence._progress = _Progress({1: 5}, now - STALL_MIN - 0.1, step_s=0.1)
    assert fence.workers_blocked()  # four step times are shorter than the floor: the floor counts
    fence._progress = _Progress({1: 5}, now - STALL_MIN - 0.1, step_s=1.0)
    assert not fence.workers_blocked()  # slow steps are not a stall
    fence._progress = _Progress({1: 5}, now - 2.0)
    assert not fence.workers_blocked() and fence.ttl + 0.5 > 2.0  # no step time yet: a TTL and the grace


def test_a_lease_loss_before_an_in_process_join_no_longer_fences_one_after_it_does(tmp_path: Path) -> None:
    import time
    from types import SimpleNamespace

    from elastic_train.rendezvous.fence import Fence

    lease = SimpleNamespace(ttl=TTL, losses=0, last_ok=time.monotonic(), interval=1.0)
    participant = SimpleNamespace(lease=lease, round=3)
    fence = Fence(participant, AgentChannel(str(tmp_path)))  # type: ignore[arg-type]
    fence.arm()
    lease.losses = 1  # lost, then re-created: this node's workers were not re-formed with the new lease
    assert fence.check() == "lease_lost"

    fence = Fence(participant, AgentChannel(str(tmp_path)))  # type: ignore[arg-type]
    fence.arm()
    lease.losses = 2
    fence.joined(2)  # a round joined in-process with the re-created lease (a standby start admitted)
    assert fence.check() is None
    lease.losses = 3  # lost again after that join
    assert fence.check() == "lease_lost"


def test_the_round_holds_the_lease_whose_keys_were_written_before_it_closed() -> None:
    """Which lease loss a joined round puts behind it: the one whose re-written keys (the join among them)
    the round's record is newer than. Keys re-written after the record (the lease was lost between the
    round's close and this node seeing it) mean the round was closed with the lost lease."""
    from types import SimpleNamespace

    from elastic_train.rendezvous.protocol import Participant
    from elastic_train.rendezvous.records import RoundRecord

    p = Participant.__new__(Participant)
    p.node_id, p.lease = "a", SimpleNamespace(losses=1)
    rec = RoundRecord(round=4, members=["a", "b"], nodes={"a": {}, "b": {}})
    p._keys_written = (1, 100)  # the lease lost once; its keys re-written at revision 100
    p._adopt(rec, 120)  # the round closed after that: it holds the new lease
    assert p.losses_at_round == 1
    p._adopt(rec, 90)  # it closed before: with the lease lost since
    assert p.losses_at_round == 0
    p.lease.losses, p._keys_written = 2, (1, 100)  # lost again, keys not yet re-written
    p._adopt(rec, 120)
    assert p.losses_at_round == 1 != p.lease.losses


def test_the_publish_gate_answers_within_its_wait_when_etcd_never_answers(tmp_path: Path) -> None:
    """A partition that drops packets: etcd's answer never comes, and the lease keeper has not noticed yet.
    The gate's read is bounded by the gate's own wait, not the client's RPC timeout: the worker's next save,
    which waits for this answer, is held for ``gate_wait`` at most."""
    import time
    from types import SimpleNamespace

    from elastic_train.etcd.errors import EtcdError
    from elastic_train.node import UNKNOWN
    from elastic_train.rendezvous.fence import Fence

    asked: list[float] = []

    class SilentEtcd:
        timeout = 6.0  # the client's RPC timeout

        def get(self, key: str, timeout: float | None = None) -> None:
            wait = self.timeout if timeout is None else timeout
            asked.append(wait)
            time.sleep(wait)
            raise EtcdError("no answer from etcd in time")

    lease = SimpleNamespace(ttl=TTL, losses=0, last_ok=time.monotonic(), interval=1.0)
    node = SimpleNamespace(lease=lease, etcd=SilentEtcd(), prefix="/run/")
    fence = Fence(node, AgentChannel(str(tmp_path)), gate_wait=0.5)  # type: ignore[arg-type]
    started = time.monotonic()
    assert fence.round_state(1) == UNKNOWN
    assert time.monotonic() - started < 1.5 and asked and max(asked) <= 0.5
