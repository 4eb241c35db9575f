"""Hot recovery, the agent's side: membership changes handled by the workers in-process, not by a restart.

torchrun's agent restarts its worker group whenever ``num_nodes_waiting()`` is positive or a worker exits.
With hot recovery the ``etcd3`` handler keeps a change from torchrun while its workers can re-form in-process
(every local worker registered through the node's channel, :mod:`elastic_train.reform`), and runs the round
itself, on a thread of the agent:

1. a local worker reports that its group broke (a collective failed: a peer died), or the run's watch shows
   a change of this node's round (a member's lease expired, a newcomer or a member asks for the next round:
   then the workers are told to stop at their next step boundary and report);
2. the thread joins the next round (the same :class:`~elastic_train.rendezvous.protocol.Participant` and
   the same rules as torchrun's path), sets up the round's bootstrap store, updates torchrun's own record of
   the worker group (ranks, world size, store: its exit barrier then counts the nodes that are there), and
   publishes the assignment to the local workers, which form the new group in-process.

Anything the workers cannot handle in-process takes the restart path, with one ``hot_fallback`` event
saying why: a worker that exits (torchrun sees it), workers that do not stop within a grace period after a
member's lease expired (a hung peer blocks a gloo collective that cannot be aborted in-process), workers that
never registered (a script of its own that does not use :func:`elastic_train.elastic.run`, an NCCL group).
The rdzv-conf key ``hot=0`` (job.yaml ``rendezvous.hot: false``) turns all of it off.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from elastic_train.envvars import ENV_REFORM_DIR, ENV_ROUND
from elastic_train.log import get_logger
from elastic_train.reform import Assignment, Channel
from elastic_train.rendezvous.errors import RunRefused
from elastic_train.rendezvous.protocol import Participant, RoundResult

log = get_logger(__name__)

#: Seconds between two looks of the agent's thread at its channel and at the run's view.
TICK = 0.005
#: Seconds the workers get to reach a step boundary after a member of their round lost its lease, before the
#: agent restarts them (a peer that stopped, SIGSTOP or a partition, leaves them blocked in a collective).
LOST_GRACE = 1.0
#: Seconds the workers get to reach a step boundary after a newcomer or a member asked for a new round.
STEP_GRACE = 120.0
#: Seconds the agents of a round formed here get to exchange their workers' ranks (all of them are at it
#: already; a member that died after the round closed fails it, and the restart path takes over).
ASSIGN_TIMEOUT = 10.0

Bootstrap = Callable[[RoundResult], tuple[Any, Any]]


class HotPath:
    """Re-forms this node's worker group in-process on membership changes (see the module docstring).

    Args:
        participant: returns this node's participant (created lazily by the handler).
        bootstrap: the round's agent store and workers' bootstrap info, as torchrun's path builds them.
        lock: held while any join runs (this thread's, or torchrun's ``next_rendezvous``).
        lease_ttl: the run's lease TTL (how fast a lost member shows).
    """

    def __init__(self, participant: Callable[[], Participant], bootstrap: Bootstrap, lock: threading.Lock):
        self._participant = participant
        self._bootstrap = bootstrap
        self._lock = lock
        self.directory = tempfile.mkdtemp(prefix=f"elastic_train-reform-{os.getpid()}-")
        os.environ[ENV_REFORM_DIR] = self.directory
        self.channel = Channel(self.directory)
        self.round: int | None = None
        self.fallback: str | None = None
        self._group: Any = None
        self._agent: Any = None
        self._nproc = 0
        self._announced: tuple[float, float] | None = None  # (when, grace)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- torchrun's path ---------------------------------------------------------------------------------
    def started(self, result: RoundResult) -> None:
        """torchrun starts a new worker group in round ``result`` (its first, or a restart): forget the old
        workers' records and follow the new ones."""
        if self.fallback is None and self.round is not None and self.channel.ready():
            # torchrun restarted workers that re-form in-process: one of them exited (an error no
            # re-formation fixes, a crash): torchrun's failure summary says which
            log.warning("hot_fallback", round=self.round, reason="a worker exited; torchrun restarts them")
        self.channel.reset()
        self.round = result.round
        self.fallback = None
        self._announced = None
        self._find_agent()
        if self._thread is None and self._nproc > 0:
            self._thread = threading.Thread(target=self._loop, name="hot-recovery", daemon=True)
            self._thread.start()

    @property
    def local_workers(self) -> int:
        """Workers of torchrun's worker group on this node (0: not under torchrun's agent)."""
        return self._nproc

    def admit(self, reason: str) -> None:
        """Join the next round for this node's standby workers and hand it to them
        (:mod:`elastic_train.rendezvous.standby`): the round as an in-process re-formation forms it."""
        self._reform(reason)

    def _find_agent(self) -> None:
        """torchrun's agent and worker group, from the frames calling ``next_rendezvous`` (torch passes the
        handler neither): their record of ranks and store is updated after a round formed here."""
        frame = sys._getframe(1)
        while frame is not None:
            group = frame.f_locals.get("worker_group")
            agent = frame.f_locals.get("self")
            if (
                group is not None
                and hasattr(group, "group_world_size")
                and hasattr(group, "spec")
                and hasattr(agent, "_assign_worker_ranks")
            ):
                self._group, self._agent = group, agent
                self._nproc = int(group.spec.local_world_size)
                return
            frame = frame.f_back  # type: ignore[assignment]
        self._nproc = 0  # not under torchrun's agent: the restart path only

    def engaged(self) -> bool:
        """True while this node's workers re-form in-process (torchrun is then not told of changes)."""
        if self.fallback is not None or self._nproc == 0 or self.round is None:
            return False
        return len(self.channel.ready()) >= self._nproc

    # -- the thread --------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.wait(TICK):
            try:
                self._tick()
            except RunRefused:
                return
            except Exception as exc:  # never die silently: give the change to torchrun's path
                self.give_up(f"in-process re-formation failed: {exc!r}")

    def _tick(self) -> None:
        if not self.engaged():
            return
        assert self.round is not None
        asked = {r: d for r, d in self.channel.requests().items() if d["round"] >= self.round}
        if asked:
            dead = self._dead_workers()
            if dead:  # torchrun restarts the group when it sees them: no in-process round for the others
                self.give_up(f"local worker(s) {sorted(dead)} exited")
                return
            reason = str(next(iter(asked.values())).get("reason") or "")
            self._reform(reason)
            return
        participant = self._participant()
        if participant.num_waiting() == 0:
            return
        now = time.monotonic()
        if self._announced is None:
            lost = participant.lost_members()
            grace = LOST_GRACE if lost else STEP_GRACE
            self._announced = (now, grace)
            self.channel.announce(self.round)
            log.info("hot_change_announced", round=self.round, lost=sorted(lost), grace_s=grace)
        elif now - self._announced[0] > self._announced[1]:
            self.give_up(
                f"workers did not reach a step boundary within {self._announced[1]:g} s of the change "
                "(a peer that stopped leaves them blocked in a collective)"
            )

    def _dead_workers(self) -> set[int]:
        """Local ranks whose registered process is gone (exited, or a zombie not reaped yet)."""
        import psutil

        dead = set()
        for rank, d in self.channel.registered().items():
            try:
                if psutil.Process(int(d.get("pid") or 0)).status() == psutil.STATUS_ZOMBIE:
                    dead.add(rank)
            except (psutil.Error, ValueError):
                dead.add(rank)
        return dead

    def _reform(self, reason: str) -> None:
        started = time.perf_counter()
        old = self.round
        with self._lock:
            participant = self._participant()
            while True:
                result = participant.join()
                joined = time.perf_counter()
                try:
                    store, info = self._bootstrap(result)
                    break
                except RuntimeError as exc:  # rank 0 vanished between close and connect: join again
                    log.warning("rendezvous_store_unreachable", round=result.round, error=str(exc))
            ranked = time.perf_counter()
            workers = self._update_torchrun(result, store, info)
        os.environ[ENV_ROUND] = str(result.round)
        self.round = result.round
        self._announced = None
        self.channel.publish(
            Assignment(
                round=result.round,
                node_rank=result.rank,
                nodes=result.world_size,
                ranks=[w.global_rank for w in sorted(workers, key=lambda w: w.local_rank)],
                world_size=workers[0].world_size,
                master_addr=str(info.master_addr),
                master_port=int(info.master_port),
            )
        )
        log.info(
            "hot_round",
            from_round=old,
            round=result.round,
            rank=result.rank,
            nodes=result.world_size,
            reason=reason,
            join_s=round(joined - started, 3),
            ranks_s=round(time.perf_counter() - ranked, 3),
            seconds=round(time.perf_counter() - started, 3),
        )

    def _update_torchrun(self, result: RoundResult, store: Any, info: Any) -> list[Any]:
        """Assign the workers' global ranks the way torchrun's agent does after its own rendezvous (its
        ``_assign_worker_ranks`` through the round's store: every agent of the round takes part, also one
        that restarts or joins through torchrun's path), and make torchrun's record of the worker group that
        of the new round (ranks, world size, store): its exit barrier then waits for this round's nodes."""
        from torch.distributed.elastic.utils.store import store_timeout

        group, agent = self._group, self._agent
        with store_timeout(store, ASSIGN_TIMEOUT):
            workers = agent._assign_worker_ranks(store, result.rank, result.world_size, group.spec)
        for old, new in zip(sorted(group.workers, key=lambda w: w.local_rank), workers, strict=True):
            old.global_rank, old.role_rank = new.global_rank, new.role_rank
            old.world_size, old.role_world_size = new.world_size, new.role_world_size
        group.group_rank, group.group_world_size, group.store = result.rank, result.world_size, store
        group.master_addr, group.master_port = info.master_addr, info.master_port
        agent._store = store
        return list(workers)

    def give_up(self, reason: str) -> None:
        """Leave this change (and every later one in this round) to torchrun's restart path."""
        if self.fallback is None:
            self.fallback = reason
            self.channel.give_up(reason)
            log.warning("hot_fallback", round=self.round, reason=reason)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        shutil.rmtree(self.directory, ignore_errors=True)
