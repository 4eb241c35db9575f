"""Standby start: a node that joins a running job starts its workers once, and they join at a step boundary.

Without it, a joining node's agent joins the next round first: the running nodes stop at a step boundary at
once, and the new group cannot form until torchrun has started the joiner's workers, which import torch and
build the model meanwhile (tens of seconds on a loaded machine, minutes for a large model). With hot recovery
on, the ``etcd3`` handler instead gives such a node a *standby* start:

1. ``next_rendezvous()`` sees a running round that this node is not training in (a newcomer, or a member
   whose own workers died) and whose live members all re-form in-process (they say so in etcd,
   ``inproc/<node>``, :meth:`~elastic_train.rendezvous.protocol.Participant.advertise_inproc`). It joins
   nothing: torchrun gets a provisional rendezvous of this node alone (a prefix of the agent's own store,
   a fresh bootstrap port) and starts the workers with an assignment that says so (``standby_s``).
2. The workers import, build model, optimizer and data, and report ready on the node's channel
   (:class:`~elastic_train.node.Standby`); the running job trains all along.
3. Once every local worker is ready, the hot path's thread (:mod:`elastic_train.rendezvous.hot`, which
   observes :meth:`Standby.pending`) joins the next round for them: the running nodes see a newcomer, stop
   at their next step boundary and re-form in-process; the round's agents exchange ranks, torchrun's record
   of the worker group becomes the round's, and the assignment goes to the standby workers, which form the
   group and restore (a joiner gets the state by broadcast from a holder).

Only when every live member re-forms in-process: a script that does not use ``elastic_train.run`` would
otherwise train on its own in the provisional world. If the run ends before the node is admitted, the agent
says so in one line and the workers exit with status 0; any other failure of the admission goes the restart
path (``hot_fallback``: the workers exit, torchrun starts them again and the next start decides afresh).

Standby workers that fail before they are admitted (an error while building, a worker killed) are started
again on standby: they cost the running job nothing. After :data:`STANDBY_ATTEMPTS` such failures in a row
the node leaves with one line and exit status 1 (:class:`~elastic_train.rendezvous.errors.StandbyFailed`)
instead of looping: a script that cannot build would fail the same way again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

from elastic_train.log import bind_context, get_logger
from elastic_train.node import AgentChannel, Assignment
from elastic_train.rendezvous.errors import StandbyFailed
from elastic_train.rendezvous.fence import Fence
from elastic_train.rendezvous.protocol import Participant

log = get_logger(__name__)

#: Seconds a standby worker waits for its admission beyond the join timeout (ranks, the group's forming).
ADMIT_MARGIN = 60.0
#: Standby starts in a row whose workers failed before admission, after which the node leaves (status 1).
STANDBY_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class Pending:
    """A standby start whose workers wait for admission."""

    generation: int
    """Which start (torchrun may start the workers again meanwhile)."""
    needed: int
    """Local workers to admit."""


class Standby:
    """This node's standby starts (see the module docstring).

    Args:
        participant: this node in the run.
        channel: the node's channel to its workers.
        store: the agent's own TCPStore (the provisional round's store is a prefix of it).
        addr: the address this node's workers bootstrap their provisional group at.
        fence: the node's fence (reset for a new worker group).
        join_timeout: the rendezvous join timeout (a standby worker waits that long and a margin).
    """

    def __init__(
        self,
        participant: Participant,
        channel: AgentChannel,
        store: Any,
        addr: str,
        fence: Fence,
        join_timeout: float,
    ) -> None:
        self.participant = participant
        self.channel = channel
        self._store = store
        self._addr = addr
        self._fence = fence
        self._wait = join_timeout + ADMIT_MARGIN
        self._generation = 0
        self._pending: Pending | None = None
        #: Standby starts in a row whose workers failed before they were admitted.
        self.failed_starts = 0
        #: When the last standby start began (``time.monotonic()``).
        self.started_at = 0.0

    def eligible(self) -> int | None:
        """The running round this node may start its workers on standby for, or None: join the next round as
        usual. Called by the handler's ``next_rendezvous`` before it joins.

        Raises:
            RunRefused, RendezvousClosed: this node must not take part (from the participant's start).
            StandbyFailed: the standby workers failed before admission :data:`STANDBY_ATTEMPTS` times in a
                row.
        """
        if self._pending is not None:  # torchrun asks again while the last standby workers waited: failed
            self.failed_starts += 1
            report = self.participant.failure_report or {}
            code = f"exit code {report['exit_code']}" if report else "a worker exited"
            last = str(report.get("error") or code)
            log.warning("standby_failed", attempt=self.failed_starts, of=STANDBY_ATTEMPTS, error=last)
            if self.failed_starts >= STANDBY_ATTEMPTS:
                self._generation += 1
                self._pending = None
                raise StandbyFailed(
                    f"this node's workers failed {self.failed_starts} times in a row before the running job "
                    f"admitted them ({last}); the job trains on without this node"
                )
        self._generation += 1
        self._pending = None
        self.participant.start()
        return standby_round(self.participant)

    def begin(self, current: int, workers: int) -> RendezvousInfo:
        """Start ``workers`` local workers on standby while round ``current`` trains: the provisional
        rendezvous of this node alone, and the assignment that tells the workers so."""
        store = dist.PrefixStore(f"elastic_train/standby/{self._generation}/", self._store)
        info = RendezvousStoreInfo.build(0, store, local_addr=self._addr)
        self.channel.assign(
            Assignment(
                round=current,
                node_rank=0,
                nodes=1,
                master_addr=str(info.master_addr),
                master_port=int(info.master_port),
                standby_s=float(round(self._wait)),
                reform=True,
            )
        )
        self._fence.arm()
        self.started_at = time.monotonic()
        self._pending = Pending(self._generation, workers)
        node = self.participant.node_id
        bind_context(round=current, node=node)
        log.info("standby_start", round=current, workers=workers, node=node)
        return RendezvousInfo(store, 0, 1, info)

    @property
    def waiting(self) -> bool:
        """True while this node's standby workers wait for admission (torchrun must leave them be)."""
        return self._pending is not None

    def pending(self) -> Pending | None:
        """The standby start waiting for admission, if any (what the hot path observes)."""
        return self._pending

    def admitted(self, generation: int) -> None:
        """The workers of standby start ``generation`` joined the running job."""
        if generation == self._generation:
            self.failed_starts = 0

    def done(self, generation: int) -> bool:
        """Standby start ``generation`` no longer waits (admitted, or given up); False when it was not the
        current start any more (torchrun started the workers again meanwhile)."""
        if generation != self._generation or self._pending is None:
            return False
        self._pending = None
        return True


def standby_round(participant: Participant) -> int | None:
    """The run's last round when ``participant``'s node may start its workers on standby for the next one:
    the run is open, and every live member of that round other than this node (at least one) re-forms
    in-process (``inproc/<node>``), so its workers will admit this node's at a step boundary. ``None``
    otherwise (start as usual).

    A member whose lease is gone does not count: the others re-form without it now, and a node that joined
    their round instead of building on standby would make that recovery wait for its own workers' start-up
    (they would form the new group with workers still importing and building). Should the others give up
    on re-forming in-process (a stopped peer they cannot cut loose), they withdraw ``inproc`` at once.
    """
    run = participant.run
    with run.view.cond:
        if run.closed() is not None:
            return None
        rec, _ = run.round_record()
        if rec is None:
            return None
        live = run.live()
        others = [m for m in rec.members if m != participant.node_id and m in live]
        inproc = run.view.under("inproc/")
        return rec.round if others and all(m in inproc for m in others) else None
