"""A clean leave: a node told to stop (SIGTERM: a preemption, a drain, a resize down, a deleted pod) says so
in etcd before its workers stop, so that its departure is not counted as a failure.

The state is already in memory on every survivor (DDP replicas, snapshotted every step), so a leave costs the
job at most the step in flight, like a crash, but it says nothing about the job's health: a job on spot or
preemptible nodes leaves and rejoins all the time. :func:`announce` writes, in one transaction,

- ``left/<node>`` ``{"time", "round", "reason"}`` on a lease of its own (:func:`left_ttl`), and
- the deletion of the node's ``nodes/``, ``join/`` and ``inproc/`` keys,

so every other node sees the departure and its reason in the same watch event, then revokes the node's lease.
The next round's close reads the marks (:func:`elastic_train.rendezvous.budget.transition_kind`), counts the
leave apart from the failures and deletes the marks it used.

:class:`LeaveOnSignal` calls it from the agent's main thread when SIGTERM arrives, before torchrun's own
handler (which it wraps) stops the workers: the mark reaches the others before their collectives break.
"""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from elastic_train.etcd.client import Etcd, op_delete, op_put
from elastic_train.etcd.errors import EtcdError
from elastic_train.log import get_logger
from elastic_train.rendezvous.records import LEFT

log = get_logger(__name__)

#: Least seconds a leave mark lives: the next round may close much later (the survivors wait below
#: ``min_nodes`` for a replacement, up to ``join_timeout``); the close that uses a mark deletes it.
LEFT_TTL_MIN = 3600


def left_ttl(join_timeout: float) -> int:
    """Seconds a leave mark lives: past any wait of the survivors for the round that follows it."""
    return max(LEFT_TTL_MIN, math.ceil(2 * join_timeout))


class _Settings(Protocol):
    run_id: str
    join_timeout: float


class Leaver(Protocol):
    """What :func:`announce` uses of a :class:`~elastic_train.rendezvous.protocol.Participant`."""

    etcd: Etcd
    prefix: str
    node_id: str
    round: int | None
    leaving: bool

    @property
    def s(self) -> _Settings: ...

    def leave(self) -> None: ...


def announce(participant: Leaver, reason: str, *, final: bool = True) -> bool:
    """Mark ``participant``'s node as leaving the run on purpose, and take it out of the run at once.

    After this the participant writes nothing more: it joins no round (``join`` raises
    :class:`~elastic_train.rendezvous.errors.NodeLeft`) and its lease is revoked. Returns False when the
    node has not taken part in a round yet (nothing to leave: its keys go with its lease) or etcd failed
    (then the others see it lost when its lease expires: a failure, as before). ``final``: the process
    leaves with it (False: an evicted node, which may rejoin under a new participant).
    """
    p = participant
    if p.leaving:
        return False
    p.leaving = True
    if p.round is None:
        p.leave()
        return False
    mark = {"time": time.time(), "round": p.round, "reason": reason}
    try:
        lease = p.etcd.lease_grant(left_ttl(p.s.join_timeout))
        p.etcd.txn(
            [],
            [
                op_put(p.prefix + LEFT + p.node_id, json.dumps(mark).encode(), lease),
                *(op_delete(p.prefix + group + p.node_id) for group in ("nodes/", "join/", "inproc/")),
            ],
        )
    except EtcdError as exc:
        log.warning("rendezvous_leave_unmarked", node=p.node_id, error=str(exc))
        p.leave()
        return False
    global _announced
    _announced = _announced or final
    log.info("rendezvous_node_left", node=p.node_id, round=p.round, reason=reason, run_id=p.s.run_id)
    p.leave()
    return True


_announced = False


def announced() -> bool:
    """Whether this process marked its node's clean leave (the launcher's last line says so)."""
    return _announced


Handler = Callable[[int, Any], Any] | int | None


class LeaveOnSignal:
    """Runs ``leave`` once when SIGTERM arrives, then whatever handled SIGTERM before (torchrun's agent
    installs its own each time it starts workers: :meth:`arm` wraps the current one again, on the main
    thread only, where Python runs signal handlers)."""

    def __init__(self, leave: Callable[[str], object], signum: int = signal.SIGTERM) -> None:
        self._leave = leave
        self._signum = signum
        self._previous: Handler = signal.SIG_DFL
        self.fired = False

    def arm(self) -> None:
        """Wrap the signal's current handler (cheap when already wrapped; a no-op off the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return
        current = signal.getsignal(self._signum)
        if current == self._on_signal:
            return
        self._previous = current
        signal.signal(self._signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if not self.fired:
            self.fired = True
            try:
                self._leave(signal.Signals(signum).name)
            except Exception as exc:  # never keep the node from stopping
                log.warning("rendezvous_leave_failed", error=repr(exc))
        previous = self._previous
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:  # the default action: end the process by the signal
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
