"""May this node take part in the run? Its identity against the run's, before it writes a lease or a join key.

A run id is a shared name, not a lock. The first node records the run's identity (the settings every node
must share, :mod:`elastic_train.rendezvous.identity`) with a create-if-absent transaction; every other node
compares its own before it takes part. A node with other settings waits (bounded) while live nodes hold the
run, then takes a run nobody holds over (the documented way to change a job's node range); a node of a
closed run is turned away with the way forward in the line, or, a moment after the run finished with its
own settings, leaves as a late node of it (:class:`~elastic_train.rendezvous.errors.RendezvousClosed`).
Refusal happens before any key is written, so a refused node leaves no trace the job must clean up.
"""

from __future__ import annotations

import json
import time
from typing import Any

from elastic_train.etcd.client import Etcd, cmp_mod, cmp_version, op_put
from elastic_train.log import get_logger
from elastic_train.rendezvous.config import ProtocolSettings
from elastic_train.rendezvous.errors import RendezvousClosed, RunRefused
from elastic_train.rendezvous.identity import JobIdentity
from elastic_train.rendezvous.records import RunReader, at_step, finished_line, when

log = get_logger(__name__)

#: Seconds an identity written by a node binds the run even before that node's lease shows up (unless a round
#: closed since: its nodes were past their start).
IDENTITY_FRESH = 10.0


def config_record(s: ProtocolSettings) -> bytes:
    """The run's ``config`` record: failure budget and window, node range (``status`` shows them)."""
    return json.dumps(
        {
            "failure_budget": s.failure_budget,
            "failure_window": s.failure_window,
            "min_nodes": s.min_nodes,
            "max_nodes": s.max_nodes,
        }
    ).encode()


class Claim:
    """One node's claim on a run (see the module docstring).

    Args:
        etcd: a connected client.
        run: the run's records, from the node's started view.
        prefix: the run's key prefix.
        settings: the node's settings (its identity among them).
        node_id: the node.
    """

    def __init__(
        self, etcd: Etcd, run: RunReader, prefix: str, settings: ProtocolSettings, node_id: str
    ) -> None:
        self.etcd, self.run, self.prefix, self.s, self.node_id = etcd, run, prefix, settings, node_id
        self.view = run.view

    def claim(self, deadline: float) -> None:
        """Make sure this node may take part in the run, before it writes a lease or a join key.

        Records this node's identity if the run has none (create-if-absent), takes over a run whose nodes are
        all gone, and waits up to ``deadline`` for a live run with other settings to go away.

        Raises:
            RunRefused: the run finished or failed, or a live run with other settings held it until
                ``deadline``.
            RendezvousClosed: the run finished moments ago with this node's settings (a late node of it).
        """
        mine = self.s.identity
        announced = False
        while True:
            with self.view.cond:
                closed = self.run.closed()
                kv = self.view.get("identity")
                live = self.run.live()
                rnd = self.view.get("round")
            if closed is not None:
                self._refuse_closed(closed, kv.value if kv else None)
            if mine is None:
                return
            if kv is None:
                value = mine.encode(time=time.time(), node=self.node_id)
                ok, _ = self.etcd.txn(
                    [cmp_version(self.prefix + "identity", 0), cmp_version(self.prefix + "closed", 0)],
                    [op_put(self.prefix + "identity", value)],
                )
                if ok:
                    log.info("run_identity_recorded", run_id=self.s.run_id, fingerprint=mine.fingerprint)
                    return
                self._await_key("identity")
                continue
            try:
                theirs = JobIdentity.decode(kv.value)
                recorded_at = float(json.loads(kv.value).get("time") or 0.0)
            except (ValueError, TypeError, AttributeError):
                theirs, recorded_at = JobIdentity({"identity": "(unreadable)"}), 0.0
            if theirs.fingerprint == mine.fingerprint:
                return
            line = theirs.refusal(self.s.run_id, mine)
            # A round closed since the identity was recorded: its nodes had leases after it, so with none
            # live now they are gone (not still starting), however recently the identity was written.
            formed_since = rnd is not None and rnd.mod_revision > kv.mod_revision
            fresh = time.time() - recorded_at <= max(IDENTITY_FRESH, 3 * self.s.lease_ttl)
            if not live and (formed_since or not fresh):
                if self._take_over(kv.mod_revision, mine):
                    log.warning(
                        "run_taken_over",
                        run_id=self.s.run_id,
                        reason="no live node holds the run and it did not finish; resuming it with this "
                        "node's settings",
                        previous=line,
                    )
                    return
                continue
            if time.monotonic() >= deadline:
                raise RunRefused(line)
            if not announced:
                announced = True
                log.warning(
                    "run_identity_differs",
                    run_id=self.s.run_id,
                    detail=line,
                    waiting_s=round(max(0.0, deadline - time.monotonic()), 1),
                    live_nodes=len(live),
                    hint="waiting for that job's nodes to leave (a Job deleted moments ago); then this node "
                    "takes the run over",
                )
            with self.view.cond:
                self.view.cond.wait(min(1.0, max(0.05, deadline - time.monotonic())))

    def check_kept(self) -> None:
        """Refuse to re-join a run that nodes with other settings took over while this one was away (stopped
        past its lease, its peers gone). Call with ``view.cond`` held.

        Raises:
            RunRefused: the run's identity is another one now.
        """
        mine, kv = self.s.identity, self.view.get("identity")
        if mine is None or kv is None:
            return
        try:
            theirs = JobIdentity.decode(kv.value)
        except ValueError:
            return
        if theirs.fingerprint != mine.fingerprint:
            raise RunRefused(f"{theirs.refusal(self.s.run_id, mine)} (the run was taken over)")

    def _await_key(self, key: str, timeout: float = 2.0) -> None:
        """Wait (briefly) until the view shows ``key``, after a transaction lost to its writer."""
        end = time.monotonic() + timeout
        with self.view.cond:
            while self.view.get(key) is None and time.monotonic() < end:
                self.view.cond.wait(0.1)

    def _take_over(self, identity_rev: int, mine: JobIdentity) -> bool:
        """Replace the identity of a run nobody holds (compare-and-set on its revision)."""
        ok, resp = self.etcd.txn(
            [cmp_mod(self.prefix + "identity", identity_rev), cmp_version(self.prefix + "closed", 0)],
            [
                op_put(self.prefix + "identity", mine.encode(time=time.time(), node=self.node_id)),
                op_put(self.prefix + "config", config_record(self.s)),
            ],
        )
        # Until the watch delivers it, the view would still show the identity just replaced.
        end = time.monotonic() + (5.0 if ok else 0.2)
        with self.view.cond:
            while self.view.revision < int(resp.header.revision) and time.monotonic() < end:
                self.view.cond.wait(0.05)
        return ok

    def _refuse_closed(self, closed: dict[str, Any], identity_raw: bytes | None) -> None:
        """Turn a new node away from a closed run, with the way forward in the line."""
        run = self.s.run_id
        theirs: JobIdentity | None = None
        if identity_raw is not None:
            try:
                theirs = JobIdentity.decode(identity_raw)
            except ValueError:
                theirs = None
        url = (theirs.settings.get("checkpoint.url") if theirs else None) or "CHECKPOINT_URL"
        forward = f"--run-id NEW_ID --resume-from {url}/{run}"
        reason = closed.get("reason")
        if reason == "finished":
            mine = self.s.identity
            same = mine is None or theirs is None or theirs.fingerprint == mine.fingerprint
            try:
                age = time.time() - float(closed.get("time") or 0.0)
            except (TypeError, ValueError):
                age = float("inf")
            if same and age < self.s.identity_wait:
                log.info("rendezvous_run_already_finished", run_id=run, finished_s_ago=round(age, 1))
                raise RendezvousClosed(finished_line(run, closed))
            raise RunRefused(
                f"run {run} finished{at_step(closed)}{when(closed.get('time'))}; start a new run with "
                "another run id "
                f"(to continue from its checkpoint: {forward})"
            )
        why = str(closed.get("message") or reason or "failed")
        raise RunRefused(
            f"run {run} failed: {why}; to continue, start a new run from its newest checkpoint: {forward}"
        )
