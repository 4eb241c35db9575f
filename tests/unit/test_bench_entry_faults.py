"""entry_faults.py's figures (hf.py and lightning.py): samples lost and repeated over the surviving
trajectory, the pause around a fault, the targets and the ratios."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elastic_train.train.audit import AuditWriter
from tests.unit.bench_scripts import load

ef = load("entry_faults")


def audit(tmp_path: Path, lines: list[tuple[int, int, int, int, list[int]]]) -> Path:
    """Audit files of (round, rank, epoch, step, indices) lines, one file per round and rank."""
    writers: dict[tuple[int, int], Any] = {}
    for rnd, rank, epoch, step, indices in lines:
        if (rnd, rank) not in writers:
            writers[rnd, rank] = AuditWriter(str(tmp_path), rank=rank, world_size=2, round=rnd)
        writers[rnd, rank].write(epoch=epoch, step=step, indices=indices)
    for w in writers.values():
        w.close()
    return tmp_path


def test_a_step_trained_again_by_a_later_round_counts_once(tmp_path: Path) -> None:
    # Round 1 trained steps 1-2; the kill lost step 2 and round 2 trained it again, then step 3.
    path = audit(tmp_path, [
        (1, 0, 0, 1, [0, 1]), (1, 1, 0, 1, [2, 3]),
        (1, 0, 0, 2, [4, 5]), (1, 1, 0, 2, [6, 7]),
        (2, 0, 0, 2, [4, 5]), (2, 1, 0, 2, [6, 7]),
        (2, 0, 0, 3, [8, 9]),
    ])  # fmt: skip
    assert ef.lost_and_duplicated(path, 10, 1) == {"lost": 0, "duplicated": 0, "expected": 10}


def test_samples_skipped_or_trained_twice_within_the_trajectory_are_counted(tmp_path: Path) -> None:
    # A resume that restarted the epoch's order: step 3 trains samples step 1 had (1 repeated), and
    # samples 8 and 9 are never trained.
    path = audit(tmp_path, [
        (1, 0, 0, 1, [0, 1]), (1, 0, 0, 2, [2, 3, 4, 5]),
        (2, 0, 0, 3, [1, 6, 7]),
    ])  # fmt: skip
    assert ef.lost_and_duplicated(path, 10, 1) == {"lost": 2, "duplicated": 1, "expected": 10}
    assert ef.lost_and_duplicated(tmp_path / "none", 10, 2)["lost"] == 20  # no audit: everything lost


def test_pause_runs_from_the_last_step_before_the_new_round_to_its_first() -> None:
    events = [
        {"event": "step", "round": 1, "time": 10.0},
        {"event": "step", "round": 1, "time": 11.0},
        {"event": "resumed", "round": 2, "time": 11.5},
        {"event": "step", "round": 2, "time": 13.5},
        {"event": "step", "round": 2, "time": 14.0},
    ]
    assert ef.pause({"fired_round": 1}, events) == 2.5
    # A fault whose round never ended (a join the workers' rounds do not show) has no pause.
    assert ef.pause({"fired_round": 2}, events) is None
    assert ef.pause({}, events) is None


def run(variant: str, **figures: Any) -> dict[str, Any]:
    base = {
        "variant": variant, "succeeded": True, "steps": 100, "seconds": 60.0, "kill_s": 1.0, "join_s": 2.0,
        "kill_pause_s": 0.5, "join_pause_s": 0.7, "kill_redone": 0, "join_redone": 0, "source": "memory",
        "lost": 0, "duplicated": 0, "expected": 1000,
    }  # fmt: skip
    return {**base, **figures}


def test_targets_hold_the_elastic_runs_only_and_say_why_a_miss() -> None:
    runs = [run("elastic"), run("plain", kill_s=9.0, lost=50)]
    kill, join, data = ef.targets(runs, "Lightning", "machine load")
    assert kill["name"] == "Lightning kill -> training with run --entry"
    assert (kill["figure"], kill["status"], kill["why"]) == ("1.00 s", "met", "")
    assert join["status"] == "met" and data["figure"] == "0 of 1000" and data["status"] == "met"
    slow = ef.targets([run("elastic", kill_s=3.5, duplicated=2)], "HF Trainer", "machine load")
    assert (slow[0]["status"], slow[0]["why"]) == ("missed", "machine load")
    assert (slow[2]["figure"], slow[2]["status"]) == ("2 of 1000", "missed")
    # Nothing measured: the targets are listed without a figure.
    assert [t.get("figure") for t in ef.targets([{"variant": "elastic", "error": "exit 1"}], "X")] == [
        None
    ] * 3


def test_figures_pair_the_variants_and_the_table_shows_every_run() -> None:
    rows = ef.figures(
        [run("elastic"), run("plain", kill_s=4.0, join_s=None), {"variant": "plain", "error": "x"}]
    )
    assert [r["variant"] for r in rows] == ["elastic", "plain", "plain", "plain / elastic"]
    ratio = rows[-1]
    assert ratio["kill -> training s"] == 4.0 and "join -> training s" not in ratio
    text = ef.table(rows)
    assert text.splitlines()[0] == "| | elastic | plain | plain | plain / elastic |"
    assert "| error |  |  | x |  |" in text
