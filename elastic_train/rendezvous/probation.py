"""An evicted node's probation: it waits, probes its own health, and rejoins on trial or leaves the job.

Served by the handler's ``next_rendezvous`` after torchrun stopped the evicted node's workers
(:meth:`elastic_train.rendezvous.handler.Etcd3RendezvousHandler._serve_probation`):

1. :func:`elastic_train.straggler.policy.probation` says how long it waits (``probation_seconds``, doubled
   at each eviction of the node), or that it leaves after ``max_trials`` evictions (status 0, one line).
2. With a health probe (policy ``evict``, ``probe_patience`` above 0, and healthy rates measured:
   :mod:`elastic_train.straggler.probe`), it probes at once each device it has a healthy rate of. A rate at
   least ``threshold`` times below its healthy rate sees what slows the node: the node then rejoins only
   once a probe, every :data:`PROBE_EVERY` seconds after the probation, finds every device within
   ``clear_below`` of its healthy rate (the detector's hysteresis), and leaves after ``probe_patience``
   seconds of slow probes. A probe that does not find it slow (or gives no answer) leaves the judgement to
   the trial: it rejoins after its probation.
3. ``straggler/<node>`` says how it stands, for ``elastic-train status`` (on a lease of its own: the record
   goes when the agent does).

Every probe is one ``straggler_probe`` event with the rates behind it. While it waits the node looks once a
second for the run's end: a run that finished meanwhile ends the agent (status 0, one line).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable

from elastic_train.etcd.client import Etcd
from elastic_train.etcd.errors import EtcdError
from elastic_train.log import get_logger
from elastic_train.rendezvous.config import ProtocolSettings, run_prefix
from elastic_train.rendezvous.errors import RunFinished
from elastic_train.rendezvous.slownodes import STANDING, EvictOrder, SlowNodes
from elastic_train.straggler.policy import probation
from elastic_train.straggler.probe import ProbeVerdict, probe_verdict, run_probes
from elastic_train.straggler.record import StragglerRecord

log = get_logger(__name__)

#: Seconds between the starts of two probes of a node whose probe still finds it slow.
PROBE_EVERY = 5.0


class Probation:
    """One probation of an evicted node (see the module docstring).

    Args:
        etcd: the agent's etcd client.
        settings: the run's settings (``straggler``).
        order: the eviction order this node obeyed.
        evictions: this node's evictions so far, this one included.
        slow: the agent's slow-node thread (the node's healthy rate).
        say: prints the one line of a node that leaves.
        probe: the health probe of the devices given (a rate of each, None for no answer).
    """

    def __init__(
        self,
        etcd: Etcd,
        settings: ProtocolSettings,
        order: EvictOrder,
        evictions: int,
        slow: SlowNodes,
        say: Callable[[str], None],
        probe: Callable[[list[str]], dict[str, float | None]] = run_probes,
    ) -> None:
        self.etcd = etcd
        self.s = settings
        self.cfg = settings.straggler
        self.order = order
        self.evictions = evictions
        self.slow = slow
        self.say = say
        self.probe = probe
        self._prefix = run_prefix(settings.run_id)
        self._lease = 0
        self._probes = 0

    def serve(self) -> None:
        """Wait out the probation (probing when a probe sees the slowdown); return when the node rejoins.

        Raises:
            RunFinished: the node leaves the job, or the run finished meanwhile.
        """
        order = self.order
        verdict = probation(node=order.node, evictions=self.evictions, cfg=self.cfg)
        log.warning(verdict.event, **verdict.fields())
        if verdict.action == "leave":
            self._leave(
                f"evicted as a slow node {verdict.evictions} times "
                f"(rendezvous.straggler.max_trials {verdict.max_trials})"
            )
        gated = False
        if self.slow.probes and self.slow.healthy_rates:
            gated = self._look("eviction").verdict == "slow"
        n, of = verdict.evictions, verdict.max_trials
        if gated:
            why = (
                f"rejoins on trial once a health probe finds it within {self.cfg.clear_below:g}x of its "
                f"healthy rate, at the earliest in {verdict.wait_s:g} s (eviction {n} of {of})"
            )
        else:
            why = f"rejoins on trial in {verdict.wait_s:g} s (eviction {n} of {of})"
        self._record(why, verdict.wait_s + (self.cfg.probe_patience if gated else 0.0))
        began = time.monotonic()
        try:
            self._wait(time.monotonic() + verdict.wait_s)
            if gated:
                self._probe_until_healthy()
        finally:
            if self._lease:
                with contextlib.suppress(EtcdError):
                    self.etcd.lease_revoke(self._lease)
        log.info(
            "straggler_rejoin",
            node=order.node,
            evictions=self.evictions,
            waited_s=round(time.monotonic() - began, 1),
            probation_s=verdict.wait_s,
            probes=self._probes,
        )

    def _probe_until_healthy(self) -> None:
        give_up = time.monotonic() + self.cfg.probe_patience
        while True:
            started = time.monotonic()
            if self._look("probation").verdict != "slow":
                return
            if time.monotonic() >= give_up:
                log.warning("straggler_leave", node=self.order.node, evictions=self.evictions,
                            probe_patience_s=self.cfg.probe_patience)  # fmt: skip
                self._leave(
                    f"its health probe still finds it slow after {self.cfg.probe_patience:g} s "
                    f"(rendezvous.straggler.probe_patience)"
                )
            self._wait(started + PROBE_EVERY)

    def _look(self, at: str) -> ProbeVerdict:
        """One probe of each device with a healthy rate, read against those (one event); rates found healthy
        raise them."""
        rates = self.probe(sorted(self.slow.healthy_rates))
        self._probes += 1
        slow_at = self.cfg.threshold if at == "eviction" else self.cfg.clear_below
        v = probe_verdict(rates=rates, healthy_rates=self.slow.healthy_rates, slow_at=slow_at)
        log.info("straggler_probe", node=self.order.node, at=at, slow_at=slow_at, **v.fields())
        if v.verdict == "healthy":
            self.slow.healthy(rates)
        return v

    def _record(self, why: str, wait_s: float) -> None:
        order = self.order
        try:
            self._lease = self.etcd.lease_grant(math.ceil(wait_s) + 30)
            rec = StragglerRecord(order.node, "probation", order.score, order.step, time.time(), "evict", why)
            self.etcd.put(self._prefix + STANDING + order.node, rec.encode(), self._lease)
        except EtcdError as exc:  # status shows less; the probation itself needs nothing of etcd
            log.warning("straggler_probation_unrecorded", node=order.node, error=str(exc))

    def _wait(self, until: float) -> None:
        """Sleep until ``until`` (monotonic), looking once a second whether the run finished."""
        while (left := until - time.monotonic()) > 0:
            time.sleep(min(1.0, left))
            try:
                closed = self.etcd.get(self._prefix + "closed")
            except EtcdError:
                continue
            if closed is not None:
                line = f"run {self.s.run_id} finished while node {self.order.node} was on probation"
                self.say(f"elastic-train: {line}")
                raise RunFinished(line)

    def _leave(self, why: str) -> None:
        line = f"node {self.order.node} leaves the job: {why}"
        self.say(f"elastic-train: {line}")
        raise RunFinished(line)
