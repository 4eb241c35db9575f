"""The chaos report's recovery path of each fault, read from the agents' events (fast)."""

from __future__ import annotations

from tests.chaos.report import HOT_OFF, IN_PROCESS, NO_ROUND, fault_rows, recovery_path, render

ROUND = [(101.0, 0, ""), (101.1, 2, "")]


def test_a_round_formed_on_the_hot_path_is_in_process() -> None:
    assert recovery_path("kill-node", 1, 100.0, 101.5, True, ROUND, []) == IN_PROCESS


def test_the_faulted_node_restarting_its_own_workers_is_still_in_process_for_the_survivors() -> None:
    own = [(100.2, 1, "local worker exited with code -9")]
    assert recovery_path("kill-worker", 1, 100.0, 101.5, True, ROUND, own) == IN_PROCESS


def test_a_survivor_that_fell_back_makes_it_a_restart_with_the_reason() -> None:
    other = [(102.0, 0, "workers did not reach a step boundary within 1 s")]
    path = recovery_path("hang-node", 1, 100.0, 104.0, True, ROUND, other)
    assert path == "restart (peer stopped (no step boundary))"


def test_events_outside_the_fault_window_do_not_count() -> None:
    late = [(200.0, 0, "workers did not reach a step boundary within 1 s")]
    assert recovery_path("kill-node", 1, 100.0, 101.5, True, ROUND, late) == IN_PROCESS
    assert recovery_path("kill-node", 1, 100.0, 101.5, True, [(50.0, 0, "")], []) == "restart"


def test_hot_off_and_faults_without_a_round() -> None:
    assert recovery_path("kill-node", 1, 100.0, 101.5, False, [], []) == HOT_OFF
    assert recovery_path("restart-etcd", None, 100.0, None, True, ROUND, []) == NO_ROUND
    assert recovery_path("add-node", None, 100.0, None, True, ROUND, []) == NO_ROUND


def test_the_tables_show_each_fault_and_the_paths_by_kind() -> None:
    fault = {"kind": "kill-node", "node": 1, "step": 20, "detected_s": 0.1, "resumed_s": 0.3,
             "resumed_world_size": 2, "steps_redone": 0, "source": "memory", "path": IN_PROCESS}  # fmt: skip
    results = [{"seed": 0, "hot": True, "faults": [fault], "wall_s": 20.0, "invariants": {}}]
    (row,) = fault_rows(results)[2:]
    assert row == "| 0 | on | `kill-node 1@step=20` | 0.10 s | 0.30 s | 2 | 0 | memory | in-process |"
    assert "kill-node                       1                         1  in-process 1" in render(results)
