"""Closing: the one transaction that closes a round, and the mark that closes a run.

A round closes with one transaction by the node the rules pick (:func:`elastic_train.rendezvous.decide.
decide_close`), compared on the last round's mod revision and on the run not being closed: it writes the new
``round`` record (what brought the run there: :func:`elastic_train.rendezvous.budget.account`) and, for a
failure or a clean leave, the failures spent and the run's ``budget`` record (a leave's mark is deleted with
it). The same transaction closes the run instead when a round cannot help (every member failed the same way
before the first step, or the failure budget is spent in its window).
A run closes (``closed``, first writer wins) when it finished or failed for good; its record keys then move
onto a lease of :data:`~elastic_train.rendezvous.records.RUN_RECORD_TTL`, so ``status`` can still read the
run's end and the name can be used again afterwards.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from elastic_train.etcd.client import Etcd, cmp_mod, cmp_version, op_delete, op_put
from elastic_train.etcd.errors import EtcdError
from elastic_train.log import get_logger
from elastic_train.rendezvous import budget
from elastic_train.rendezvous.config import ProtocolSettings
from elastic_train.rendezvous.decide import Joiner, assign_ranks, identical_startup_failure
from elastic_train.rendezvous.records import LEFT, RUN_RECORD_KEYS, RUN_RECORD_TTL, RoundRecord, RunReader

log = get_logger(__name__)

#: Seconds a finishing node keeps trying to write the run's ``closed`` mark while etcd is unreachable.
CLOSE_PATIENCE = 30.0


@dataclass(frozen=True, slots=True)
class CloseAttempt:
    """What a decision to close the forming round was made on; the close transaction writes from it."""

    previous: RoundRecord | None
    """The last closed round (``None`` before the first)."""
    previous_revision: int
    """Its ``round`` key's mod revision (0 when absent): what the transaction compares."""
    joins: dict[str, Joiner]
    """The live nodes asking for :attr:`target`."""
    live: set[str]
    """Every node with a lease."""
    target: int
    """The round being closed."""


class Closer:
    """The closing writes of one node (see the module docstring).

    Args:
        etcd: a connected client.
        run: the run's records, from the node's view.
        prefix: the run's key prefix.
        settings: the run's settings (node range, failure budget).
        node_id: the node (recorded as the closer).
    """

    def __init__(
        self, etcd: Etcd, run: RunReader, prefix: str, settings: ProtocolSettings, node_id: str
    ) -> None:
        self.etcd, self.run, self.prefix, self.s, self.node_id = etcd, run, prefix, settings, node_id

    def close_round(self, attempt: CloseAttempt) -> bool:
        """Close the round ``attempt`` was decided on: one transaction, compared on the last round's revision
        (and by the run not being closed); False when another node's transaction won."""
        previous = attempt.previous.members if attempt.previous else []
        members = assign_ranks(previous, attempt.joins.values(), self.s.max_nodes)
        view = self.run.view
        with view.cond:
            used = self.run.failures()
            nodes_kv = {m: self.run.node(m) for m in members}
            left, spent = self.run.left(), self.run.budget()
        # the failure budget and the clean leaves, written in the round's own transaction (budget.py)
        t = budget.account(
            previous=previous,
            members=members,
            joiners=attempt.joins.values(),
            live=attempt.live,
            left_nodes=left,
            record=spent,
            now=time.time(),
            budget=self.s.failure_budget,
            window=self.s.failure_window,
            total=used,
        )
        nodes = {}
        for m, d in nodes_kv.items():
            nodes[m] = (
                {"addr": d.get("addr"), "store_port": d.get("store_port", 0)}
                if d is not None
                else {"addr": None, "store_port": 0}
            )
        compare = [
            cmp_mod(self.prefix + "round", attempt.previous_revision),
            cmp_version(self.prefix + "closed", 0),
        ]
        startup = identical_startup_failure(previous, attempt.joins.values())
        if startup is not None:  # no restart can help: the run fails, no failure budget spent
            mark = {"reason": "failed", "message": startup, "by": self.node_id, "time": time.time()}
            ok, _ = self.etcd.txn(compare, [op_put(self.prefix + "closed", json.dumps(mark).encode())])
            if ok:
                log.error("identical_startup_failure", run_id=self.s.run_id, error=startup)
                self.expire_record()
            return ok
        if t.exhausted:
            window = self.s.failure_window
            within = f" in {budget.window_text(window)}" if window > 0 else ""
            msg = (
                f"failure budget exhausted for run {self.s.run_id!r}: {t.in_window} failures{within}, "
                f"budget {self.s.failure_budget} (raise failure_budget in --rdzv-conf or job.yaml to allow "
                "more)"
            )
            ok, _ = self.etcd.txn(
                compare,
                [
                    op_put(self.prefix + "closed", json.dumps({"reason": "budget", "message": msg}).encode()),
                    op_put(self.prefix + "failures", str(used + 1).encode()),
                    op_put(self.prefix + "budget", t.record.encode()),
                ],
            )
            if ok:
                log.error("failure_budget_exhausted", run_id=self.s.run_id, failures=t.in_window)
                self.expire_record()
            return ok
        asked = [j.asked_at for j in attempt.joins.values() if j.asked_at is not None]
        record = RoundRecord(attempt.target, members, nodes, t.failure, t.kind, min(asked) if asked else None)
        ops = [op_put(self.prefix + "round", record.encode())]
        if t.failure:
            ops.append(op_put(self.prefix + "failures", str(used + 1).encode()))
        if t.writes:
            ops.append(op_put(self.prefix + "budget", t.record.encode()))
            ops += [op_delete(self.prefix + LEFT + n) for n in t.marks_used]
        ok, _ = self.etcd.txn(compare, ops)
        if ok:
            log.info(
                "rendezvous_round_closed",
                round=attempt.target,
                world_size=len(members),
                failure=t.failure,
                kind=t.kind,
                left=list(t.marks_used) or None,
                by=self.node_id,
            )
        return ok

    def close_run(
        self,
        reason: str = "finished",
        message: str = "",
        *,
        step: int | None = None,
        patience: float = CLOSE_PATIENCE,
    ) -> None:
        """Mark the run closed (first writer wins; later rounds are refused).

        Args:
            reason: ``finished``, or ``failed`` (a non-retryable worker error; ``message`` says why).
            message: one line for ``status`` and for nodes turned away.
            step: the step the job ended at, when known.
            patience: seconds to keep retrying while etcd is unreachable (it may be restarting): without the
                mark, a node that starts after the others finished would wait for peers until its join
                timeout.
        """
        record: dict[str, Any] = {
            "reason": reason,
            "message": message,
            "by": self.node_id,
            "time": time.time(),
        }
        if step is not None:
            record["step"] = step
        value = json.dumps(record).encode()
        deadline = time.monotonic() + patience
        delay = 0.2
        while True:
            try:
                ok, _ = self.etcd.txn(
                    [cmp_version(self.prefix + "closed", 0)], [op_put(self.prefix + "closed", value)]
                )
                if ok:
                    self.expire_record()
                return
            except EtcdError as exc:
                if time.monotonic() + delay > deadline:
                    log.warning("rendezvous_close_failed", error=str(exc))
                    return
                log.info("rendezvous_close_retrying", error=str(exc), in_s=delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def expire_record(self) -> None:
        """Move the closed run's record keys onto a lease of ``RUN_RECORD_TTL`` (best effort).

        Each key is re-written with its own value under a compare on its revision: nothing changes them once
        the run is closed, and a key changed meanwhile is left for the next closer.
        """
        try:
            kvs, _ = self.etcd.get_prefix(self.prefix)
            lease = self.etcd.lease_grant(RUN_RECORD_TTL)
            for kv in kvs:
                if kv.key[len(self.prefix) :] in RUN_RECORD_KEYS and kv.lease == 0:
                    self.etcd.txn([cmp_mod(kv.key, kv.mod_revision)], [op_put(kv.key, kv.value, lease)])
        except EtcdError as exc:
            log.warning("run_record_expiry_failed", run_id=self.s.run_id, error=str(exc))
