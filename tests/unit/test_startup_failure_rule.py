"""The start-up failure rule: the same failure on every node before the round's first step ends the run
(pure parts: each node's report of its workers, the closer's rule, the hold)."""

from __future__ import annotations

from pathlib import Path

from elastic_train.node import AgentChannel, Outcome, WorkerChannel, seconds
from elastic_train.rendezvous.decide import (
    ExitReport,
    Joiner,
    exit_ran_s,
    exit_report,
    hold_for_startup_reports,
    how_exited,
    identical_startup_failure,
    is_startup_report,
    torchrun_report,
)
from elastic_train.torchcompat import WorkerExit

LINE = "train.py: error: the following arguments are required: --lr"
DTYPE = "RuntimeError: mat1 and mat2 must have the same dtype, but got Double and Float"


def join(
    node: str,
    *,
    reason: str = "failure",
    code: int | None = 2,
    error: str = LINE,
    trained: bool = False,
    signature: str = "",
):
    return Joiner(node, 2, reason, 1, exit_code=code, error=error, trained=trained, signature=signature)


def test_every_member_failing_alike_before_a_step_ends_the_run() -> None:
    msg = identical_startup_failure(["a", "b"], [join("a"), join("b")])
    assert msg == f"{LINE} (exit code 2 on all 2 nodes before the first step; not retried)"
    assert identical_startup_failure(["a"], [join("a")]) == (
        f"{LINE} (exit code 2 on the node before the first step; not retried)"
    )


def test_an_exception_is_the_same_failure_by_its_type_and_place_whatever_its_text() -> None:
    """Messages may name the rank or an address; where the exception was raised does not change."""
    where = "RuntimeError at linear.py:125"
    a = join("a", code=1, error=DTYPE, signature=where)
    b = join("b", code=1, error=DTYPE.replace("Double", "Half"), signature=where)
    assert identical_startup_failure(["a", "b"], [a, b]) == (
        f"{DTYPE} (exit code 1 on all 2 nodes before the first step; not retried)"
    )
    elsewhere = join("b", code=1, error=DTYPE, signature="RuntimeError at train.py:9")
    assert identical_startup_failure(["a", "b"], [a, elsewhere]) is None


def test_the_same_exit_code_alone_is_the_same_failure() -> None:
    killed = [join("a", code=-11, error=""), join("b", code=-11, error="")]
    assert identical_startup_failure(["a", "b"], killed) == (
        "the workers exited with signal SIGSEGV (signal SIGSEGV on all 2 nodes before the first step; "
        "not retried)"
    )
    assert (
        how_exited(3) == "exit code 3"
        and how_exited(-9) == "signal SIGKILL"
        and how_exited(-99) == "signal 99"
    )


def test_anything_else_keeps_the_ordinary_restart() -> None:
    members = ["a", "b"]
    for other in (
        join("b", code=1),  # another exit code
        join("b", error="train.py: error: unrecognized arguments: --x"),  # another line
        join("b", trained=True),  # that node trained a step in this round
        join("b", reason="scale"),  # restarted for another node, not for its own failure
        join("b", code=None, error=""),  # no report (stopped by its agent, or failures that differ)
    ):
        assert identical_startup_failure(members, [join("a"), other]) is None, other
    assert identical_startup_failure(members, [join("a")]) is None  # b has not re-joined yet
    assert identical_startup_failure([], [join("a")]) is None  # no round yet
    assert not is_startup_report(join("a", code=0))


def test_a_nodes_report_needs_its_exited_workers_to_agree() -> None:
    def exited(rank: int, code: int = 2, line: str = LINE, **kw: str) -> Outcome:
        return Outcome(rank, "exited", code=code, message=line, **kw)  # type: ignore[arg-type]

    assert exit_report([exited(0), exited(1)]) == ExitReport(2, LINE, LINE)
    assert exit_report([exited(0), exited(1, code=1)]) is None
    assert exit_report([exited(0), exited(1, line="other")]) is None
    assert exit_report([exited(0, line="")]) == ExitReport(2, "", "")  # the exit code alone
    assert exit_report([exited(0, code=1, line="")]) is None  # exit 1 alone: any exception, a peer's too
    assert exit_report([exited(0, code=0)]) is None
    assert exit_report([Outcome(0, "finished", step=3)]) is None
    thrown = [exited(r, 1, DTYPE + str(r), kind="RuntimeError", where="linear.py:125") for r in range(2)]
    assert exit_report(thrown) == ExitReport(1, DTYPE + "0", "RuntimeError at linear.py:125")


def test_torchruns_record_is_the_report_of_a_script_that_says_nothing() -> None:
    assert torchrun_report([WorkerExit(0, 3, ""), WorkerExit(1, 3, "")]) == ExitReport(3, "", "")
    assert torchrun_report([WorkerExit(0, 1, "ValueError: x")]) == ExitReport(
        1, "ValueError: x", "ValueError: x"
    )
    assert torchrun_report([WorkerExit(0, 1, ""), WorkerExit(1, -9, "")]) is None
    # a script that exits 1 on every node names no failure: a peer's crash fails the others' collectives too
    assert torchrun_report([WorkerExit(0, 1, ""), WorkerExit(1, 1, "")]) is None


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
    assert exit_report(outcomes) == ExitReport(2, LINE, LINE, ran_s=1.5)
    assert exit_ran_s(outcomes) == 1.5
    assert exit_ran_s([Outcome(0, "exited", ran_s=1e9)]) == 86400.0
    assert seconds(float("inf")) == 0.0 and seconds(True) == 0.0 and seconds(-3) == 0.0
    assert seconds(1e12) == 86400.0 and seconds(2) == 2.0
