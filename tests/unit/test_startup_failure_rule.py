"""The start-up failure rule: the same failure on every node before any step ends the run (pure parts)."""

from __future__ import annotations

from elastic_train.rendezvous.decide import Joiner, identical_startup_failure, is_startup_report
from elastic_train.rendezvous.outcome import exit_report

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
    def exited(rank: int, code: int = 2, line: str = LINE) -> dict:
        return {"state": "exited", "rank": rank, "code": code, "message": line}

    assert exit_report([exited(0), exited(1)]) == (2, LINE)
    assert exit_report([exited(0), exited(1, code=1)]) is None
    assert exit_report([exited(0), exited(1, line="other")]) is None
    assert exit_report([exited(0, line="")]) is None
    assert exit_report([{"state": "finished", "rank": 0, "step": 3}]) is None
    assert exit_report([exited(0, code=True)]) is None  # type: ignore[arg-type]
