"""The chaos plan generator itself (fast, runs in every test run)."""

from __future__ import annotations

import pytest

from tests.chaos.plan import CHAOS_KINDS, PlanSpec, make_plan

SPEC = PlanSpec(steps=120, initial_nodes=3, min_nodes=2, max_nodes=4, faults=8, checkpoint_every=10)


def test_same_seed_same_plan() -> None:
    assert [f.label for f in make_plan(7, SPEC)] == [f.label for f in make_plan(7, SPEC)]
    assert [f.label for f in make_plan(7, SPEC)] != [f.label for f in make_plan(8, SPEC)]


@pytest.mark.parametrize("seed", range(40))
def test_plan_keeps_the_job_alive(seed: int) -> None:
    plan = make_plan(seed, SPEC)
    assert plan, "a plan injects faults"
    alive, hung, nodes = set(range(3)), set(), 3
    last = 0
    for f in plan:
        assert f.kind in CHAOS_KINDS or f.kind == "resume-node"
        assert f.step >= last and f.step < SPEC.steps
        last = f.step
        if f.kind in ("kill-node", "hang-node", "kill-during-checkpoint"):
            assert f.node in alive
            alive.discard(f.node)
            assert len(alive) >= SPEC.min_nodes
            if f.kind == "hang-node":
                hung.add(f.node)
            if f.kind == "kill-during-checkpoint":
                assert f.step % SPEC.checkpoint_every == 0
        elif f.kind == "resume-node":
            assert f.node in hung
            hung.discard(f.node)
            alive.add(f.node)
        elif f.kind == "add-node":
            alive.add(nodes)
            nodes += 1
            assert len(alive) + len(hung) <= SPEC.max_nodes
        elif f.kind == "kill-worker":
            assert f.node in alive
    assert not hung, "every hung node is resumed"


def test_plans_cover_every_kind() -> None:
    seen = {f.kind for seed in range(40) for f in make_plan(seed, SPEC)}
    assert set(CHAOS_KINDS) <= seen


def test_three_member_runs_open_with_an_etcd_fault() -> None:
    from tests.chaos.plan import etcd_members

    assert [etcd_members(s) for s in range(4)] == [1, 3, 1, 3]
    assert make_plan(1, SPEC)[0].kind == "kill-etcd-leader"
    assert make_plan(3, SPEC)[0].kind == "etcd-quorum-loss"
    for seed in range(40):
        kinds = {f.kind for f in make_plan(seed, SPEC)}
        if etcd_members(seed) == 1:
            assert not kinds & {"kill-etcd-leader", "etcd-quorum-loss"}
        else:
            assert "restart-etcd" not in kinds
