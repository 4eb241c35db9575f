"""A run's keys in etcd, the records they hold, and how a node reads them from its watched view.

Keys of a run, all under ``/elastic_train/<run_id>/``:

- ``nodes/<node>``  (leased) ``{"addr", "store_port", "host", "pid"}``: the node is alive.
- ``join/<node>``   (leased) ``{"target": R, "reason": ...}``: the node asks to be in round R (with a failure
  report: ``exit_code``, ``error``, ``signature``, ``trained``, ``ran_s``).
- ``inproc/<node>`` (leased) present while the node's workers re-form in-process (hot recovery): a node that
  joins a round all of whose live members have it starts its workers on standby (:mod:`.standby`).
- ``round``         ``{"round", "members": [rank order], "nodes": {id: {"addr", "store_port"}}, "failure",
  "kind", "asked"}``: the last closed round, written only by a compare-and-set on its own mod revision; its
  ``kind`` says what brought the run there (:func:`elastic_train.rendezvous.budget.transition_kind`),
  ``asked`` when the first of its nodes asked for it.
- ``failures``      failures spent over the run's life (written in the same transaction as the round it
  caused).
- ``budget``        ``{"times", "leaves"}``: the recent failures' times and the clean leaves
  (:mod:`elastic_train.rendezvous.budget`), written with ``failures`` or with a round a leave caused.
- ``left/<node>``   (own lease) ``{"time", "round", "reason"}``: the node left on purpose (SIGTERM,
  :mod:`elastic_train.rendezvous.leave`); the close of the next round uses and deletes it.
- ``closed``        ``{"reason": "finished"|"budget"|"failed", "message", "step", "time"}``: no more rounds.
- ``evictions``     ``{"times", "total"}``: the recent evictions of slow nodes and their count
  (:mod:`.slownodes`); ``evict/<node>`` (the decider's lease) the order to one, ``straggler/<node>`` a slow
  node's standing for ``status``.
- ``config``        ``{"failure_budget", "failure_window", "min_nodes", "max_nodes"}``: written once, by the
  first node.
- ``identity``      ``{"fingerprint", "settings", "time", "node"}``: the settings every node must share
  (:mod:`elastic_train.rendezvous.identity`), written once by the first node (:mod:`.claim`).

Lifecycle: waiting (no round yet) → running → finished | failed (``closed``). Once a run is closed, its
record keys move onto a lease of :data:`RUN_RECORD_TTL` (:mod:`.closing`).

Everything here is read back from etcd, where any process with access could have written it: each record
is decoded with its fields checked, and one that does not decode is treated as absent (a join) or as an
error of the run (the round record, which nothing can go on without).
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from elastic_train.etcd.client import Etcd, KeyValue
from elastic_train.node import seconds
from elastic_train.rendezvous import budget
from elastic_train.rendezvous.budget import BudgetRecord
from elastic_train.rendezvous.config import run_prefix
from elastic_train.rendezvous.decide import Joiner
from elastic_train.rendezvous.view import RunView

#: Seconds a closed run's record (closed mark, identity, last round, failures) stays in etcd.
RUN_RECORD_TTL = 7 * 24 * 3600
#: Keys of a run that are not on a node's lease (they outlive the nodes until the run is closed).
RUN_RECORD_KEYS = ("closed", "identity", "round", "failures", "budget", "config", "evictions")
#: Key group of the clean leaves' marks (:mod:`elastic_train.rendezvous.leave`).
LEFT = "left/"


def run_view(etcd: Etcd, run_id: str) -> RunView:
    """A (not yet started) watch-driven view of a run's keys, as a participant reads them."""
    return RunView(etcd, run_prefix(run_id), activity_prefixes=("nodes/", "join/"))


def new_node_id() -> str:
    """A node id unique per agent process: host, pid and a random suffix."""
    host = socket.gethostname().split(".")[0][:40] or "node"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def _object(raw: bytes) -> dict[str, Any]:
    """A JSON object read from etcd.

    Raises:
        ValueError: not JSON, or not an object.
    """
    try:
        d = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not JSON: {exc}") from exc
    if not isinstance(d, dict):
        raise ValueError(f"not a JSON object: {raw[:80]!r}")
    return d


def _count(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{what}: {v!r} is not a count")
    return v


@dataclass(frozen=True, slots=True)
class RoundRecord:
    """A closed round as stored in ``round``."""

    round: int
    members: list[str]
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    failure: bool = False
    kind: str = budget.SCALE
    """What brought the run here from the round before (:func:`~elastic_train.rendezvous.budget.
    transition_kind`: failure, leave or scale; the first round: scale)."""
    asked_at: float | None = None
    """Unix time the first of its nodes asked for this round (the start of the recovery it ends); ``None``
    when no join said."""

    def encode(self) -> bytes:
        return json.dumps(
            {"round": self.round, "members": self.members, "nodes": self.nodes, "failure": self.failure,
             "kind": self.kind, "asked": self.asked_at, "time": time.time()}
        ).encode()  # fmt: skip

    @staticmethod
    def decode(raw: bytes) -> RoundRecord:
        """The record in ``raw``.

        Raises:
            ValueError: not a round record (its round, members or node addresses malformed).
        """
        d = _object(raw)
        members = d.get("members")
        if not isinstance(members, list) or not all(isinstance(m, str) for m in members):
            raise ValueError(f"round record: members {members!r}")
        nodes = d.get("nodes", {})
        if not isinstance(nodes, dict) or not all(isinstance(v, dict) for v in nodes.values()):
            raise ValueError("round record: nodes")
        failure = d.get("failure") is True
        kind = d.get("kind")
        if kind not in budget.KINDS:  # a record without one (an older writer): what its failure flag says
            kind = budget.FAILURE if failure else budget.SCALE
        return RoundRecord(
            _count(d.get("round"), "round"), members, nodes, failure, str(kind), unix_time(d.get("asked"))
        )


def unix_time(v: Any) -> float | None:
    """A Unix time read from etcd (untrusted): a finite positive number, else ``None``."""
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
        return None
    return float(v)


@dataclass(frozen=True, slots=True)
class RoundResult:
    """What a participant got from a closed round."""

    round: int
    rank: int
    world_size: int
    members: list[str]
    nodes: dict[str, dict[str, Any]]


def parse_join(node: str, kv: KeyValue) -> Joiner:
    """The join key of ``node`` (``{"target", "reason", ...}``).

    Raises:
        ValueError: it does not decode (not a JSON object, or no target round).
    """
    d = _object(kv.value)
    code = d.get("exit_code")
    error = d.get("error") or ""
    return Joiner(
        node,
        _count(d.get("target"), "target"),
        str(d.get("reason", "start")),
        kv.create_revision,
        exit_code=code if isinstance(code, int) and not isinstance(code, bool) else None,
        error=str(error)[:2000],
        trained=d.get("trained") is True,
        ran_s=seconds(d.get("ran_s")),
        signature=str(d.get("signature") or "")[:2000],
        asked_at=unix_time(d.get("time")),
    )


def decode_join(node: str, kv: KeyValue) -> Joiner | None:
    """The join key of ``node`` (``{"target", "reason", ...}``), or None when it does not decode."""
    try:
        return parse_join(node, kv)
    except ValueError:
        return None


def finished_line(run_id: str, closed: Mapping[str, Any]) -> str:
    """What a node of a finished run says as it leaves (exit 0): the run, its last step, and when."""
    return (
        f"run {run_id} finished{at_step(closed)}{when(closed.get('time'))}; this node has nothing left to do"
    )


def at_step(closed: Mapping[str, Any]) -> str:
    """`` at step N`` when the closed mark says which step the run ended at."""
    step = closed.get("step")
    return f" at step {step}" if isinstance(step, int) and not isinstance(step, bool) else ""


def when(t: Any) -> str:
    """`` on 2026-12-01 06:40 UTC`` for a Unix time read from etcd (empty if it is not one)."""
    try:
        return time.strftime(" on %Y-%m-%d %H:%M UTC", time.gmtime(float(t)))
    except (TypeError, ValueError, OverflowError):
        return ""


class RunReader:
    """A run's records as a node's watched view holds them, decoded once per change of a key for every reader
    of the view (:meth:`RunView.decoded`, :meth:`RunView.decoded_under`: the participants of one process that
    share a view, as the scale benchmark runs them, decode a large round record or N joins once, not once
    each).

    Every method reads the view's copy, no etcd call: call it with ``view.cond`` held.
    """

    def __init__(self, view: RunView) -> None:
        self.view = view

    def round_record(self) -> tuple[RoundRecord | None, int]:
        """The last closed round and its key's mod revision (None, 0 before the first).

        Raises:
            ValueError: the ``round`` key holds no round record.
        """
        kv = self.view.get("round")
        if kv is None:
            return None, 0
        return self.view.decoded("round", RoundRecord.decode), kv.mod_revision

    def closed(self) -> dict[str, Any] | None:
        """The run's closed mark, if any (one that does not decode still closes the run)."""
        kv = self.view.get("closed")
        if kv is None:
            return None
        try:
            return _object(kv.value)
        except ValueError:
            return {"reason": "failed", "message": "(the run's closed mark is unreadable)"}

    def failures(self) -> int:
        """Failures the run spent."""
        kv = self.view.get("failures")
        try:
            return int(kv.value) if kv is not None else 0
        except ValueError:
            return 0

    def budget(self) -> BudgetRecord:
        """The run's failure-budget record (empty when absent or malformed)."""
        kv = self.view.get("budget")
        return BudgetRecord.decode(kv.value if kv is not None else None)

    def left(self) -> set[str]:
        """Nodes that said they leave the run (``left/`` marks: :mod:`elastic_train.rendezvous.leave`)."""
        return set(self.view.under(LEFT))

    def live(self) -> set[str]:
        """Nodes with a lease."""
        return set(self.view.under("nodes/"))

    def joins(self) -> dict[str, Joiner]:
        """Each node's join request (those that do not decode left out): the view's own copy, valid while
        ``view.cond`` is held; read it, do not mutate it."""
        return self.view.decoded_under("join/", parse_join)

    def node(self, node: str) -> dict[str, Any] | None:
        """``node``'s node key (its address and store port), or None."""
        kv = self.view.get("nodes/" + node)
        if kv is None:
            return None
        try:
            return _object(kv.value)
        except ValueError:
            return None
