"""Pure parts of benchmarks/recovery.py (phase breakdown, target) and benchmarks/overhead.py (targets)."""

from __future__ import annotations

from tests.unit.bench_scripts import load

recovery = load("recovery")
overhead = load("overhead")


def _log(node: str, t: float, event: str, **kw: object) -> dict:
    return {"node_log": node, "t": t, "event": event, **kw}


def test_breakdown_splits_a_kill_into_its_phases() -> None:
    fault = {"kind": "kill-node", "fired_round": 1, "resumed_s": 5.0, "source": "memory", "extra": {}}
    events = [
        {"event": "step", "time": 99.0, "round": 1, "world_size": 3},
        {"event": "step", "time": 105.0, "round": 2, "world_size": 2},
        {"event": "step", "time": 105.1, "round": 2, "world_size": 2},
    ]
    logs = [
        _log("node-0", 99.5, "rendezvous_join", reason="start"),  # before the fault: ignored
        _log("node-2", 101.0, "rendezvous_join", reason="scale"),
        _log("node-0", 101.2, "rendezvous_join", reason="scale"),
        _log("node-0", 102.0, "rendezvous_complete", round=2),
        _log("node-2", 102.5, "rendezvous_complete", round=2),
        _log("node-0", 104.0, "worker_ready", round=2, restore_s=0.5),
        _log("node-2", 104.2, "worker_ready", round=2, restore_s=0.4),
        _log("node-2", 104.1, "restored", round=2, bytes=100, find_s=0.05, broadcast_s=0.3, receivers=1),
    ]
    b = recovery.breakdown(fault, events, logs)
    assert b == {
        "detect": 1.0,
        "rendezvous": 1.5,
        "worker_start": 1.3,
        "restore": 0.4,
        "first_step": 0.8,
        "total": 5.0,
        "restore_max_s": 0.5,
        "world_size": 2,
        "source": "memory",
        "state_bytes": 100,
        "find_s": 0.05,
        "broadcast_s": 0.3,
        "receivers": 1,
    }
    assert sum(b[p] for p in recovery.PHASES) == b["total"]


def test_breakdown_of_a_join_ignores_the_new_nodes_own_start() -> None:
    fault = {"kind": "add-node", "fired_round": 2, "resumed_s": 3.0, "extra": {"new_node": 3}}
    events = [{"event": "step", "time": 13.0, "round": 3, "world_size": 3}]
    logs = [
        _log("node-3", 10.5, "rendezvous_join", reason="start"),
        _log("node-0", 11.0, "rendezvous_join", reason="scale"),
        _log("node-0", 11.5, "rendezvous_complete", round=3),
        _log("node-0", 12.5, "worker_ready", round=3, restore_s=0.2),
    ]
    b = recovery.breakdown(fault, events, logs)
    assert (b["detect"], b["rendezvous"], b["restore"], b["first_step"]) == (1.0, 0.5, 0.2, 0.5)


def test_breakdown_reports_a_fault_that_never_recovered() -> None:
    assert recovery.breakdown({"fired_round": 1, "resumed_s": None}, [], []) == {
        "error": "did not train again"
    }


def test_breakdown_reports_a_fault_after_which_nothing_was_restored() -> None:
    """Survivors that re-formed in-process but found no snapshot train again from step 0: lost, not a
    recovery of a few seconds (a job under the same run id had deleted their snapshots)."""
    fault = {"kind": "kill-node", "fired_round": 1, "resumed_s": 3.4, "source": None, "extra": {}}
    events = [{"event": "step", "time": 103.4, "round": 2, "world_size": 2}]
    logs = [
        _log("node-0", 101.0, "rendezvous_join", reason="failure"),
        _log("node-0", 101.1, "hot_round", round=2),
        _log("node-0", 101.2, "restore_nothing_found", round=2),
        _log("node-0", 101.2, "worker_ready", round=2, restore_s=0.01),
    ]
    assert recovery.breakdown(fault, events, logs) == {"error": "restored nothing: trained again from step 0"}


def test_recovery_targets_hold_one_receiver_from_100_mb_to_1_3x_and_0_9x_of_the_link() -> None:
    def fault(restore: float, nbytes: int, broadcast: float) -> dict:
        return {"restore": restore, "state_bytes": nbytes, "broadcast_s": broadcast}

    runs = [
        {"state_mb": 10, "faults": {"add-node": fault(0.05, 10_000_000, 0.02)}},
        {"state_mb": 100, "faults": {"kill-node": fault(0.03, 100_000_000, 0.0),
                                     "add-node": fault(0.12, 100_000_000, 0.105)}},
        {"state_mb": 1000, "faults": {"add-node": fault(1.25, 1_000_000_000, 1.08)}},
    ]  # fmt: skip
    whole, rate = recovery.targets(runs, bandwidth=1e9)  # ideal: 0.1 s and 1 s
    assert whole["status"] == "met" and "100 MB add-node: 0.12 s = 1.20x" in whole["figure"]
    # survivors of a kill land their own snapshots: nothing received, reported beside the target
    assert "10 MB" not in whole["figure"] and "kill-node: 0.03 s = 0.30x (own snapshots" in whole["why"]
    assert rate["status"] == "met" and "1000 MB: 0.93x" in rate["figure"]
    runs[2]["faults"]["add-node"] = fault(1.4, 1_000_000_000, 1.2)
    whole, rate = recovery.targets(runs, bandwidth=1e9)
    assert (whole["status"], rate["status"]) == ("missed", "missed")
    assert [t["status"] for t in recovery.targets([], bandwidth=1e9)] == ["not measured", "not measured"]
    # each recovery path measured has targets of its own
    hot = {"state_mb": 1000, "path": "hot", "faults": {"add-node": fault(1.1, 1_000_000_000, 1.05)}}
    rows = recovery.targets([dict(r, path="restart") for r in runs] + [hot], bandwidth=1e9)
    assert [(t["name"].rsplit(", ", 1)[1], t["status"]) for t in rows] == [
        ("hot recovery (the default)", "met"), ("hot recovery (the default)", "met"),
        ("restart path", "missed"), ("restart path", "missed"),
    ]  # fmt: skip


def test_overhead_targets_hold_long_steps_to_3_short_ones_to_5_percent_and_the_python_to_0_2_ms() -> None:
    def run(name: str, plain: float, loop: float, allin: float, floor: float, python: float | None) -> dict:
        return {
            "config": name,
            "state_mb": 38.0,
            "plain_step_s": plain,
            "loop_ratio": loop,
            "allin_ratio": allin,
            "copy_floor_ratio": floor,
            "snapshot_python_s": python,
        }

    runs = [
        run("17ms", 0.017, 1.01, 1.045, 1.02, 0.15e-3),
        run("200ms", 0.2, 1.0, 1.02, 1.01, 0.18e-3),
        run("1s", 1.0, 0.99, 1.04, 1.035, None),
    ]
    big, small, python, loop = overhead.targets(runs)
    assert big["status"] == "missed" and "+4.00%" in big["figure"] and "17ms" not in big["figure"]
    assert "1s (38 MB): +4.00% (copy floor 3.5%)" in big["figure"] and "1s: the copy floor" in big["why"]
    assert small["status"] == "met" and "+4.50% (copy floor 2.0%)" in small["figure"]
    assert python["status"] == "met" and python["figure"] == "17ms: 0.150 ms, 200ms: 0.180 ms"
    assert loop["status"] == "met"
    runs[2]["allin_ratio"] = 1.03
    runs[0]["allin_ratio"] = 1.051
    runs[1]["snapshot_python_s"] = 0.21e-3
    big, small, python, _ = overhead.targets(runs)
    assert (big["status"], small["status"], python["status"]) == ("met", "missed", "missed")
    assert "sealed in save" not in python["why"] and "loop-alone ratios" in python["why"]
    runs[0]["plain_step_s"] = 0.25  # a loaded machine stretches the short step: it stays a short one
    assert "17ms" in overhead.targets(runs)[1]["figure"]
    # A state small enough to be sealed in save: its Python includes the seal's, and the row says so.
    runs[1]["snapshot_python_s"] = 0.18e-3
    runs[0].update(state_mb=1.3, snapshot_python_s=0.30e-3, copier_wake_s=0.0)
    python = overhead.targets(runs)[2]
    assert python["status"] == "missed" and "17ms: 0.300 ms (sealed in save)" in python["figure"]
    assert python["why"].startswith("17ms: a state under 2 MiB is sealed in save")
    assert "loop-alone" not in python["why"]
