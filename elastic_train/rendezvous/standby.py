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
3. Once every local worker is ready, a thread of the agent joins the next round through the hot path
   (:meth:`~elastic_train.rendezvous.hot.HotPath.admit`): the running nodes see a newcomer, stop at their
   next step boundary and re-form in-process; the round's agents exchange ranks, torchrun's record of the
   worker group becomes the round's, and the assignment goes to the standby workers, which form the group
   and restore (a joiner gets the state by broadcast from a holder).

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

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

from elastic_train.log import bind_context, get_logger
from elastic_train.node import Assignment
from elastic_train.rendezvous.errors import (
    FailureBudgetExhausted,
    RendezvousClosed,
    RunRefused,
    StandbyFailed,
)
from elastic_train.rendezvous.hot import TICK, HotPath
from elastic_train.rendezvous.protocol import Participant, RoundResult

log = get_logger(__name__)

#: Seconds a standby worker waits for its admission beyond the join timeout (ranks, the group's forming).
ADMIT_MARGIN = 60.0
#: Standby starts in a row whose workers failed before admission, after which the node leaves (status 1).
STANDBY_ATTEMPTS = 3


class Standby:
    """Starts this node's workers on standby when it joins a running job (see the module docstring).

    Args:
        hot: the node's hot path (its channel and its in-process round).
        participant: returns this node's participant (created lazily by the handler, with its store).
        store: returns the agent's own TCPStore (created with the participant).
        addr: the address this node's workers bootstrap their provisional group at.
        arm: resets the node's fence for a new worker group.
        join_timeout: the rendezvous join timeout (a standby worker waits that long and a margin).
    """

    def __init__(
        self,
        hot: HotPath,
        participant: Callable[[], Participant],
        store: Callable[[], Any],
        addr: str,
        arm: Callable[[], None],
        join_timeout: float,
    ) -> None:
        self._hot = hot
        self._participant = participant
        self._store = store
        self._addr = addr
        self._arm = arm
        self._wait = join_timeout + ADMIT_MARGIN
        self._generation = 0
        self._waiting = False
        #: Standby starts in a row whose workers failed before they were admitted.
        self.failed_starts = 0

    def start(self) -> RendezvousInfo | None:
        """The provisional rendezvous of a standby start, or ``None``: join the next round as usual.

        Called by the handler's ``next_rendezvous`` before it joins (under torchrun's agent, whose worker
        group the hot path finds on the stack).

        Raises:
            RunRefused, RendezvousClosed: this node must not take part (from the participant's start).
            StandbyFailed: the standby workers failed before admission :data:`STANDBY_ATTEMPTS` times in a
                row.
        """
        if self._waiting:  # torchrun asks again while the last standby workers waited: they failed
            self.failed_starts += 1
            report = self._participant().failure_report or {}
            code = f"exit code {report['exit_code']}" if report else "a worker exited"
            last = str(report.get("error") or code)
            log.warning("standby_failed", attempt=self.failed_starts, of=STANDBY_ATTEMPTS, error=last)
            if self.failed_starts >= STANDBY_ATTEMPTS:
                self._generation += 1  # the last admission thread stops at its next look
                self._waiting = False
                raise StandbyFailed(
                    f"this node's workers failed {self.failed_starts} times in a row before the running job "
                    f"admitted them ({last}); the job trains on without this node"
                )
        self._generation += 1
        self._waiting = False
        participant = self._participant()
        participant.start()
        current = participant.standby_round()
        if current is None:
            return None
        self._hot.started(RoundResult(current, 0, 1, [participant.node_id], {}))
        workers = self._hot.local_workers
        if workers == 0:  # not under torchrun's agent: nobody to hand a round to in-process
            return None
        store = dist.PrefixStore(f"elastic_train/standby/{self._generation}/", self._store())
        info = RendezvousStoreInfo.build(0, store, local_addr=self._addr)
        self._hot.channel.assign(
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
        self._arm()
        self._waiting = True
        bind_context(round=current, node=participant.node_id)
        log.info("standby_start", round=current, workers=workers, node=participant.node_id)
        threading.Thread(
            target=self._admit, args=(self._generation, workers), name="standby-admission", daemon=True
        ).start()
        return RendezvousInfo(store, 0, 1, info)

    def monitor(self, engaged: bool) -> bool:
        """Called every torchrun monitor tick: say in etcd whether this node's workers re-form in-process
        (``engaged``); True while its standby workers wait for admission (torchrun must leave them be)."""
        self._participant().advertise_inproc(engaged and self._hot.fallback is None)
        return self._waiting

    def _admit(self, generation: int, workers: int) -> None:
        """Wait until every local worker is built, then join the next round for them (a thread)."""
        hot, participant = self._hot, self._participant()
        started = time.monotonic()
        try:
            while len(hot.channel.standbys()) < workers:
                time.sleep(TICK)
                if generation != self._generation:
                    return  # torchrun started another worker group (a standby worker died)
                if hot.fallback is not None:
                    return
                participant.check_open()
            if not all(_alive(s.pid) for s in hot.channel.standbys().values()):
                return  # a worker died after it was built: torchrun restarts the group
            built = time.monotonic()
            hot.admit(f"{workers} standby worker(s) ready")
            self.failed_starts = 0
            log.info(
                "standby_admitted",
                round=hot.round,
                build_s=round(built - started, 3),
                admission_s=round(time.monotonic() - built, 3),
            )
        except RendezvousClosed as exc:  # the run finished without this node: one line, workers exit 0
            if generation != self._generation:
                return  # this start is over (its workers failed, the node left): nothing to end
            sys.stderr.write(f"elastic-train: {exc}\n")
            sys.stderr.flush()
            hot.channel.end(str(exc))
        except (RunRefused, FailureBudgetExhausted) as exc:
            # the restart path's next join raises it again, with its line and exit status
            hot.give_up(f"admission refused: {exc}")
        except Exception as exc:  # never die silently: the restart path takes over
            hot.give_up(f"admission failed: {exc!r}")
        finally:
            if generation == self._generation:
                self._waiting = False


def _alive(pid: Any) -> bool:
    """Whether process ``pid`` runs (a zombie not reaped yet does not)."""
    import psutil

    try:
        return psutil.Process(int(pid)).status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, TypeError, ValueError):
        return False
