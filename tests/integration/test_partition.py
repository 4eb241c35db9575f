"""A node partitioned from etcd: its fence, its publish gate and the failure budget, on a real etcd.

In-process participants; the victim reaches etcd through a loopback proxy that goes silent (holds every byte,
no reset), the others directly. Its workers are played by a thread counting steps through the same step
beat and publish gate a worker uses (:mod:`elastic_train.node`). Real torchrun agents and workers under a
partition are in ``test_partition_torchrun.py`` and the chaos suite (``partition-etcd``, ``partition-full``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from elastic_train.etcd.client import connect
from elastic_train.node import CURRENT, STALE, UNKNOWN, AgentChannel, Beat, Link
from elastic_train.rendezvous.fence import FENCE_GRACE, STALL_MIN, Fence
from elastic_train.rendezvous.protocol import Participant, ProtocolSettings
from tests.netproxy import LatencyProxy

pytestmark = pytest.mark.timeout(180)

TTL = 2.0


def settings() -> ProtocolSettings:
    return ProtocolSettings(
        run_id="part", min_nodes=2, max_nodes=3, lease_ttl=TTL, settle=0.3, join_timeout=90
    )


class Steps:
    """A worker's step counter, beating every 50 ms while ``running`` is set."""

    def __init__(self, directory: str, round: int) -> None:
        self.link = Link(directory, round)
        self.beat = Beat(directory)
        self.count = 0
        self.running = threading.Event()
        self.running.set()
        self.stop = threading.Event()
        self.last = time.monotonic()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.05):
            if self.running.is_set():
                self.beat.step()
                self.count += 1
                self.last = time.monotonic()


@pytest.fixture
def proxy(etcd_server) -> Iterator[LatencyProxy]:
    host, _, port = etcd_server.endpoint.rpartition(":")
    with LatencyProxy(host, int(port)) as p:
        yield p


def join_all(ps: list[Participant]) -> list:
    with ThreadPoolExecutor(len(ps)) as pool:
        return list(pool.map(lambda p: p.join(), ps))


def until(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_cut_off_node_fences_itself_only_when_its_workers_stall_and_a_healed_cut_costs_one_failure(
    etcd_server, proxy, tmp_path: Path
) -> None:
    others = [
        Participant(connect(etcd_server.endpoint), settings(), addr="127.0.0.1", node_id=f"n{i}")
        for i in (0, 1)
    ]
    victim = Participant(connect(proxy.endpoint, timeout=1.0), settings(), addr="127.0.0.1", node_id="n2")
    nodes = [*others, victim]
    try:
        results = join_all(nodes)
        assert {r.round for r in results} == {1} and {r.world_size for r in results} == {3}
        fence = Fence(victim, AgentChannel(str(tmp_path)), gate_wait=1.0)
        fence.start_gate()
        fence.arm()
        steps = Steps(str(tmp_path), 1)
        until(lambda: fence.check() is None and steps.count > 3, 5, "steps counted")
        assert steps.link.may_publish() == CURRENT

        proxy.silence()  # etcd traffic of the victim is dropped from now on; its workers go on for now
        cut = time.monotonic()
        # The others see its lease expire and re-form at world 2.
        until(lambda: others[0].num_waiting() > 0, TTL + 3, "the others to see the victim gone")
        lost = join_all(others)
        assert {r.world_size for r in lost} == {2} and time.monotonic() - cut < TTL + 4

        # While its workers make progress the victim goes on, past TTL + grace (etcd down for everyone
        # looks the same from here) ...
        while time.monotonic() - cut < TTL + FENCE_GRACE + 1.0:
            assert fence.check() is None
            time.sleep(0.1)
        assert steps.link.may_publish() == UNKNOWN  # ... but publishes nothing while etcd cannot confirm
        # ... and once they stall (their peers are gone), it fences itself after a short stall (50 ms steps).
        steps.running.clear()
        stalled = steps.last
        reason = until(fence.check, 5, "the fence")
        assert reason == "cut_off"
        assert STALL_MIN <= time.monotonic() - stalled < STALL_MIN + 0.5

        # Its agent stops the workers and re-joins, which waits for etcd (its view still shows round 1).
        rejoin = ThreadPoolExecutor(1).submit(victim.join)
        time.sleep(0.5)
        assert not rejoin.done()
        proxy.heal()
        # etcd answers again: the lease is found gone, the gate says stale, the victim re-joins ...
        until(lambda: victim.lease.losses > 0, 10, "the victim to learn its lease is gone")
        assert steps.link.may_publish() == STALE
        until(lambda: others[0].num_waiting() > 0, 10, "the others to see the victim back")
        back = [*join_all(others), rejoin.result(timeout=30)]
        assert {r.world_size for r in back} == {3}
        # ... and the healed cut spent one unit of the failure budget, not two.
        kv = others[0].etcd.get(others[0].prefix + "failures")
        assert kv is not None and int(kv.value) == 1
        steps.stop.set()
        fence.close()
    finally:
        for p in nodes:
            p.leave()


def test_a_node_that_learns_its_lease_is_gone_fences_at_once(etcd_server, tmp_path: Path) -> None:
    nodes = [
        Participant(connect(etcd_server.endpoint), settings(), addr="127.0.0.1", node_id=f"m{i}")
        for i in (0, 1)
    ]
    try:
        join_all(nodes)
        fence = Fence(nodes[1], AgentChannel(str(tmp_path)))
        fence.arm()
        steps = Steps(str(tmp_path), 1)
        assert fence.check() is None
        connect(etcd_server.endpoint).lease_revoke(nodes[1].lease.lease_id)  # etcd forgets the lease
        assert until(fence.check, TTL + 2, "the fence") == "lease_lost"
        steps.stop.set()
    finally:
        for p in nodes:
            p.leave()
