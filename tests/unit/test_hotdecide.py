"""The hot path's decision as a table: what the agent observes → the one action it takes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from elastic_train.rendezvous.hot import (
    CUT_GRACE,
    LOST_GRACE,
    NOTHING,
    STEP_GRACE,
    Act,
    Action,
    Observation,
    StandbyState,
    decide,
)

NOW = 1000.0
#: Workers that re-form in-process, in round 2, nothing happening.
CALM = Observation(NOW, round=2, engaged=True)
#: The run's view says the round changed.
CHANGED = replace(CALM, waiting=1)
#: ... and the workers were told, with the step grace.
ANNOUNCED = replace(CHANGED, announced_at=NOW - 0.5, grace=STEP_GRACE)
#: A member's lease expired, the workers were told with the short grace.
LOST = replace(CHANGED, lost=("c",), announced_at=NOW - 0.2, grace=LOST_GRACE)

#: This node's own lease expired (stopped, or cut off from etcd), the workers told with the short grace.
OWN_LOST = replace(LOST, lost=("a", "c"), own_lost=True)

STOPPED_PEER = (
    "workers blocked in a collective with a member whose lease expired (a stopped peer): no step boundary "
    "to wait for"
)

TABLE: list[tuple[str, Observation, Action]] = [
    # -- nothing to do
    ("not under torchrun's agent, or before the first round", Observation(NOW), NOTHING),
    ("workers that do not re-form in-process: torchrun's path",
     replace(CHANGED, engaged=False, asked="Connection reset by peer"), NOTHING),
    ("re-forming workers, the round current", CALM, NOTHING),
    # -- a worker asks
    ("a worker's group broke: re-form", replace(CALM, asked="Connection reset by peer"),
     Action(Act.REFORM, "Connection reset by peer")),
    ("a worker stopped at the announced boundary: re-form", replace(ANNOUNCED, asked="membership change"),
     Action(Act.REFORM, "membership change")),
    ("a worker asked, another one died: torchrun restarts them all",
     replace(CALM, asked="Connection reset by peer", dead=(1,)),
     Action(Act.GIVE_UP, "local worker(s) [1] exited")),
    # -- the round changed
    ("a newcomer or a member asks: announce with the step grace", CHANGED,
     Action(Act.ANNOUNCE, grace=STEP_GRACE)),
    ("a member's lease expired: announce with the short grace", replace(CHANGED, lost=("c",)),
     Action(Act.ANNOUNCE, grace=LOST_GRACE)),
    ("announced, the workers still step towards the boundary", ANNOUNCED, NOTHING),
    ("the step grace ran out", replace(ANNOUNCED, announced_at=NOW - STEP_GRACE - 0.01),
     Action(Act.GIVE_UP, "workers did not reach a step boundary within 120 s of the change (a peer that "
                         "stopped leaves them blocked in a collective)")),
    # -- no boundary coming: shorten the step grace
    ("a member's lease expired after the announcement", replace(ANNOUNCED, lost=("c",)),
     Action(Act.SHORTEN, "member(s) ['c'] lost their lease", grace=LOST_GRACE)),
    ("a member left the round while its group still forms", replace(ANNOUNCED, left=("c",), forming=True),
     Action(Act.SHORTEN, "member(s) ['c'] asked for a newer round while the group of round 2 formed",
            grace=LOST_GRACE)),
    ("a member left a formed round, the workers finish no step",
     replace(ANNOUNCED, left=("c",), blocked=True),
     Action(Act.SHORTEN, "member(s) ['c'] asked for a newer round while the workers are blocked",
            grace=LOST_GRACE)),
    ("a member asks while the workers step: it reached the boundary first", replace(ANNOUNCED, left=("c",)),
     NOTHING),
    # -- a member's workers stopped at the boundary, this node's went on into the next step's collective
    ("a member left, workers blocked after the shortened grace, gloo: cut their links",
     replace(ANNOUNCED, left=("c",), blocked=True, cuttable=True, grace=LOST_GRACE), Action(Act.CUT)),
    ("a member left, workers blocked after the shortened grace, NCCL: restart",
     replace(ANNOUNCED, left=("c",), blocked=True, grace=LOST_GRACE),
     Action(Act.GIVE_UP, "workers blocked in a collective with member(s) ['c'] that left the round: no step "
                         "boundary to wait for")),
    ("a member left, cut, and still blocked past the grace",
     replace(ANNOUNCED, left=("c",), blocked=True, cuttable=True, grace=LOST_GRACE,
             cut_at=NOW - CUT_GRACE - 0.01),
     Action(Act.GIVE_UP, "workers blocked in a collective with member(s) ['c'] that left the round: no step "
                         "boundary to wait for, and still 1 s after the cut")),
    ("a member left while the group forms: no collective to cut",
     replace(ANNOUNCED, left=("c",), forming=True, blocked=True, cuttable=True, grace=LOST_GRACE,
             announced_at=NOW - 0.1), NOTHING),
    # -- a stopped peer
    ("lost member, workers still stepping within the short grace", LOST, NOTHING),
    ("lost member, the short grace ran out", replace(LOST, announced_at=NOW - LOST_GRACE - 0.01),
     Action(Act.GIVE_UP, "workers did not reach a step boundary within 1 s of the change (a peer that "
                         "stopped leaves them blocked in a collective)")),
    ("lost member, workers blocked, gloo: cut their links", replace(LOST, blocked=True, cuttable=True),
     Action(Act.CUT)),
    ("lost member, workers blocked, NCCL: restart", replace(LOST, blocked=True),
     Action(Act.GIVE_UP, STOPPED_PEER)),
    ("cut, the workers get a grace to fail and ask",
     replace(LOST, blocked=True, cuttable=True, cut_at=NOW - 0.5), NOTHING),
    ("cut, and still blocked past the grace",
     replace(LOST, blocked=True, cuttable=True, cut_at=NOW - CUT_GRACE - 0.01),
     Action(Act.GIVE_UP, f"{STOPPED_PEER}, and still 1 s after the cut")),
    # -- this node's own lease expired (it was stopped or cut off): the others went on without it
    ("own lease expired, workers still stepping within the short grace", OWN_LOST, NOTHING),
    ("own lease expired, the short grace ran out", replace(OWN_LOST, announced_at=NOW - LOST_GRACE - 0.01),
     Action(Act.GIVE_UP, "this node's own lease expired (it was stopped, or cut off from etcd); its workers "
                         "reached no step boundary within 1 s of the change (the other members went on "
                         "without it)")),
    ("own lease expired, workers blocked, gloo: cut their links",
     replace(OWN_LOST, blocked=True, cuttable=True), Action(Act.CUT)),
    ("own lease expired, workers blocked, NCCL: restart", replace(OWN_LOST, blocked=True),
     Action(Act.GIVE_UP, "workers blocked in a collective with members that went on without this node (its "
                         "own lease expired: it was stopped, or cut off): no step boundary to wait for")),
    # -- standby workers (a node joining a running job)
    ("standby workers still building", Observation(NOW, 3, standby=StandbyState(needed=2, ready=1)), NOTHING),
    ("all standby workers built: admit", Observation(NOW, 3, standby=StandbyState(needed=2, ready=2)),
     Action(Act.ADMIT, "2 standby worker(s) ready")),
    ("built, but one died since: torchrun restarts them",
     Observation(NOW, 3, standby=StandbyState(needed=2, ready=2, alive=False)), NOTHING),
    ("the run finished before admission",
     Observation(NOW, 3, standby=StandbyState(needed=2, ready=0, finished="run r finished at step 9")),
     Action(Act.END, "run r finished at step 9")),
    ("the run failed before admission",
     Observation(NOW, 3, standby=StandbyState(needed=2, ready=2, refused="run r failed: x")),
     Action(Act.GIVE_UP, "admission refused: run r failed: x")),
]  # fmt: skip


@pytest.mark.parametrize(
    ("observation", "action"), [(o, a) for _, o, a in TABLE], ids=[n for n, _, _ in TABLE]
)
def test_each_observation_has_its_action(observation: Observation, action: Action) -> None:
    assert decide(observation) == action


def test_a_shortened_grace_is_not_shortened_again() -> None:
    shortened = replace(ANNOUNCED, lost=("c",), grace=LOST_GRACE, announced_at=NOW - 0.1)
    assert decide(shortened) == NOTHING
    assert decide(replace(shortened, announced_at=NOW - LOST_GRACE - 0.01)).act is Act.GIVE_UP
