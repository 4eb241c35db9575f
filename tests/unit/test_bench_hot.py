"""benchmarks/hot.py's pure parts: log parsing, the phases of a recovery, join basis, summary and targets."""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tests.unit.bench_scripts import load

hot = load("hot")
report = load("report")

T0 = 1_800_000_000.0


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def line(event: str, t: float, **fields: Any) -> str:
    return json.dumps({"event": event, "timestamp": iso(t), **fields})


def ev(event: str, t: float, **fields: Any) -> dict[str, Any]:
    return {"event": event, "t": t, **fields}


def test_log_events_are_the_json_lines_with_an_event_and_a_timestamp(tmp_path: Path) -> None:
    path = tmp_path / "node-0.log"
    path.write_text(
        "\n".join(
            [
                "$ elastic-train run ...",
                line("group_broken", T0 + 0.2, round=1),
                '{"event": "no time"}',
                "[W1202 c10d] not json",
                '{"truncated": ',
                line("restored", T0 + 0.5, find_s=0.01),
            ]
        )
    )
    got = hot.read_log_events(path)
    assert [e["event"] for e in got] == ["group_broken", "restored"]
    assert abs(got[0]["t"] - (T0 + 0.2)) < 1e-6 and got[1]["find_s"] == 0.01


def test_the_fault_time_is_the_first_step_of_a_later_round_less_resumed_s() -> None:
    steps = [
        {"event": "step", "time": T0 - 0.1, "round": 1, "step": 20},
        {"event": "step", "time": T0 + 0.6, "round": 2, "step": 21},
        {"event": "step", "time": T0 + 0.7, "round": 2, "step": 22},
    ]
    fault = {"fired_round": 1, "resumed_s": 0.6}
    assert hot.resumed_at(fault, steps) == T0 + 0.6
    assert abs(hot.fired_at(fault, steps) - T0) < 1e-9
    assert hot.fired_at({"fired_round": 2, "resumed_s": 0.6}, steps) is None  # no later round
    assert hot.fired_at({"fired_round": 1, "resumed_s": None}, steps) is None


def test_breakdown_phases_end_when_the_slowest_survivor_logged_their_event() -> None:
    survivors = {
        0: [
            ev("group_broken", T0 - 3.0),  # an earlier re-formation: not this one
            ev("group_broken", T0 + 0.10),
            ev("hot_round", T0 + 0.20),
            ev("group_reformed", T0 + 0.22),
            ev("restored", T0 + 0.25),
        ],
        2: [
            ev("group_broken", T0 + 0.12),
            ev("hot_round", T0 + 0.21),
            ev("group_reformed", T0 + 0.23),
            ev("restored", T0 + 0.26),
        ],
    }
    got = hot.breakdown(survivors, T0, 0.30, hot.HOT_PHASES)
    assert got == {"detect": 0.12, "round": 0.09, "group": 0.02, "restore": 0.03, "first_step": 0.04}
    assert abs(sum(v for v in got.values() if v is not None) - 0.30) < 1e-9


def test_breakdown_leaves_a_phase_missing_on_a_survivor_unknown() -> None:
    survivors = {
        0: [ev("rendezvous_complete", T0 + 1.0), ev("restored", T0 + 3.0)],
        2: [ev("restored", T0 + 3.2)],  # no rendezvous_complete in this log
    }
    got = hot.breakdown(survivors, T0, 3.5, hot.RESTART_PHASES)
    assert got["round"] is None
    assert got["start+restore"] == 3.2 and got["first_step"] == 0.3


def test_hot_details_take_the_slowest_survivors_own_timings() -> None:
    survivors = {
        0: [ev("group_reformed", T0 + 0.2, store_s=0.002, pg_s=0.01), ev("restored", T0 + 0.3, find_s=0.02)],
        2: [ev("group_reformed", T0 + 0.2, store_s=0.004, pg_s=0.008)],
    }
    got = hot.hot_details(survivors, T0)
    assert got["group_reformed.store_s"] == 0.004 and got["group_reformed.pg_s"] == 0.01
    assert got["restored.find_s"] == 0.02


def test_join_is_measured_from_model_built_to_the_first_step_at_world_3() -> None:
    steps = [
        {"event": "step", "time": T0 - 4.0, "round": 2, "world_size": 2, "step": 50},
        {"event": "step", "time": T0 + 9.0, "round": 3, "world_size": 2, "step": 59},  # another change first
        {"event": "step", "time": T0 + 10.0, "round": 4, "world_size": 3, "step": 60},
    ]
    fault = {"fired_round": 2, "resumed_s": 14.0}  # fired at T0 - 5: the round-3 step is 14 s later
    got = hot.join_ready([ev("model_built", T0 + 9.6)], fault, steps)
    assert got == {"join_s": 0.4, "join_basis": "model_built"}
    got = hot.join_ready([ev("worker_ready", T0 + 9.6)], fault, steps)
    assert got == {"join_s": 15.0, "join_basis": "start"}
    assert hot.join_ready([], {"fired_round": 2, "resumed_s": None}, steps)["join_s"] is None
    assert hot.join_ready([], fault, steps[:2])["join_s"] is None  # the job ended before the joiner got in


def test_a_join_from_the_joiners_start_is_split_at_its_own_events() -> None:
    steps = [
        {"event": "step", "time": T0 - 4.0, "round": 2, "world_size": 2, "step": 50},
        {"event": "step", "time": T0 + 9.0, "round": 3, "world_size": 2, "step": 59},
        {"event": "step", "time": T0 + 10.0, "round": 4, "world_size": 3, "step": 60},
    ]
    fault = {"fired_round": 2, "resumed_s": 14.0}  # the joiner started at T0 - 5
    events = [
        ev("forkserver_ready", T0 - 2.5),
        ev("rendezvous_node_started", T0 - 3.0),
        ev("standby_start", T0 - 2.9),
        ev("model_built", T0 + 9.6),
        ev("standby_admitted", T0 + 9.8),
        ev("worker_ready", T0 + 9.9, since_exec_s=11.9),  # created at T0 - 2.0
    ]
    got = hot.join_from_start(events, fault, steps)
    assert got["join_start_s"] == 15.0 and got["forkserver_ready_s"] == 2.5
    assert got["join_breakdown"] == {
        "agent": 2.0,
        "rendezvous": 0.1,
        "worker_start": 0.9,
        "build": 11.6,
        "admission": 0.2,
        "first_step": 0.2,
    }
    restart = hot.join_from_start([ev("rendezvous_node_started", T0 - 3.0)], fault, steps)
    assert restart["join_breakdown"]["agent"] == 2.0 and restart["join_breakdown"]["build"] is None
    assert restart["forkserver_ready_s"] is None
    assert hot.join_from_start([], {"fired_round": 2, "resumed_s": None}, steps) == {}


def test_graphs_compiled_after_the_kill_count_a_kept_process_as_zero_and_a_new_one_in_full() -> None:
    kept = [ev("dynamo_graphs", T0 - 5, graphs=2, pid=10), ev("dynamo_graphs", T0 + 0.5, graphs=2, pid=10)]
    new = [ev("dynamo_graphs", T0 - 5, graphs=2, pid=11), ev("dynamo_graphs", T0 + 9, graphs=2, pid=12)]
    assert hot.graphs_compiled_after({0: kept}, T0) == 0
    assert hot.graphs_compiled_after({0: kept, 2: new}, T0) == 2
    assert hot.graphs_compiled_after({0: [ev("restored", T0 + 1)]}, T0) is None


def run(loop: str, mode: str, **figures: Any) -> dict[str, Any]:
    return {"loop": loop, "kind": "kill-join", "mode": mode, "repeat": 0, "succeeded": True, **figures}


def args(**over: Any) -> argparse.Namespace:
    base = dict(
        repeats=1,
        scenarios=["builtin:kill-join"],
        kill_step=20,
        gap_steps=30,
        tail_steps=300,
        stop_tail_steps=60,
    )
    return argparse.Namespace(**{**base, **over})


def test_summary_and_targets_of_a_run() -> None:
    runs = [
        run("builtin", "hot", kill_s=0.4, join_s=0.3, join_basis="model_built",
            kill_breakdown={"detect": 0.1, "round": 0.1, "first_step": 0.2}),
        run("builtin", "restart", kill_s=3.0, join_s=2.0, join_basis="model_built"),
        run("own", "hot", kill_s=0.6, join_s=5.0, join_basis="start"),
        run("own", "restart", kill_s=3.5, join_s=6.0, join_basis="start"),
        {"loop": "own", "kind": "kill-join", "mode": "hot", "repeat": 1, "error": "exit 1: boom"},
        {"loop": "own", "kind": "stop", "mode": "hot", "repeat": 0, "succeeded": True, "stop_s": 6.0},
    ]  # fmt: skip
    doc = hot.build_doc(runs, args(), [3.0, 2.0, 1.0])
    table = doc["summary"]
    assert table["builtin"]["kill"]["hot"]["median"] == 0.4
    assert table["builtin"]["kill"]["hot"]["breakdown"] == {"detect": 0.1, "round": 0.1, "first_step": 0.2}
    assert table["own"]["kill"]["hot"]["jobs"] == 2 and table["own"]["kill"]["hot"]["ok"] == 1
    assert "stop" not in table["builtin"]
    assert table["own"]["stop"]["hot"] == {"n": 1, "median": 6.0, "min": 6.0, "max": 6.0, "jobs": 1, "ok": 1}
    assert "restart" not in table["own"]["stop"]
    rows = {(r["loop"], r["scenario"]): r for r in doc["figures"]}
    assert rows[("builtin", "kill")]["restart / hot"] == 3.0 / 0.4
    assert rows[("builtin", "kill")]["hot phases s"] == "detect 0.100, round 0.100, first_step 0.200"
    assert rows[("own", "join")]["from"] == "start"
    unmeasured = hot.summary_table([run("own", "hot", kill_s=0.3, join_s=None, join_basis=None)])
    assert unmeasured["own"]["join"]["hot"]["basis"] == []
    by_name = {t["name"]: t for t in doc["targets"]}
    kill = by_name["kill -9 one node -> first step at world 2, hot recovery"]
    assert kill["status"] == "missed" and kill["figure"] == "builtin 0.40 s (n=1); own 0.60 s (n=1)"
    assert "restart path in the same run: builtin 3.00 s, own 3.50 s" in kill["why"]
    join = by_name["join -> first step at world 3 after the joiner's model is built, hot recovery"]
    assert join["status"] == "missed" and "from the joiner's start" in join["why"]
    compiled = by_name["torch.compile'd model: kill -9 -> first step at world 2, hot recovery"]
    assert compiled["status"] == "not measured"
    assert report._problem("hot", json.loads(json.dumps(doc))) == ""  # what the report takes


def test_targets_are_met_when_every_measured_loop_is_within_its_bar() -> None:
    runs = [
        run("builtin", "hot", kill_s=0.4, join_s=0.3, join_basis="model_built"),
        run("compiled", "hot", kill_s=0.9),
        run("compiled", "restart", kill_s=12.0),
    ]
    by_name = {t["name"]: t for t in hot.build_doc(runs, args(), [1.0, 1.0, 1.0])["targets"]}
    kill = by_name["kill -9 one node -> first step at world 2, hot recovery"]
    assert kill["status"] == "met" and "not measured for own" in kill["why"]
    compiled = by_name["torch.compile'd model: kill -9 -> first step at world 2, hot recovery"]
    assert compiled["status"] == "met" and "compiled 12.00 s" in compiled["why"]


def test_torchft_figures_are_rows_beside_ours_and_a_skip_keeps_its_reason() -> None:
    runs = [run("builtin", "hot", kill_s=0.4)]
    doc = hot.build_doc(runs, args(), [1.0, 1.0, 1.0], {"torchft": "x", "kill_s": 0.35, "join_s": 0.29})
    loops = [(r["loop"], r["scenario"], r["hot median s"]) for r in doc["figures"]]
    assert ("torchft (probe)", "kill", 0.35) in loops and ("torchft (probe)", "join", 0.29) in loops
    assert doc["tables"] == [{"caption": hot.torchft_line(doc["torchft"])}]
    assert "kill -> next committed step 0.35 s" in doc["tables"][0]["caption"]
    skipped = hot.build_doc(runs, args(), [1.0, 1.0, 1.0], {"skipped": "no torchft"})
    assert skipped["torchft"] == {"skipped": "no torchft"}
    assert skipped["tables"] == [{"caption": "torchft: not measured: no torchft"}]
    assert all(r["loop"] != "torchft (probe)" for r in skipped["figures"])


def test_job_commands_of_each_loop_and_kind(tmp_path: Path) -> None:
    a = args(timeout=300.0)
    builtin = hot.job_command("builtin", "kill-join", "hot", a, tmp_path)
    assert "--kill-node" in builtin and "--add-node" in builtin and "rendezvous.hot=true" in builtin
    assert builtin[builtin.index("--steps") + 1] == "350"
    own = hot.job_command("own", "stop", "restart", a, tmp_path)
    assert "--hang-node" in own and "--entry" in own and "rendezvous.hot=false" in own
    assert own[own.index("--epochs") + 1] == "26"  # 20 + 25 x 60 steps, 60 a epoch
    compiled = hot.job_command("compiled", "kill", "hot", a, tmp_path)
    assert (
        compiled[compiled.index("--entry") + 1].endswith("hot_compiled.py") and "--add-node" not in compiled
    )
