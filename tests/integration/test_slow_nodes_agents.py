"""The agents' slow-node thread on a real etcd: reports, one decider, the eviction order, ``status``.

Three participants of one run form a round; each has a :class:`SlowNodes` fed with its workers' figures
(a stand-in channel of :class:`~elastic_train.node.Stats`) and ticked by the test. The full path (workers
slowed by SIGSTOP, an eviction through the hot path, the trial and the leave) is
tests/chaos/test_slow_nodes.py.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

from elastic_train.etcd.client import connect
from elastic_train.node import Stats
from elastic_train.rendezvous.protocol import Participant, ProtocolSettings
from elastic_train.rendezvous.slownodes import EVICTIONS, SlowNodes, busy_prefix, eviction_total
from elastic_train.rendezvous.status import read_status
from elastic_train.straggler import StragglerConfig


class Channel:
    """The node's channel as the slow-node thread reads it: one worker's figures."""

    def __init__(self) -> None:
        self.busy = 0.03
        self.step = 0
        self.round: int | None = None

    def stats(self) -> dict[int, Stats]:
        self.step += 5
        st = Stats(os.getpid(), self.round, self.step, time.time(), 0.0, busy_s=self.busy, busy_steps=5)
        return {st.pid: st}


def test_the_decider_flags_the_slow_node_orders_its_eviction_and_status_shows_it(
    etcd_server, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    from elastic_train.rendezvous import slownodes

    monkeypatch.setattr(slownodes, "run_probes", lambda devices, stop=None: dict.fromkeys(devices, 100.0))
    cfg = StragglerConfig(policy="evict", report_every=0.1, window=3, slow_steps=10, max_evictions=1)
    s = ProtocolSettings(run_id="slow", min_nodes=2, max_nodes=3, lease_ttl=2.0, settle=0.3, straggler=cfg)
    ps = [Participant(connect(etcd_server.endpoint), s, addr="127.0.0.1", node_id=f"n{i}") for i in range(3)]
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda p: p.join(), ps))
    try:
        for p in ps:
            p.advertise_inproc(True)
        channels = {p.node_id: Channel() for p in ps}
        orders: dict[str, list] = {p.node_id: [] for p in ps}  # type: ignore[type-arg]
        agents = [
            SlowNodes(lambda p=p: p, channels[p.node_id], s, orders[p.node_id].append, lambda: True)  # type: ignore[misc]
            for p in ps
        ]
        for ch in channels.values():
            ch.round = results[0].round
        decider = next(p for p in ps if p.members[0] == p.node_id)
        slow = next(p.node_id for p in ps if p is not decider)
        etcd = connect(etcd_server.endpoint)

        def ticks(n: int) -> None:
            for _ in range(n):
                for a in agents:
                    a.tick()
                time.sleep(0.02)

        # a job-wide slowdown: every node three times slower, nobody stands out
        for ch in channels.values():
            ch.busy = 0.09
        ticks(6)
        assert read_status(etcd, "slow").stragglers == [] and not any(orders.values())
        kvs, _ = etcd.get_prefix(busy_prefix("slow"))
        assert len(kvs) == 3  # one report per node, outside the run's watched prefix

        # one node slow: flagged after slow_steps, evicted (the order reaches it alone), shown by status
        for ch in channels.values():
            ch.busy = 0.03
        channels[slow].busy = 0.09
        ticks(8)
        assert [o.node for o in orders[slow]] == [slow] and orders[slow][0].score >= 1.5
        assert all(not orders[n] for n in orders if n != slow)
        assert orders[slow][0].by == decider.node_id and orders[slow][0].round == results[0].round
        st = read_status(etcd, "slow")
        assert [(r.node, r.state) for r in st.stragglers] == [(slow, "evicted")], st.stragglers
        assert st.stragglers[0].score == orders[slow][0].score  # the order's, however the cycles fell
        rec = etcd.get("/elastic_train/slow/" + EVICTIONS)
        assert rec is not None and eviction_total(rec.value) == 1
        ticks(3)  # the order is obeyed once
        assert len(orders[slow]) == 1
    finally:
        for p in ps:
            p.leave()
