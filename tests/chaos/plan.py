"""Seeded random fault plans for the chaos suite (pure: a seed always gives the same plan).

The plan keeps the job able to continue: node faults only while more than ``min_nodes`` are alive, a hung node
is resumed later in the plan, joins only below ``max_nodes``, a partitioned node heals by itself. Faults are
spaced so each recovery is measured before the next fault lands.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from elastic_train.launch.faults import COLLISION_KINDS, Fault

#: Every kind the chaos suite injects; the last three are chaos-only actions (see test_chaos.py).
#: ``restart-etcd`` goes to runs on one etcd member, the etcd cluster kinds to runs on three.
CHAOS_KINDS = (
    "kill-worker",
    "kill-node",
    "hang-node",
    "add-node",
    "restart-etcd",
    "kill-during-checkpoint",
    "corrupt-checkpoint",
    "storage-outage",
    "kill-etcd-leader",
    "etcd-quorum-loss",
    "partition-etcd",  # a node's etcd traffic dropped for a while, then healed: it fences itself and rejoins
    *COLLISION_KINDS,  # operator mistakes: a node with the job's run id and another checkpoint URL/node range
)


@dataclass(frozen=True, slots=True)
class PlanSpec:
    steps: int
    initial_nodes: int
    min_nodes: int
    max_nodes: int
    faults: int
    checkpoint_every: int
    first_step: int = 6
    spacing: int = 8


def etcd_members(seed: int) -> int:
    """Members of the etcd a chaos run uses: every other seed (the odd ones) runs on a 3-member cluster."""
    return 3 if seed % 2 else 1


def hot_recovery(seed: int) -> bool:
    """Whether a chaos run has hot recovery on (``rendezvous.hot``). It is a job setting (every node of a run
    gets the same ``--set``), so the mix is per run: two seeds in three re-form in-process (0, 2, 3, 5, 6 …),
    the others take the restart path (1, 4, 7, 10 …). The rule is independent of :func:`etcd_members` and of
    the partition seeds, so both paths meet each etcd fault and the partition within a dozen seeds, and
    ``make chaos`` (seeds 0..4) runs both; seed 0 (``make test``) runs hot."""
    return seed % 3 != 1


def sharded(seed: int) -> bool:
    """Whether a chaos run shards its model (``train.fsdp`` with ``checkpoint.shard_replicas: 1``): two seeds
    in five (2, 4, 7, 9, 12 …). Independent of :func:`hot_recovery`, :func:`etcd_members` and the partition
    seeds (2, 6, 10 …): both layouts meet each of them within a dozen seeds, ``make chaos`` (seeds 0..4) runs
    both, and seed 0 (``make test``) runs the replicated (DDP) layout."""
    return seed % 5 in (2, 4)


def make_plan(seed: int, spec: PlanSpec) -> list[Fault]:
    """A list of faults for one chaos run; node indices follow launch order (joiners get new indices).

    On a 3-member etcd (:func:`etcd_members`), the etcd faults are a leader kill and a quorum loss instead of
    a restart of the single member, and the plan starts with one of them.
    """
    rng = random.Random(seed)
    etcd_kinds = ["restart-etcd"] if etcd_members(seed) == 1 else ["kill-etcd-leader", "etcd-quorum-loss"]
    alive = list(range(spec.initial_nodes))
    next_index = spec.initial_nodes
    hung: list[int] = []
    cut: list[int] = []  # partitioned nodes: they come back by themselves, but are not picked again
    plan: list[Fault] = []
    step = spec.first_step + rng.randrange(3)
    if etcd_members(seed) > 1:
        # every 3-member run opens with an etcd fault, the two kinds taking turns (seeds 1, 5, 9 … a leader
        # kill; 3, 7, 11 … a quorum loss), so that a handful of seeds covers both
        plan.append(Fault(kind=etcd_kinds[(seed // 2) % 2], step=step))
        step += spec.spacing + rng.randrange(3)
    if etcd_members(seed) == 1 and seed % 4 == 2:
        # every other single-member run opens with a partition (seeds 2, 6, 10 …), so a handful of seeds
        # covers it; a node that is cut off comes back by itself and is not picked again
        node = rng.choice(alive)
        alive.remove(node)
        cut.append(node)
        plan.append(Fault(kind="partition-etcd", node=node, step=step))
        step += spec.spacing + rng.randrange(3)
    while len(plan) < spec.faults and step < spec.steps - spec.spacing:
        if hung and rng.random() < 0.6:
            node = hung.pop()
            plan.append(Fault(kind="resume-node", node=node, step=step))
            alive.append(node)
            step += spec.spacing + rng.randrange(3)
            continue
        can_lose = len(alive) > spec.min_nodes
        can_add = len(alive) + len(hung) + len(cut) < spec.max_nodes
        kinds = ["kill-worker", *etcd_kinds, "corrupt-checkpoint", "storage-outage"]
        kinds.append(COLLISION_KINDS[step % len(COLLISION_KINDS)])  # one weight for both collision kinds
        if can_lose:
            kinds += ["kill-node", "hang-node", "kill-during-checkpoint"]
        if can_add:
            kinds += ["add-node", "add-node"]
        kind = rng.choice(kinds)
        if kind in ("kill-node", "hang-node", "kill-during-checkpoint", "partition-etcd"):
            node = rng.choice(alive)
            alive.remove(node)
            if kind == "hang-node":
                hung.append(node)
            if kind == "partition-etcd":
                cut.append(node)
            if kind == "kill-during-checkpoint":
                # the step right after a durable checkpoint is due: its async write is in flight
                step = max(step, ((step // spec.checkpoint_every) + 1) * spec.checkpoint_every)
                if step >= spec.steps - spec.spacing:
                    break
            plan.append(Fault(kind=kind, node=node, step=step))
        elif kind == "kill-worker":
            plan.append(Fault(kind=kind, node=rng.choice(alive), step=step))
        elif kind == "add-node":
            plan.append(Fault(kind=kind, step=step))
            alive.append(next_index)
            next_index += 1
        else:
            plan.append(Fault(kind=kind, step=step))
        step += spec.spacing + rng.randrange(3)
    for node in hung:  # a hung node never left hanging: it comes back before the end
        if step < spec.steps - 2:
            plan.append(Fault(kind="resume-node", node=node, step=step))
            step += spec.spacing
    return plan
