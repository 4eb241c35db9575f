"""Hot recovery, the agent's side: membership changes handled by the workers in-process, not by a restart.

torchrun's agent restarts its worker group whenever ``num_nodes_waiting()`` is positive or a worker exits.
With hot recovery the ``etcd3`` handler keeps a change from torchrun while its workers can re-form in-process
(every local worker registered through the node's channel, :mod:`elastic_train.node`), and runs the round
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
Once it gave up (a fallback above, or the node's fence fired) the thread publishes nothing more; a round it
was joining meanwhile (a cut-off node's join waits for etcd) is handed to torchrun's ``next_rendezvous``,
which starts the new workers in it: joining a second time would leave the round's other members forming a
group with workers that never come. A member of a just-formed round that is gone before the agents
exchanged ranks (a second death during a re-formation) abandons that round, and the next one forms
in-process.

Hot recovery is on by default; the rdzv-conf key ``hot=0`` (job.yaml ``rendezvous.hot: false``) turns all of
it off.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from elastic_train.log import get_logger
from elastic_train.node import AgentChannel, Assignment
from elastic_train.rendezvous.errors import RunRefused
from elastic_train.rendezvous.protocol import Participant, RoundRecord, RoundResult
from elastic_train.torchcompat import TorchrunAgent, WorkerSlot, role_info_key

log = get_logger(__name__)

#: Seconds between two looks of the agent's thread at its channel and at the run's view.
TICK = 0.005
#: Seconds the workers get to reach a step boundary after a member of their round lost its lease, before the
#: agent restarts them (a peer that stopped, SIGSTOP or a partition, leaves them blocked in a collective).
LOST_GRACE = 1.0
#: Seconds the workers get to reach a step boundary after a newcomer or a member asked for a new round.
STEP_GRACE = 120.0
#: Seconds gloo workers blocked with a stopped peer get to ask for the next round once their agent asked them
#: to cut their group's connections (they fail at once), before the restart path.
CUT_GRACE = 1.0
#: Seconds the agents of a round formed here get to exchange their workers' ranks (all of them are at it
#: already). A member found gone meanwhile (lease expired, store port refused, or it asked for a newer round)
#: abandons the round at once and the others join the next one in-process; past this, the restart path.
ASSIGN_TIMEOUT = 10.0
#: Rounds one re-formation may abandon in a row (a member gone before the rank exchange) before it gives up.
MAX_ABANDONED = 3
#: Seconds between two probes of a member of the forming round that has not written its rank information.
PROBE_EVERY = 0.1
#: Seconds one probe of a member's store port may take (an unanswered one counts as alive: the lease decides).
PROBE_TIMEOUT = 0.2

Bootstrap = Callable[[RoundResult], tuple[Any, Any]]


class RoundAbandoned(Exception):
    """A member of the round just formed is gone before the agents exchanged their workers' ranks."""


class _Stopping(Exception):
    """The agent closes the hot path while its thread waits."""


class _GaveUp(Exception):
    """The hot path gave up while its thread waited for the round's rank exchange."""


class HotPath:
    """Re-forms this node's worker group in-process on membership changes (see the module docstring).

    Args:
        participant: returns this node's participant (created lazily by the handler).
        bootstrap: the round's agent store and workers' bootstrap info, as torchrun's path builds them.
        lock: held while any join runs (this thread's, or torchrun's ``next_rendezvous``).
        channel: the node's channel to its workers.
    """

    def __init__(
        self,
        participant: Callable[[], Participant],
        bootstrap: Bootstrap,
        lock: threading.Lock,
        channel: AgentChannel,
    ):
        self._participant = participant
        self._bootstrap = bootstrap
        self._lock = lock
        self.channel = channel
        self.round: int | None = None
        self.fallback: str | None = None
        self._agent: TorchrunAgent | None = None
        self._nproc = 0
        self._announced: tuple[float, float] | None = None  # (when, grace)
        #: When the workers were asked to cut their group's connections (a stopped peer), in this round.
        self._cut_at: float | None = None
        #: True while this node's workers finish no step for as long as the fence counts as a stall (the
        #: handler sets it to :meth:`Fence.workers_blocked`): after a member's lease expired, such workers
        #: wait in a collective with a stopped peer and reach no step boundary, so there is no grace to wait.
        self.blocked: Callable[[], bool] = lambda: False
        # give_up() and the publication of an assignment exclude each other: after give_up nothing is
        # published, and a round the thread joined meanwhile goes to torchrun's next_rendezvous (handoff)
        self._state = threading.RLock()
        self._handoff: RoundResult | None = None
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
        self.channel.start_group()
        self.round = result.round
        self.fallback = None
        self._announced = None
        self._cut_at = None
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
        self._agent = TorchrunAgent.find()
        # not under torchrun's agent: the restart path only
        self._nproc = self._agent.local_world_size if self._agent is not None else 0

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
            except (RunRefused, _Stopping):
                return
            except Exception as exc:  # never die silently: give the change to torchrun's path
                self.give_up(f"in-process re-formation failed: {exc!r}")

    def _tick(self) -> None:
        if not self.engaged():
            return
        assert self.round is not None
        asked = {r: q for r, q in self.channel.requests().items() if q.round >= self.round}
        if asked:
            dead = self._dead_workers()
            if dead:  # torchrun restarts the group when it sees them: no in-process round for the others
                self.give_up(f"local worker(s) {sorted(dead)} exited")
                return
            reason = next(iter(asked.values())).reason
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
        elif self._announced[1] <= LOST_GRACE and participant.lost_members() and self.blocked():
            # a stopped peer: no step boundary comes. gloo workers cut their group's connections when asked,
            # their collective fails and they ask for the next round (the tick above); others restart
            if self._cut_at is None and self.channel.cuttable():
                self._cut_at = now
                self.channel.cut(self.round)
                log.info("hot_links_cut", round=self.round, lost=sorted(participant.lost_members()))
            elif self._cut_at is None or now - self._cut_at > CUT_GRACE:
                after_cut = f", and still {CUT_GRACE:g} s after the cut" if self._cut_at is not None else ""
                self.give_up(
                    "workers blocked in a collective with a member whose lease expired (a stopped peer): "
                    f"no step boundary to wait for{after_cut}"
                )
        elif self._announced[1] > LOST_GRACE and (why := self._no_boundary_coming(participant)):
            # the workers cannot reach a step boundary: waiting the step grace would only delay the restart
            self._announced = (now, LOST_GRACE)
            log.info("hot_grace_shortened", round=self.round, why=why, grace_s=LOST_GRACE)
        elif now - self._announced[0] > self._announced[1]:
            self.give_up(
                f"workers did not reach a step boundary within {self._announced[1]:g} s of the change "
                "(a peer that stopped leaves them blocked in a collective)"
            )

    def _no_boundary_coming(self, participant: Participant) -> str | None:
        """Why this node's workers will not reach the step boundary the change waits for, or None.

        A member of the round that lost its lease after the change was announced (a peer that stopped or
        was cut off: the workers are blocked in a collective with it), or a member that asks for a newer
        round (it left this round: its workers exited, or its node was fenced and torchrun restarts them)
        while the workers still form the round's group, which then never completes, or while no step
        finished for a stall's length (:attr:`blocked`: they wait on the member's workers, which are gone).
        A member asking while the workers step is one whose workers reached the boundary first.
        """
        lost = participant.lost_members()
        if lost:
            return f"member(s) {sorted(lost)} lost their lease"
        assert self.round is not None
        left = sorted(m for m in asking_beyond(participant, self.round) if m in participant.members)
        left = [m for m in left if m != participant.node_id]
        if not left:
            return None
        if any(r.round < self.round for r in self.channel.ready().values()):
            return f"member(s) {left} asked for a newer round while the group of round {self.round} formed"
        if self.blocked():
            # formed, but the member's workers are gone: a collective (or a wait on the round's store) with
            # them does not return, and no step finished for a stall's length
            return f"member(s) {left} asked for a newer round while the workers are blocked"
        return None  # formed and stepping: they stop at their next step

    def _dead_workers(self) -> set[int]:
        """Local ranks whose registered process is gone (exited, or a zombie not reaped yet)."""
        import psutil

        dead = set()
        for rank, ready in self.channel.ready().items():
            try:
                if psutil.Process(ready.pid).status() == psutil.STATUS_ZOMBIE:
                    dead.add(rank)
            except psutil.Error:
                dead.add(rank)
        return dead

    def _reform(self, reason: str) -> None:
        started = time.perf_counter()
        old = self.round
        abandoned = 0
        with self._lock:
            participant = self._participant()
            while True:
                result = participant.join()
                joined = time.perf_counter()
                if self.fallback is not None:  # given up while the join ran (the fence fired): torchrun's
                    self._hand_over(result)  # path starts new workers in this round, it does not join again
                    return
                try:
                    try:
                        store, info = self._bootstrap(result)
                    except RuntimeError as exc:  # rank 0 vanished between close and connect
                        raise RoundAbandoned(f"the round's store on rank 0 is unreachable: {exc}") from exc
                    ranked = time.perf_counter()
                    workers = self._update_torchrun(result, store, info)
                    break
                except _GaveUp:
                    self._hand_over(result)
                    return
                except RoundAbandoned as exc:  # a member died after the round closed: the next one
                    abandoned += 1
                    log.warning("hot_round_abandoned", round=result.round, reason=str(exc))
                    if abandoned > MAX_ABANDONED:
                        raise RuntimeError(
                            f"{abandoned} rounds in a row lost a member before they formed"
                        ) from exc
            with self._state:
                if self.fallback is not None:
                    self._hand_over(result)
                    return
                self.round = result.round
                self._announced = None
                self._cut_at = None
                self.channel.assign(
                    Assignment(
                        round=result.round,
                        node_rank=result.rank,
                        nodes=result.world_size,
                        master_addr=str(info.master_addr),
                        master_port=int(info.master_port),
                        ranks=tuple(w.global_rank for w in workers),
                        world_size=workers[0].world_size,
                        reform=True,
                    )
                )
        log.info(
            "hot_round",
            from_round=old,
            round=result.round,
            rank=result.rank,
            nodes=result.world_size,
            reason=reason,
            abandoned=abandoned,
            join_s=round(joined - started, 3),
            ranks_s=round(time.perf_counter() - ranked, 3),
            seconds=round(time.perf_counter() - started, 3),
        )

    def _hand_over(self, result: RoundResult) -> None:
        """Keep ``result``, a round this thread joined after the hot path gave up, for torchrun's
        ``next_rendezvous`` (join lock held): its workers are stopped and new ones start in it. Joining
        again instead would leave the round's other members forming a group with workers that never come."""
        self._handoff = result
        log.info("hot_round_handed_over", round=result.round, rank=result.rank, reason=self.fallback)

    def take_handoff(self) -> RoundResult | None:
        """The round handed over to torchrun's path (join lock held), once, while it is still the run's
        newest round with every member alive; else None (join anew)."""
        result, self._handoff = self._handoff, None
        if result is None:
            return None
        participant = self._participant()
        latest = latest_round(participant)
        if latest != result.round or participant.lost_members():
            log.info("hot_handoff_stale", round=result.round, latest=latest)
            return None
        return result

    def _update_torchrun(self, result: RoundResult, store: Any, info: Any) -> list[WorkerSlot]:
        """Assign the workers' global ranks the way torchrun's agent does after its own rendezvous (its rank
        exchange through the round's store: every agent of the round takes part, also one that restarts or
        joins through torchrun's path), and make torchrun's record of the worker group that of the new round
        (ranks, world size, store): its exit barrier then waits for this round's nodes.

        Raises:
            RoundAbandoned: a member of the round is gone before it wrote its part (:meth:`_await_members`).
        """
        from torch.distributed.elastic.utils.store import store_timeout

        agent = self._agent
        assert agent is not None
        self._await_members(result, store)
        with store_timeout(store, ASSIGN_TIMEOUT):
            workers = agent.assign_ranks(store, result.rank, result.world_size)
        agent.adopt_round(result.rank, result.world_size, store, info.master_addr, info.master_port)
        return workers

    def _await_members(self, result: RoundResult, store: Any) -> None:
        """Wait, without blocking in the store, until every other agent of the round wrote its role for
        torchrun's rank exchange: then the exchange does not wait on a dead member (torch's blocking get
        would hold this thread for :data:`ASSIGN_TIMEOUT`, then the restart path).

        Raises:
            RoundAbandoned: a member that has not written its role is gone: its lease expired, its store
                port refuses connections (its agent died), or it asks for a newer round; or the round's
                store (on rank 0) is unreachable.
            RuntimeError: not every member wrote within :data:`ASSIGN_TIMEOUT` (the restart path).
        """
        if os.environ.get("TORCH_ELASTIC_WORKER_IDENTICAL", "0") == "1":
            return  # torch's fast path: no exchange through the store
        assert self._agent is not None
        # what the exchange writes first, written here so that the members waiting here see it
        try:
            self._agent.write_role_info(store, result.rank)
        except RuntimeError as exc:
            raise RoundAbandoned(f"the round's store on rank 0 is unreachable: {exc}") from exc
        keys = {i: role_info_key(i) for i in range(result.world_size) if i != result.rank}
        participant = self._participant()
        deadline = time.monotonic() + ASSIGN_TIMEOUT
        probed: dict[int, float] = {}
        while keys:
            try:
                keys = {i: k for i, k in keys.items() if not store.check([k])}
            except RuntimeError as exc:
                raise RoundAbandoned(f"the round's store on rank 0 is unreachable: {exc}") from exc
            if not keys:
                return
            lost = participant.lost_members()
            beyond = asking_beyond(participant, result.round)
            now = time.monotonic()
            for i in keys:
                node = result.members[i]
                if node in lost:
                    raise RoundAbandoned(f"member {node} (rank {i}) lost its lease")
                if node in beyond:
                    raise RoundAbandoned(f"member {node} (rank {i}) asks for a newer round")
                if now - probed.get(i, 0.0) >= PROBE_EVERY:
                    probed[i] = now
                    if store_refused(result.nodes.get(node) or {}):
                        raise RoundAbandoned(
                            f"member {node} (rank {i}): its agent is gone (store port refused)"
                        )
            if now > deadline:
                raise RuntimeError(
                    f"rank(s) {sorted(keys)} of round {result.round} did not exchange ranks within "
                    f"{ASSIGN_TIMEOUT:g} s"
                )
            if self.fallback is not None:
                raise _GaveUp
            if self._stop.wait(TICK):
                raise _Stopping

    def give_up(self, reason: str) -> None:
        """Leave this change (and every later one in this round) to torchrun's restart path. Once this
        returns no assignment is published: a round joined meanwhile is handed to torchrun's path, and
        the run's view no longer says that this node re-forms in-process."""
        with self._state:
            if self.fallback is not None:
                return
            self.fallback = reason
            self.channel.give_up(reason)
            log.warning("hot_fallback", round=self.round, reason=reason)
        # at once, not at the next monitor tick: a peer restarting its workers now must not start them on
        # standby for admission by this node's workers, which torchrun is about to restart too
        self._participant().advertise_inproc(False)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)


def latest_round(participant: Participant) -> int:
    """The newest closed round of the run, from the participant's view (0 before the first)."""
    with participant.view.cond:
        kv = participant.view.get("round")
    return RoundRecord.decode(kv.value).round if kv is not None else 0


def asking_beyond(participant: Participant, round: int) -> set[str]:
    """Live nodes whose join key asks for a round after ``round``, from the participant's view."""
    with participant.view.cond:
        live = set(participant.view.under("nodes/"))
        keys = participant.view.under("join/")
    out = set()
    for node, kv in keys.items():
        try:
            target = int(json.loads(kv.value)["target"])
        except (ValueError, KeyError, TypeError):
            continue
        if target > round and node in live:
            out.add(node)
    return out


def store_refused(node: dict[str, Any]) -> bool:
    """True when the node's agent store port (``{"addr", "store_port"}`` of a round record) refuses a TCP
    connection: its agent process is gone although its lease has not expired yet. An unanswered probe
    counts as alive (a stopped or cut-off node is left to its lease)."""
    try:
        addr, port = str(node["addr"]), int(node["store_port"])
    except (KeyError, TypeError, ValueError):
        return False
    if port <= 0:
        return False
    try:
        socket.create_connection((addr, port), timeout=PROBE_TIMEOUT).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False
