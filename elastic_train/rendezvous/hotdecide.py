"""What the agent's hot path does next: one pure function from what it observes to one action.

The hot path (:mod:`elastic_train.rendezvous.hot`) looks at its node every few milliseconds: the run's view
(members, leases, who asks for a newer round), its workers (registered for in-process re-formation, asking
for the next round, alive, on standby) and its fence (no step for a stall's length). :func:`decide` turns one
such :class:`Observation` into one :class:`Action`; the executor carries it out and remembers what it did
(the announcement and its grace, the cut). Nothing here reads a clock, a file or etcd, so the rules are
tested as tables of observations (tests/unit/test_hotdecide.py), after the pattern of torch's dynamic
rendezvous (``_Action`` and its executor).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

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
    if o.grace <= LOST_GRACE and o.lost and o.blocked:
        # a stopped peer: no step boundary comes. gloo workers cut their group's connections when asked,
        # their collective fails and they ask for the next round; others restart
        if o.cut_at is None and o.cuttable:
            return Action(Act.CUT)
        if o.cut_at is None or o.now - o.cut_at > CUT_GRACE:
            after_cut = f", and still {CUT_GRACE:g} s after the cut" if o.cut_at is not None else ""
            return Action(
                Act.GIVE_UP,
                "workers blocked in a collective with a member whose lease expired (a stopped peer): "
                f"no step boundary to wait for{after_cut}",
            )
        return NOTHING
    if o.grace > LOST_GRACE and (why := no_boundary_coming(o)) is not None:
        # the workers cannot reach a step boundary: waiting the step grace would only delay the restart
        return Action(Act.SHORTEN, why, grace=LOST_GRACE)
    if o.now - o.announced_at > o.grace:
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
