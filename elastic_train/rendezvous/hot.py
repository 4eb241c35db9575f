"""Hot recovery, the agent's side: membership changes handled by the workers in-process, not by a restart.

torchrun's agent restarts its worker group whenever ``num_nodes_waiting()`` is positive or a worker exits.
With hot recovery the ``etcd3`` handler keeps a change from torchrun while its workers can re-form in-process
(every local worker registered through the node's channel, :mod:`elastic_train.node`), and a thread of the
agent, :class:`HotPath`, runs the change: every few milliseconds it observes the node (the run's view, its
workers, its fence, its standby workers), asks :func:`decide` what to do, and does it:

- *announce*: the run's watch shows a change of this node's round (a member's lease expired, a newcomer or
  a member asks for the next round): the workers stop at their next step boundary and ask for the next
  round;
- *re-form*: a local worker asked (its group broke, or it stopped at the boundary): the thread joins the next
  round (the same :class:`~elastic_train.rendezvous.protocol.Participant` and rules as torchrun's path),
  sets up the round's bootstrap store, exchanges ranks with the round's other agents through torchrun's own
  exchange (:mod:`elastic_train.rendezvous.exchange`) and assigns the round to its workers, which form the
  new group in-process;
- *admit*: this node's standby workers are built (:mod:`elastic_train.rendezvous.standby`): the same round,
  joined for them;
- *cut*, *shorten*, *give up*: workers blocked with a stopped peer are asked to cut their group's
  connections; a grace that cannot end in a step boundary is shortened; what the workers cannot handle
  in-process goes the restart path, with one ``hot_fallback`` event saying why.

Once it gave up (the decision, or the node's fence fired: :meth:`HotPath.give_up`) the thread publishes
nothing more; a round it was joining meanwhile (a cut-off node's join waits for etcd) is handed to torchrun's
``next_rendezvous``, which starts the new workers in it: joining a second time would leave the round's other
members forming a group with workers that never come. A member of a just-formed round that is gone before
the agents exchanged ranks (a second death during a re-formation) abandons that round, and the next one forms
in-process.

The decision is a pure function from one :class:`Observation` to one :class:`Action`, after the pattern of
torch's dynamic rendezvous (``_Action`` and its executor): nothing in it reads a clock, a file or etcd, so its
rules are tested as tables of observations (tests/unit/test_hotdecide.py).

Hot recovery is on by default; the rdzv-conf key ``hot=0`` (job.yaml ``rendezvous.hot: false``) turns all of
it off.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from enum import Enum

from elastic_train.log import get_logger
from elastic_train.node import AgentChannel, Assignment, Ready
from elastic_train.procs import running
from elastic_train.rendezvous.errors import FailureBudgetExhausted, NodeLeft, RendezvousClosed, RunRefused
from elastic_train.rendezvous.exchange import RoundAbandoned, RoundStores, exchange_ranks
from elastic_train.rendezvous.fence import Fence
from elastic_train.rendezvous.protocol import Participant
from elastic_train.rendezvous.records import RoundResult
from elastic_train.rendezvous.standby import Standby
from elastic_train.torchcompat import TorchrunAgent

log = get_logger(__name__)

#: Seconds the workers get to reach a step boundary after a member of their round lost its lease, before the
#: agent restarts them (a peer that stopped, SIGSTOP or a partition, leaves them blocked in a collective).
LOST_GRACE = 1.0
#: Seconds the workers get to reach a step boundary after a newcomer or a member asked for a new round.
STEP_GRACE = 120.0
#: Seconds gloo workers blocked with a stopped peer get to ask for the next round once their agent asked them
#: to cut their group's connections (they fail at once), before the restart path.
CUT_GRACE = 1.0


class Act(Enum):
    """What the hot path can do."""

    NOTHING = "nothing"
    ANNOUNCE = "announce"
    """Tell the workers their group re-forms at the next step boundary, with a grace to reach it."""
    CUT = "cut"
    """Ask the workers to cut their group's connections (a stopped peer blocks their collective)."""
    SHORTEN = "shorten"
    """No step boundary is coming: wait :data:`LOST_GRACE` instead of the step grace."""
    REFORM = "reform"
    """Join the next round and hand it to the workers, which asked for it."""
    ADMIT = "admit"
    """Join the next round for the standby workers, which are built."""
    END = "end"
    """The run ended before the standby workers were admitted: they exit with status 0."""
    GIVE_UP = "give_up"
    """Leave the change to torchrun's restart path."""


@dataclass(frozen=True, slots=True)
class Action:
    """One action and what it needs: a reason (re-form, end, give up, shorten) or a grace (announce)."""

    act: Act
    reason: str = ""
    grace: float = 0.0


NOTHING = Action(Act.NOTHING)


@dataclass(frozen=True, slots=True)
class StandbyState:
    """This node's standby workers, while they build (a node joining a running job)."""

    needed: int
    """Local workers of the group."""
    ready: int
    """Of them, built and asking for admission."""
    alive: bool = True
    """Every one that asked still runs."""
    finished: str | None = None
    """The run finished meanwhile: the line a node of a finished run says."""
    refused: str | None = None
    """The run failed, or its failure budget is spent: why."""
    generation: int = 0
    """Which standby start of this node (its executor's bookkeeping; the decision does not read it)."""


@dataclass(frozen=True, slots=True)
class Observation:
    """What the hot path sees at one look."""

    now: float
    """The monotonic clock."""
    round: int | None = None
    """The round this node's workers train in (None before torchrun started any)."""
    engaged: bool = False
    """Every local worker re-forms in-process, and the hot path has not given up."""
    asked: str | None = None
    """Why a local worker asked for the next round (its group broke, or it stopped at a step boundary)."""
    dead: tuple[int, ...] = ()
    """Registered local workers whose process is gone (looked at when one asked)."""
    waiting: int = 0
    """The run's view says this node's round is obsolete (a member lost, re-joining, a newcomer)."""
    lost: tuple[str, ...] = ()
    """Members of the round whose lease expired."""
    own_lost: bool = False
    """This node is one of them: it was stopped (SIGSTOP, a hung machine) or cut off from etcd for longer
    than its lease, and the other members went on without it."""
    left: tuple[str, ...] = ()
    """Other members of the round that ask for a newer round."""
    forming: bool = False
    """A local worker is still at an older round: the round's group is still forming."""
    blocked: bool = False
    """The fence saw no step for a stall's length: the workers wait in a collective."""
    cuttable: bool = False
    """Every registered worker cuts its group's connections when asked (gloo)."""
    announced_at: float | None = None
    """When the change was announced to the workers (None: not yet)."""
    grace: float = 0.0
    """The grace the announcement gave them."""
    cut_at: float | None = None
    """When the workers were asked to cut their group's connections, in this round."""
    standby: StandbyState | None = None
    """Set while standby workers wait for admission."""


#: Why a node whose own lease expired falls back: it was stopped or cut off, not one of its peers.
OWN_LEASE_EXPIRED = "this node's own lease expired (it was stopped, or cut off from etcd)"
WENT_ON_WITHOUT_IT = (
    "members that went on without this node (its own lease expired: it was stopped, or cut off)"
)


def decide(o: Observation) -> Action:
    """The hot path's next action (see the module docstring and docs/rendezvous.md, *Hot recovery*).

    In order: standby workers are admitted once all are built (or told the run ended); a local worker that
    asked for the next round gets it (unless a registered worker died: torchrun restarts them all); a change
    of the round is announced, with a short grace when a member's lease expired; workers blocked with a
    stopped peer are asked to cut their links, and restarted if that does not free them; a grace that can no
    longer end in a step boundary is shortened; a grace that ran out gives up.
    """
    if o.standby is not None:
        return _admission(o.standby)
    if not o.engaged or o.round is None:
        return NOTHING
    if o.asked is not None:
        if o.dead:  # torchrun restarts the group when it sees them: no in-process round for the others
            return Action(Act.GIVE_UP, f"local worker(s) {list(o.dead)} exited")
        return Action(Act.REFORM, o.asked)
    if o.waiting == 0:
        return NOTHING
    if o.announced_at is None:
        return Action(Act.ANNOUNCE, grace=LOST_GRACE if o.lost else STEP_GRACE)
    if o.grace <= LOST_GRACE and o.blocked and (o.lost or (o.left and not o.forming)):
        # no step boundary comes: a stopped peer, or a member whose workers stopped at the boundary before
        # this node's heard of the change (theirs went on into the next step's collective, which waits for
        # the gone workers). gloo workers cut their group's connections when asked, their collective fails
        # and they ask for the next round; others restart
        if o.cut_at is None and o.cuttable:
            return Action(Act.CUT)
        if o.cut_at is None or o.now - o.cut_at > CUT_GRACE:
            after_cut = f", and still {CUT_GRACE:g} s after the cut" if o.cut_at is not None else ""
            if o.own_lost:
                whom = WENT_ON_WITHOUT_IT
            elif o.lost:
                whom = "a member whose lease expired (a stopped peer)"
            else:
                whom = f"member(s) {sorted(o.left)} that left the round"
            return Action(
                Act.GIVE_UP,
                f"workers blocked in a collective with {whom}: no step boundary to wait for{after_cut}",
            )
        return NOTHING
    if o.grace > LOST_GRACE and (why := no_boundary_coming(o)) is not None:
        # the workers cannot reach a step boundary: waiting the step grace would only delay the restart
        return Action(Act.SHORTEN, why, grace=LOST_GRACE)
    if o.now - o.announced_at > o.grace:
        if o.own_lost:
            return Action(
                Act.GIVE_UP,
                f"{OWN_LEASE_EXPIRED}; its workers reached no step boundary within {o.grace:g} s of the "
                "change (the other members went on without it)",
            )
        return Action(
            Act.GIVE_UP,
            f"workers did not reach a step boundary within {o.grace:g} s of the change "
            "(a peer that stopped leaves them blocked in a collective)",
        )
    return NOTHING


def no_boundary_coming(o: Observation) -> str | None:
    """Why the workers will not reach the step boundary the change waits for, or None.

    A member of the round that lost its lease (a peer that stopped or was cut off: the workers are blocked
    in a collective with it), or a member that asks for a newer round (it left this round: its workers
    exited, or its node was fenced and torchrun restarts them) while the workers still form the round's
    group, which then never completes, or while no step finished for a stall's length (they wait on the
    member's workers, which are gone). A member asking while the workers step is one whose workers reached
    the boundary first.
    """
    if o.lost:
        return f"member(s) {sorted(o.lost)} lost their lease"
    if not o.left:
        return None
    left = sorted(o.left)
    if o.forming:
        return f"member(s) {left} asked for a newer round while the group of round {o.round} formed"
    if o.blocked:
        # formed, but the member's workers are gone: a collective (or a wait on the round's store) with them
        # does not return, and no step finished for a stall's length
        return f"member(s) {left} asked for a newer round while the workers are blocked"
    return None  # formed and stepping: they stop at their next step


def _admission(s: StandbyState) -> Action:
    if s.finished is not None:
        return Action(Act.END, s.finished)
    if s.refused is not None:  # the restart path's next join says it again, with its line and status
        return Action(Act.GIVE_UP, f"admission refused: {s.refused}")
    if s.ready < s.needed or not s.alive:  # still building; or one died: torchrun restarts the group
        return NOTHING
    return Action(Act.ADMIT, f"{s.needed} standby worker(s) ready")


# -- the executor -----------------------------------------------------------------------------------------

#: Seconds between two looks of the agent's thread at its node.
TICK = 0.005
#: Rounds one re-formation may abandon in a row (a member gone before the rank exchange) before it gives up.
MAX_ABANDONED = 3


class _Stopping(Exception):
    """The agent closes the hot path while its thread waits."""


class _GaveUp(Exception):
    """The hot path gave up while its thread waited for the round's rank exchange."""


class HotPath:
    """Re-forms this node's worker group in-process on membership changes (see the module docstring).

    Args:
        participant: this node in the run.
        channel: the node's channel to its workers.
        fence: the node's fence (whether the workers are blocked).
        standby: the node's standby starts (None: a node that never starts on standby).
        stores: the round's store and the workers' bootstrap address, as torchrun's path builds them.
        lock: held while any join runs (this thread's, or torchrun's ``next_rendezvous``).
    """

    def __init__(
        self,
        participant: Participant,
        channel: AgentChannel,
        fence: Fence,
        standby: Standby | None,
        stores: RoundStores,
        lock: threading.Lock,
    ):
        self.participant = participant
        self.channel = channel
        self.fence = fence
        self.standby = standby
        self.stores = stores
        self._lock = lock
        self.round: int | None = None
        self.fallback: str | None = None
        self._agent: TorchrunAgent | None = None
        self._nproc = 0
        self._announced_at: float | None = None
        self._grace = 0.0
        #: When the workers were asked to cut their group's connections (a stopped peer), in this round.
        self._cut_at: float | None = None
        # give_up() and the publication of an assignment exclude each other: after give_up nothing is
        # published, and a round the thread joined meanwhile goes to torchrun's next_rendezvous (handoff)
        self._state = threading.RLock()
        self._handoff: RoundResult | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- torchrun's path ---------------------------------------------------------------------------------
    def started(self, result: RoundResult) -> None:
        """torchrun starts a new worker group in round ``result`` (its first, a restart, or a standby start):
        forget the old workers' re-formation and follow the new ones."""
        if self.fallback is None and self.round is not None and self.channel.ready():
            # torchrun restarted workers that re-form in-process: one of them exited (an error no
            # re-formation fixes, a crash): torchrun's failure summary says which
            log.warning("hot_fallback", round=self.round, reason="a worker exited; torchrun restarts them")
        self.channel.start_group()
        self.round = result.round
        self.fallback = None
        self._announced_at, self._grace, self._cut_at = None, 0.0, None
        self._agent = TorchrunAgent.find()  # torch passes the handler neither agent nor worker group
        self._nproc = self._agent.local_world_size if self._agent is not None else 0
        if self._thread is None and self._nproc > 0:
            self._thread = threading.Thread(target=self._loop, name="hot-recovery", daemon=True)
            self._thread.start()

    @property
    def local_workers(self) -> int:
        """Workers of torchrun's worker group on this node (0: not under torchrun's agent)."""
        return self._nproc

    def engaged(self, ready: dict[int, Ready] | None = None) -> bool:
        """True while this node's workers re-form in-process (torchrun is then not told of changes)."""
        if self.fallback is not None or self._nproc == 0 or self.round is None:
            return False
        return len(self.channel.ready() if ready is None else ready) >= self._nproc

    # -- the executor ------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.wait(TICK):
            try:
                observation = self.observe()
                self._act(decide(observation), observation)
            except (RunRefused, NodeLeft, _Stopping):  # refused, or this node left the run (SIGTERM)
                return
            except Exception as exc:  # never die silently: give the change to torchrun's path
                self.give_up(f"in-process re-formation failed: {exc!r}")

    def observe(self) -> Observation:
        """What the node looks like now (see :class:`Observation`)."""
        now = time.monotonic()
        standby = self._standby_state()
        if standby is not None:
            return Observation(now, self.round, standby=standby)
        ready = self.channel.ready()
        round = self.round
        if round is None or not self.engaged(ready):
            return Observation(now, round)
        asked = [q for _, q in sorted(self.channel.requests().items()) if q.round >= round]
        if asked:
            dead = tuple(r for r, m in sorted(ready.items()) if not running(m.pid))
            return Observation(now, round, engaged=True, asked=asked[0].reason, dead=dead)
        p = self.participant
        waiting = p.num_waiting()
        if waiting == 0:
            return Observation(now, round, engaged=True)
        if self.channel.finished() is not None:  # the workers' training ended: nothing re-forms
            return Observation(now, round)
        left = (p.asking_beyond(round) & set(p.members)) - {p.node_id}
        lost = tuple(sorted(p.lost_members()))
        return Observation(
            now,
            round,
            engaged=True,
            waiting=waiting,
            lost=lost,
            own_lost=p.node_id in lost,
            left=tuple(sorted(left)),
            forming=any(r.round < round for r in ready.values()),
            blocked=self.fence.workers_blocked(),
            cuttable=all(r.cut for r in ready.values()),
            announced_at=self._announced_at,
            grace=self._grace,
            cut_at=self._cut_at,
        )

    def _standby_state(self) -> StandbyState | None:
        standby = self.standby
        pending = standby.pending() if standby is not None and self.fallback is None else None
        if pending is None:
            return None
        built = self.channel.standbys()
        finished = refused = None
        try:
            self.participant.check_open()
        except RendezvousClosed as exc:
            finished = str(exc)
        except (RunRefused, FailureBudgetExhausted) as exc:
            refused = str(exc)
        alive = len(built) < pending.needed or all(running(s.pid) for s in built.values())
        return StandbyState(pending.needed, len(built), alive, finished, refused, pending.generation)

    def _act(self, action: Action, o: Observation) -> None:
        act = action.act
        if act is Act.NOTHING:
            return
        if act is Act.ANNOUNCE:
            assert o.round is not None
            self._announced_at, self._grace = o.now, action.grace
            self.channel.announce(o.round)
            log.info("hot_change_announced", round=o.round, lost=list(o.lost), grace_s=action.grace)
        elif act is Act.CUT:
            assert o.round is not None
            self._cut_at = o.now
            self.channel.cut(o.round)
            log.info("hot_links_cut", round=o.round, lost=list(o.lost))
        elif act is Act.SHORTEN:
            self._announced_at, self._grace = o.now, action.grace
            log.info("hot_grace_shortened", round=o.round, why=action.reason, grace_s=action.grace)
        elif act is Act.REFORM:
            self._reform(action.reason)
        elif act is Act.ADMIT:
            assert o.standby is not None
            self._admit(action.reason, o.standby.generation)
        elif act is Act.END:
            assert o.standby is not None
            self._end(action.reason, o.standby.generation)
        else:
            self.give_up(action.reason)

    def _pause(self) -> None:
        """Between two looks while the round's agents exchange ranks: stop waiting once the hot path gave up
        or closes."""
        if self.fallback is not None:
            raise _GaveUp
        if self._stop.wait(TICK):
            raise _Stopping

    def _reform(self, reason: str) -> None:
        """Join the next round, exchange ranks with its other agents, assign it to the workers."""
        started = time.perf_counter()
        old = self.round
        abandoned = 0
        agent = self._agent
        assert agent is not None
        with self._lock:
            while True:
                result = self.participant.join()
                joined = time.perf_counter()
                if self.fallback is not None:  # given up while the join ran (the fence fired): torchrun's
                    self._hand_over(result)  # path starts new workers in this round, it does not join again
                    return
                try:
                    try:
                        store, info = self.stores.bootstrap(result)
                    except RuntimeError as exc:  # rank 0 vanished between close and connect
                        raise RoundAbandoned(f"the round's store on rank 0 is unreachable: {exc}") from exc
                    ranked = time.perf_counter()
                    workers = exchange_ranks(agent, self.participant, result, store, info, self._pause)
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
                self.fence.joined(self.participant.losses_at_round)
                self._announced_at, self._grace, self._cut_at = None, 0.0, None
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

    def _admit(self, reason: str, generation: int) -> None:
        """Join the next round for this node's standby workers and hand it to them: the round forms as an
        in-process re-formation does."""
        assert self.standby is not None
        built = time.monotonic()
        try:
            self._reform(reason)
            self.standby.admitted(generation)
            log.info(
                "standby_admitted",
                round=self.round,
                build_s=round(built - self.standby.started_at, 3),
                admission_s=round(time.monotonic() - built, 3),
            )
        except RendezvousClosed as exc:  # the run finished without this node: one line, workers exit 0
            self._end(str(exc), generation)
        except (RunRefused, FailureBudgetExhausted) as exc:
            # the restart path's next join raises it again, with its line and exit status
            self.give_up(f"admission refused: {exc}")
        except Exception as exc:  # never die silently: the restart path takes over
            self.give_up(f"admission failed: {exc!r}")
        finally:
            self.standby.done(generation)

    def _end(self, line: str, generation: int) -> None:
        """The run finished before this node's standby workers were admitted: say so, and let them exit 0."""
        assert self.standby is not None
        if self.standby.done(generation):  # still this start's (its workers did not fail meanwhile)
            sys.stderr.write(f"elastic-train: {line}\n")
            sys.stderr.flush()
            self.channel.end(line)

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
        latest = self.participant.latest_round()
        if latest != result.round or self.participant.lost_members():
            log.info("hot_handoff_stale", round=result.round, latest=latest)
            return None
        return result

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
        self.participant.advertise_inproc(False)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)
