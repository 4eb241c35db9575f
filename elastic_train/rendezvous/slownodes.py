"""Slow nodes at run time: each agent reports its node's busy time, one agent decides, an evicted node leaves.

Every ``report_every`` seconds, a thread of each agent (:class:`SlowNodes`):

1. **reports** its node's busy time: the workers' figures on the node's channel
   (:class:`~elastic_train.node.Stats`: each worker's mean busy time per step since its last report,
   :mod:`elastic_train.train.busy`), the slowest local worker's, written to
   ``/elastic_train_busy/<run>/<node>`` on the node's lease. These keys are outside the run's watched
   prefix: N nodes writing every few seconds would otherwise wake every node's watch N times as often; one
   agent reads them with one range request.
2. **decides**, on the node holding rank 0 of the round only: it reads every member's report of the current
   round, feeds them to the detector (:func:`elastic_train.straggler.observe`), logs each flag and clear
   (``straggler_flagged`` / ``straggler_cleared``, with the numbers), keeps ``straggler/<node>`` for
   ``elastic-train status``, and under ``policy: evict`` turns flags into decisions
   (:func:`elastic_train.straggler.decide_evictions`: never below ``min_nodes``, at most ``max_evictions``
   per ``eviction_window``, only while every member re-forms in-process). An eviction is one transaction:
   ``evict/<node>`` (the order, on the decider's lease) and ``evictions`` (the run's eviction times, which
   bound the next decisions whichever node decides then).
3. **obeys**: a node that sees ``evict/<itself>`` for its current round hands the order to its handler
   (:meth:`elastic_train.rendezvous.handler.Etcd3RendezvousHandler`), which announces a clean leave (the
   survivors re-form in-process without it: no restart, no failure budget spent), stops its workers, waits
   out its probation and rejoins on trial, or leaves the job after ``max_trials`` evictions.

Under ``policy: evict`` (and a ``probe_patience`` above 0) the thread also measures its node's healthy
rates (:mod:`elastic_train.straggler.probe`, in a thread of its own; the best rate of each device is kept):
CPU and CUDA at the agent's start, before its workers use them, and the CPU while its workers train in the
job, after the node's ``window``-th report of a round and after 2, 4, 8, ... times that, each after a
random delay of up to ``window`` reports (not while the node is flagged, nor after it was evicted). One
probe can be held back by a neighbour's burst of load (the nodes of a job starting together and probing in
step, say); the best of several, at times apart from the others', is the node's own pace. What an evicted
node's probes are compared with.

Everything read back (reports, orders, the evictions record) is validated; what does not decode is ignored.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elastic_train.etcd.client import op_put
from elastic_train.etcd.errors import EtcdError
from elastic_train.log import get_logger
from elastic_train.node import AgentChannel
from elastic_train.procs import running
from elastic_train.rendezvous.config import ProtocolSettings, validate_run_id
from elastic_train.rendezvous.protocol import Participant
from elastic_train.straggler import DetectorState, StragglerConfig, decide_evictions, observe
from elastic_train.straggler.policy import Decision, changed
from elastic_train.straggler.probe import DEVICES, rounded, run_probes
from elastic_train.straggler.record import StragglerRecord, seconds, whole

log = get_logger(__name__)

#: Root of the busy-time reports (outside every run's watched prefix).
BUSY_ROOT = "/elastic_train_busy/"
#: A run's eviction orders (``evict/<node>``), its evictions (``evictions``: the times of those that spent
#: the budget, the total, the nodes ever evicted), its nodes' standing (``straggler/<node>``), under the
#: run's prefix.
EVICT = "evict/"
EVICTIONS = "evictions"
STANDING = "straggler/"
#: A report older than this many ``report_every`` is stale (its node stopped reporting).
STALE_REPORTS = 3
#: Most eviction times the run keeps (the bound counts those within the window only).
KEEP_EVICTIONS = 100
#: Longest node id the eviction record's ``nodes`` holds (a longer entry is not a node of this run).
MAX_NODE_ID = 256


def busy_prefix(run_id: str) -> str:
    """The etcd prefix of a run's busy-time reports."""
    return f"{BUSY_ROOT}{validate_run_id(run_id)}/"


@dataclass(frozen=True, slots=True)
class BusyReport:
    """One node's busy time: the slowest local worker's mean busy seconds per step since its last report."""

    round: int
    step: int
    busy_s: float
    time: float
    """Unix time of the report."""

    def encode(self) -> bytes:
        return json.dumps(
            {"round": self.round, "step": self.step, "busy_s": self.busy_s, "time": self.time}
        ).encode()

    @staticmethod
    def decode(raw: bytes) -> BusyReport:
        """Raises ValueError: not a report (bad JSON, a missing or ill-typed field)."""
        try:
            d = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError("not JSON") from exc
        if not isinstance(d, dict):
            raise ValueError("not a mapping")
        r, step, busy, t = d.get("round"), d.get("step"), d.get("busy_s"), d.get("time")
        if not (whole(r) and whole(step) and seconds(busy) and seconds(t)):
            raise ValueError("round, step, busy_s or time missing or invalid")
        return BusyReport(int(r), int(step), float(busy), float(t))


@dataclass(frozen=True, slots=True)
class EvictOrder:
    """An order for a node to leave its round as slow (``evict/<node>``)."""

    node: str
    round: int
    step: int
    score: float
    by: str
    """The node that decided."""

    def encode(self) -> bytes:
        d = {"round": self.round, "step": self.step, "score": self.score, "by": self.by}
        return json.dumps(d).encode()

    @staticmethod
    def decode(node: str, raw: bytes) -> EvictOrder:
        """Raises ValueError: not an order."""
        try:
            d = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError("not JSON") from exc
        if not isinstance(d, dict):
            raise ValueError("not a mapping")
        r, step, score = d.get("round"), d.get("step"), d.get("score")
        if not (whole(r) and whole(step) and seconds(score)):
            raise ValueError("round, step or score missing or invalid")
        return EvictOrder(node, int(r), int(step), float(score), str(d.get("by", ""))[:256])


def _order_score(node: str, raw: bytes) -> float | None:
    """The score an eviction order was given, None when the order does not parse."""
    try:
        return EvictOrder.decode(node, raw).score
    except ValueError:
        return None


def _eviction_record(raw: bytes | None) -> dict[str, Any]:
    """The run's eviction record (``evictions``) as read from etcd: a JSON object, or an empty one when the
    key is absent or unreadable (it is then rewritten by the next eviction)."""
    if raw is None:
        return {}
    try:
        d = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return d if isinstance(d, dict) else {}


def eviction_times(raw: bytes | None) -> list[float]:
    """The run's eviction times (``evictions``); an unreadable record reads as none (and is rewritten)."""
    times = _eviction_record(raw).get("times")
    return [float(t) for t in times if seconds(t)] if isinstance(times, list) else []


def evicted_nodes(raw: bytes | None) -> list[str]:
    """The nodes evicted earlier in the run (``evictions``'s ``nodes``, oldest first): one of them back in
    the job is on trial. Entries that are not node ids read as absent."""
    nodes = _eviction_record(raw).get("nodes")
    if not isinstance(nodes, list):
        return []
    return [n for n in nodes if isinstance(n, str) and 0 < len(n) <= MAX_NODE_ID]


def eviction_total(raw: bytes | None) -> int:
    """Evictions over the run's life (``evictions``'s ``total``)."""
    total = _eviction_record(raw).get("total")
    return total if whole(total) else 0


class SlowNodes:
    """An agent's slow-node thread (see the module docstring).

    Args:
        participant: this node in the run (None before it exists, or while it is replaced).
        channel: the node's channel (the workers' figures).
        settings: the run's settings (``straggler``, ``min_nodes``).
        evicted: called once with an order for this node in its current round (from this thread).
        in_process: whether this node's workers re-form in-process now.
    """

    def __init__(
        self,
        participant: Callable[[], Participant | None],
        channel: AgentChannel,
        settings: ProtocolSettings,
        evicted: Callable[[EvictOrder], None],
        in_process: Callable[[], bool],
    ) -> None:
        self._participant = participant
        self._channel = channel
        self.s = settings
        self.cfg: StragglerConfig = settings.straggler
        self._evicted = evicted
        self._in_process = in_process
        self._prefix = busy_prefix(settings.run_id)
        self._state = DetectorState()
        self._decided: dict[str, Decision] = {}
        self._standing: dict[str, StragglerRecord] = {}
        self._obeyed: tuple[str, int] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: The best health-probe rate of each device of this node, measured at the agent's start or while it
        #: trained in the job (a device without one: none measured, or absent).
        self.healthy_rates: dict[str, float] = {}
        self._reports: tuple[int | None, int] = (None, 0)  # (round, reports of this node in it)
        self._probing = False

    def start(self) -> None:
        if not self.cfg.enabled or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="slow-nodes", daemon=True)
        self._thread.start()
        if self.probes:  # before the workers start: the devices are the node's own
            self._probe_healthy(None, "start", list(DEVICES))

    def close(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.cfg.report_every):
            try:
                self.tick()
            except EtcdError as exc:  # etcd unreachable for now: the rendezvous says so where it matters
                log.debug("slow_nodes_etcd", error=str(exc))
            except Exception as exc:  # never kill the agent for slow-node detection
                log.warning("slow_nodes_failed", error=repr(exc))

    def tick(self) -> None:
        """One report, one decision (rank 0's node), one look for an order to this node."""
        p = self._participant()
        if p is None or p.round is None or p.leaving or p.refused:
            return
        with p.view.cond:
            members = list(p.members)
            order_kv = p.view.get(EVICT + p.node_id)
        if p.node_id not in members:
            return
        if order_kv is not None:
            self._obey(p, order_kv.value)
        self._report(p)
        if members and members[0] == p.node_id:
            self._decide(p, members)

    # -- 1. report ----------------------------------------------------------------------------------------
    def _report(self, p: Participant) -> None:
        rnd = p.round
        stats = [
            st
            for st in self._channel.stats().values()
            if st.round == rnd and st.busy_s is not None and running(st.pid)
        ]
        lease = p.lease.lease_id
        if not stats or rnd is None or not lease:
            return
        busy = max(st.busy_s or 0.0 for st in stats)
        report = BusyReport(rnd, min(st.step for st in stats), busy, time.time())
        p.etcd.put(self._prefix + p.node_id, report.encode(), lease)
        seen = self._reports[1] + 1 if self._reports[0] == rnd else 1
        self._reports = (rnd, seen)
        first = max(self.cfg.window, 3)
        if self.probes and seen % first == 0 and (seen // first).bit_count() == 1 and not self._probing:
            with p.view.cond:
                flagged = p.view.get(STANDING + p.node_id) is not None
            if flagged or self._obeyed is not None:  # slow now, or evicted before: no healthy rate
                return
            self._probe_healthy(p.node_id, "job", ["cpu"])  # the workers use the GPU

    @property
    def probes(self) -> bool:
        """Whether an evicted node probes its health before it rejoins (policy ``evict``, ``probe_patience``
        above 0)."""
        return self.cfg.policy == "evict" and self.cfg.probe_patience > 0

    def _probe_healthy(self, node: str | None, when: str, devices: list[str]) -> None:
        """Measure healthy rates of this node in a thread of its own (one at a time)."""
        self._probing = True
        threading.Thread(
            target=self._measure_healthy, args=(node, when, devices), name="slow-nodes-probe", daemon=True
        ).start()

    def _measure_healthy(self, node: str | None, when: str, devices: list[str]) -> None:
        """One probe of each of ``devices`` in health (see :meth:`_report`); the best rates are kept. A node
        slow by then measures rates its later probes do not fall short of, and is judged on trial as
        without a probe."""
        try:
            # apart from the other nodes' probes, which their reports would otherwise start in step
            if when == "job" and self._stop.wait(random.uniform(0, self.cfg.window * self.cfg.report_every)):
                return
            rates = run_probes(devices, stop=self._stop)
            if self._stop.is_set():
                return
            self.healthy(rates)
            log.info(
                "straggler_probe",
                node=node,
                at="healthy",
                when=when,
                rates=rounded(rates),
                healthy_rates=rounded(self.healthy_rates),
            )
        finally:
            self._probing = False

    def healthy(self, rates: dict[str, float | None]) -> None:
        """Count ``rates`` as rates of this node in health (the best one of each device is kept)."""
        for device, rate in rates.items():
            if rate is not None:
                self.healthy_rates[device] = max(rate, self.healthy_rates.get(device, 0.0))

    # -- 2. decide ----------------------------------------------------------------------------------------
    def _decide(self, p: Participant, members: list[str]) -> None:
        kvs, _ = p.etcd.get_prefix(self._prefix)
        now = time.time()
        fresh = now - STALE_REPORTS * self.cfg.report_every
        reports: dict[str, BusyReport] = {}
        for kv in kvs:
            node = kv.key[len(self._prefix) :]
            if node not in members:
                continue
            try:
                r = BusyReport.decode(kv.value)
            except ValueError:
                continue
            if r.round == p.round and r.time >= fresh:
                reports[node] = r
        if len(reports) < 2:
            return
        step = max(r.step for r in reports.values())
        self._state, flags = observe(
            self._state, step, {n: r.busy_s for n, r in reports.items()}, time.monotonic(), self.cfg
        )
        for f in flags:
            (log.warning if f.event == "straggler_flagged" else log.info)(f.event, **f.fields())
        with p.view.cond:
            evictions = p.view.get(EVICTIONS)
            inproc = set(p.view.under("inproc/"))
            ordered = p.view.under(EVICT)
        orders = {node: _order_score(node, kv.value) for node, kv in ordered.items()}
        raw = evictions.value if evictions is not None else None
        flagged = [(n, self._state.score(n) or 0.0) for n in self._state.flagged if n in members]
        on_trial = set(evicted_nodes(raw))
        decisions = decide_evictions(
            flagged=flagged,
            world=len(members) - len(orders.keys() & set(members)),
            min_nodes=self.s.min_nodes,
            evicted_at=eviction_times(raw),
            now=now,
            cfg=self.cfg,
            in_process=self._in_process() and set(members) <= inproc,
            on_trial=on_trial,
        )
        for d in changed(self._decided, decisions):
            (log.warning if d.event == "straggler_evict" else log.info)(d.event, **d.fields())
        self._decided = {d.node: d for d in decisions}
        for d in decisions:
            if d.event == "straggler_evict" and d.node not in orders:
                self._order(p, d, step, raw, now)
        self._keep_standing(p, members, step, orders)

    def _order(self, p: Participant, d: Decision, step: int, raw: bytes | None, now: float) -> None:
        assert p.round is not None
        order = EvictOrder(d.node, p.round, step, round(d.score, 3), p.node_id)
        times = [t for t in eviction_times(raw) if now - t < self.cfg.eviction_window][-KEEP_EVICTIONS:]
        nodes = [n for n in evicted_nodes(raw) if n != d.node][-(KEEP_EVICTIONS - 1) :]
        record = {
            "times": times if d.trial else [*times, now],  # a re-eviction on trial spends no budget
            "total": eviction_total(raw) + 1,
            "nodes": [*nodes, d.node],
        }
        p.etcd.txn(
            [],
            [
                op_put(p.prefix + EVICT + d.node, order.encode(), p.lease.lease_id),
                op_put(p.prefix + EVICTIONS, json.dumps(record).encode()),
            ],
        )
        self._state = DetectorState({n: t for n, t in self._state.tracks.items() if n != d.node})

    def _keep_standing(
        self, p: Participant, members: list[str], step: int, orders: dict[str, float | None]
    ) -> None:
        """``straggler/<node>`` for ``status``: flagged nodes (and why they are kept), evicted ones (with the
        score their order was given, ``orders``' value: the detector forgets a node once it ordered its
        eviction)."""
        want: dict[str, StragglerRecord] = {}
        for node in self._state.flagged:
            if node in members and node not in orders:
                d = self._decided.get(node)
                why = d.why if d is not None and d.event == "straggler_kept" else ""
                prev = self._standing.get(node)
                since = prev.since if prev is not None and prev.state == "flagged" else time.time()
                score = self._state.score(node) or 0.0
                want[node] = StragglerRecord(
                    node, "flagged", round(score, 3), step, since, self.cfg.policy, why
                )
        for node in orders.keys() & set(members):
            prev = self._standing.get(node)
            since = prev.since if prev is not None and prev.state == "evicted" else time.time()
            d = self._decided.get(node)
            given = orders[node]  # None: an order that does not parse
            if given is not None:
                score = given
            else:
                score = round(d.score, 3) if d is not None else prev.score if prev is not None else 0.0
            want[node] = StragglerRecord(node, "evicted", score, step, since, self.cfg.policy)
        for node, rec in want.items():
            prev = self._standing.get(node)
            if prev is None or (prev.state, prev.why) != (rec.state, rec.why):
                p.etcd.put(p.prefix + STANDING + node, rec.encode(), p.lease.lease_id)
        for node in set(self._standing) - set(want):
            p.etcd.delete(p.prefix + STANDING + node)
        for node in orders.keys() - set(members):  # the evicted node left the round: its order is done
            p.etcd.delete(p.prefix + EVICT + node)
        self._standing = want

    # -- 3. obey -------------------------------------------------------------------------------------------
    def _obey(self, p: Participant, raw: bytes) -> None:
        try:
            order = EvictOrder.decode(p.node_id, raw)
        except ValueError as exc:
            log.warning("straggler_order_unreadable", node=p.node_id, error=str(exc))
            return
        if order.round != p.round or self._obeyed == (p.node_id, order.round):
            return
        self._obeyed = (p.node_id, order.round)
        log.warning("straggler_evicted", node=p.node_id, round=order.round, score=order.score, by=order.by)
        self._evicted(order)
