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


def test_hot_recovery_mix() -> None:
    """Both values within ``make chaos``'s default seeds, the CI seed hot, and each value meets both etcd
    sizes and the partition seeds within a dozen seeds."""
    from tests.chaos.plan import etcd_members, hot_recovery

    assert {hot_recovery(s) for s in range(5)} == {True, False}
    assert hot_recovery(0)
    for hot in (True, False):
        seeds = [s for s in range(12) if hot_recovery(s) == hot]
        assert {etcd_members(s) for s in seeds} == {1, 3}
        assert any(s % 4 == 2 for s in seeds), "a partition seed"


def test_sharded_mix() -> None:
    """Both layouts within ``make chaos``'s default seeds, the CI seed replicated, and each layout meets both
    etcd sizes, both recovery paths and the partition seeds within a dozen seeds."""
    from tests.chaos.plan import etcd_members, hot_recovery, sharded

    assert {sharded(s) for s in range(5)} == {True, False}
    assert not sharded(0)
    for layout in (True, False):
        seeds = [s for s in range(12) if sharded(s) == layout]
        assert {etcd_members(s) for s in seeds} == {1, 3}
        assert {hot_recovery(s) for s in seeds} == {True, False}
        assert any(s % 4 == 2 for s in seeds), "a partition seed"


def test_hot_kept_judges_pids_and_fallbacks() -> None:
    """The chaos suite's ``hot_kept`` on made-up runs: a survivor restarted across a kill fails it, a kept
    one passes; a fallback needs an injected fault that requires it, in time; hot off allows no hot round."""
    from elastic_train.launch.faults import Fault, FaultRecord
    from tests.chaos.test_chaos import hot_kept

    def rec(kind: str, node: int | None, fired: float, resumed: float | None = None) -> FaultRecord:
        r = FaultRecord(fault=Fault(kind=kind, step=1, node=node))
        r.fired_at, r.resumed_at = fired, resumed
        return r

    kill = rec("kill-node", 2, 100.0, 101.0)
    steady = [
        (99.0 + i / 10, {0: frozenset({10}), 1: frozenset({11}), 2: frozenset({12})}) for i in range(11)
    ]
    kept = [*steady, (101.2, {0: frozenset({10}), 1: frozenset({11})})]
    ok, detail = hot_kept([], [], [kill], kept, hot=True)
    assert ok and detail["kept"] == [kill.label]
    restarted = [*steady, (101.2, {0: frozenset({10}), 1: frozenset({21})})]
    ok, detail = hot_kept([], [], [kill], restarted, hot=True)
    assert not ok and detail["broken"][0]["before"] == {1: [11]}
    # node 1's worker is an earlier partition's victim, fenced and still exiting at the kill: no survivor
    cut = rec("partition-etcd", 1, 98.0, 98.5)
    cut.extra["pids"] = [11]
    ok, detail = hot_kept([], [], [cut, kill], restarted, hot=True)
    assert ok and detail["kept"] == [kill.label], detail

    stopped = {"reason": "workers did not reach a step boundary within 1 s of the change"}
    hang = rec("hang-node", 2, 100.0)
    assert hot_kept([(103.0, 0, stopped)], [], [hang], [], hot=True)[0]
    assert not hot_kept([(103.0, 0, stopped)], [], [kill], [], hot=True)[0], "a kill requires no fallback"
    fenced = {"reason": "this node was fenced (cut_off)"}
    resume = rec("resume-node", 2, 150.0)
    assert hot_kept([(152.0, 2, fenced)], [], [hang, resume], [], hot=True)[0], "the hung node, once resumed"
    assert not hot_kept([(152.0, 1, fenced)], [], [hang, resume], [], hot=True)[0], "another node fenced"
    exited = {"reason": "local worker(s) [0] exited"}
    crash = rec("kill-worker", 1, 100.0)
    assert hot_kept([(101.0, 1, exited)], [], [crash], [], hot=True)[0]
    assert not hot_kept([(101.0, 0, exited)], [], [crash], [], hot=True)[0], "another node's worker died"
    assert not hot_kept([(200.0, 1, exited)], [], [crash], [], hot=True)[0], "long after the fault"
    assert not hot_kept([], [(101.0, 0, {})], [kill], [], hot=False)[0], "hot off, yet a round in-process"
    assert hot_kept([], [], [kill], restarted, hot=False)[0]
