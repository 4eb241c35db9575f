"""The start-up failure rule: the same failure on every node before any step ends the run (pure parts)."""

from __future__ import annotations

from pathlib import Path

from elastic_train.node import AgentChannel, Outcome, WorkerChannel, seconds
from elastic_train.rendezvous.decide import (
    Joiner,
    exit_ran_s,
    exit_report,
    hold_for_startup_reports,
    identical_startup_failure,
    is_startup_report,
)

LINE = "train.py: error: the following arguments are required: --lr"


def join(
    node: str, *, reason: str = "failure", code: int | None = 2, error: str = LINE, trained: bool = False
):
    return Joiner(node, 2, reason, 1, exit_code=code, error=error, trained=trained)


def test_every_member_failing_alike_before_a_step_ends_the_run() -> None:
    msg = identical_startup_failure(["a", "b"], [join("a"), join("b")])
    assert msg == f"{LINE} (exit code 2 on all 2 nodes before the first step; not retried)"
    assert identical_startup_failure(["a"], [join("a")]) == (
        f"{LINE} (exit code 2 on the node before the first step; not retried)"
    )


def test_anything_else_keeps_the_ordinary_restart() -> None:
    members = ["a", "b"]
    for other in (
        join("b", code=1),  # another exit code
        join("b", error="train.py: error: unrecognized arguments: --x"),  # another line
        join("b", trained=True),  # that node trained a step in this run
        join("b", reason="scale"),  # restarted for another node, not for its own failure
        join("b", code=None, error=""),  # no report (killed, or not a script the stand-in ran)
    ):
        assert identical_startup_failure(members, [join("a"), other]) is None, other
    assert identical_startup_failure(members, [join("a")]) is None  # b has not re-joined yet
    assert identical_startup_failure([], [join("a")]) is None  # no round yet
    assert not is_startup_report(join("a", error=""))


def test_a_nodes_report_needs_its_exited_workers_to_agree() -> None:
    def exited(rank: int, code: int = 2, line: str = LINE) -> Outcome:
        return Outcome(rank, "exited", code=code, message=line)

    assert exit_report([exited(0), exited(1)]) == (2, LINE)
    assert exit_report([exited(0), exited(1, code=1)]) is None
    assert exit_report([exited(0), exited(1, line="other")]) is None
    assert exit_report([exited(0, line="")]) is None
    assert exit_report([Outcome(0, "finished", step=3)]) is None


def hold(seen_for: float, own, *, now: float = 100.0, peer_ran_s: float = 0.5) -> bool:
    return hold_for_startup_reports(
        seen_for=seen_for, peer_ran_s=peer_ran_s, own=own, now=now, grace=3.0, most=30.0
    )


def test_a_node_holds_its_workers_until_its_own_script_had_the_reporters_time() -> None:
    assert hold(1.0, None)  # within the grace, whatever is known
    assert not hold(3.5, None)  # not run by the stand-in: the grace alone
    assert hold(3.5, (True, None))  # its script still waits for the fork server
    assert hold(10.0, (True, 99.0))  # one rank started, another still waits
    # its script started 2 s ago; the reporters' failed after 0.5 s: 1.5 s more
    assert hold(3.5, (False, 98.0))
    assert not hold(3.5, (False, 96.0))
    assert hold(3.5, (False, 90.0), peer_ran_s=12.0)  # a slow failure gives a slow script as long
    assert not hold(30.0, (True, None))  # never longer than the most


def test_the_report_carries_how_long_the_script_ran(tmp_path: Path) -> None:
    worker = WorkerChannel(str(tmp_path))
    worker.report(Outcome(0, "exited", code=2, message=LINE, ran_s=0.25))
    worker.report(Outcome(1, "exited", code=2, message=LINE, ran_s=1.5))
    outcomes = AgentChannel(str(tmp_path)).outcomes()
    assert exit_report(outcomes) == (2, LINE)
    assert exit_ran_s(outcomes) == 1.5
    assert exit_ran_s([Outcome(0, "exited", ran_s=1e9)]) == 86400.0
    assert seconds(float("inf")) == 0.0 and seconds(True) == 0.0 and seconds(-3) == 0.0
    assert seconds(1e12) == 86400.0 and seconds(2) == 2.0
