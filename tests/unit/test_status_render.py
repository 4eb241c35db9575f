"""The text of ``elastic-train status``: a lost member is flagged only while the run lives."""

from __future__ import annotations

from elastic_train.cli.status import render
from elastic_train.rendezvous.status import JobStatus, Member


def status(state: str, alive: tuple[bool, ...], **kw: object) -> JobStatus:
    members = [Member(node=f"n{i}", addr=f"10.0.0.{i + 1}", rank=i, alive=a) for i, a in enumerate(alive)]
    return JobStatus(
        run_id="job-42", round=3, state=state, members=members, world_size=len(members), failure_budget=10,
        **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def test_a_running_run_flags_its_lost_member() -> None:
    lines = render(status("restarting", (True, False)))
    assert "  rank 0: n0 10.0.0.1" in lines
    assert "  rank 1: n1 10.0.0.2  (lost)" in lines
    assert "waiting: none" in lines


def test_a_finished_run_lists_its_last_round_without_calling_it_lost() -> None:
    lines = render(status("finished", (False, False), closed=True, finished_step=40, closed_at=86400.0))
    assert lines[0] == "run job-42: finished at step 40 on 1970-01-02 00:00:00 UTC, round 3"
    assert "last round (world size 2; its nodes have left):" in lines
    assert "  rank 0: n0 10.0.0.1" in lines and "  rank 1: n1 10.0.0.2" in lines
    assert not any("(lost)" in ln or ln.startswith("waiting:") for ln in lines), lines


def test_failed_and_stopped_runs_call_no_member_lost() -> None:
    for state in ("failed", "stopped"):
        lines = render(status(state, (False,), closed=state == "failed", message="bad task args"))
        assert "  rank 0: n0 10.0.0.1" in lines
        assert not any("(lost)" in ln for ln in lines), lines


def test_slow_nodes_and_unreadable_keys_are_shown_while_the_run_lives() -> None:
    from elastic_train.straggler.record import StragglerRecord

    slow = [StragglerRecord(node="n1", state="flagged", score=2.04, step=120, since=5.0, policy="report")]
    lines = render(status("running", (True, True), stragglers=slow, unreadable=["straggler/n9"]))
    assert "slow nodes:" in lines
    assert "  n1: flagged at step 120 (score 2.04, policy report)" in lines
    assert "unreadable keys: straggler/n9" in lines
    assert "slow nodes:" not in render(status("finished", (False, False), stragglers=slow))


def test_the_budget_line_counts_the_window_and_the_leaves_apart() -> None:
    st = status("running", (True,), failures_used=7, failure_window=3600.0, failures_in_window=2, leaves=5)
    assert render(st)[1] == (
        "failures: 2 in the last 1h of a budget of 10 (8 left), 7 in all; clean leaves: 5 (not counted)"
    )
    assert st.to_json()["failures_left"] == 8
    whole_life = status("running", (True,), failures_used=3, failure_window=0.0, failures_in_window=3)
    assert render(whole_life)[1] == (
        "failures: 3 over the run's life of a budget of 10 (7 left); clean leaves: 0 (not counted)"
    )


def test_watch_refreshes_the_view_and_survives_an_etcd_error() -> None:
    import io

    from elastic_train.cli.status import watch
    from elastic_train.etcd.errors import EtcdError

    views = iter(
        [status("running", (True,)), EtcdError("etcd 127.0.0.1:2379 unreachable"), status("finished", ())]
    )

    def read() -> JobStatus:
        v = next(views)
        if isinstance(v, Exception):
            raise v
        return v

    out = io.StringIO()
    assert watch(read, 0.01, out=out, times=3) == 0
    text = out.getvalue()
    assert text.count("--- ") == 3 and "\x1b[2J" not in text  # not a terminal: views follow each other
    assert "run job-42: running, round 3, world size 1" in text
    assert "elastic-train: error: etcd 127.0.0.1:2379 unreachable (retrying every 0.01 s)" in text
    assert "run job-42: finished, round 3" in text
