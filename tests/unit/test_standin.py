"""How a worker's end reaches its agent: the exception a script lets escape (its type, where, its line),
the stand-in's exit code completing it, and the stand-in's own exit: the worker's, without a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_train.node import AgentChannel, Outcome, WorkerChannel
from elastic_train.rendezvous.decide import exit_report
from elastic_train.train.link import ProcessLink, describe
from elastic_train.worker.standin import report_exit

ROOT = Path(__file__).resolve().parents[2]


def raised() -> BaseException:
    try:
        _ = [1.0] @ [2.0]  # type: ignore[operator]
    except TypeError as exc:
        return exc
    raise AssertionError


def test_an_exception_is_described_by_its_type_place_and_line() -> None:
    kind, where, line = describe(raised())
    assert kind == "TypeError" and where == f"test_standin.py:{raised.__code__.co_firstlineno + 2}"
    assert line.startswith("TypeError: unsupported operand type(s) for @")
    assert describe(KeyError())[2] == "KeyError"


def test_the_worker_reports_what_escaped_and_the_stand_in_completes_it(tmp_path: Path) -> None:
    link = ProcessLink(WorkerChannel(str(tmp_path)))
    os.environ["RANK"] = "3"  # restored by the suite's environment fixture
    link.report_exit(raised())
    report_exit(WorkerChannel(str(tmp_path)), 3, 1, "TypeError: (the last stderr line)", 0.5)
    [outcome] = AgentChannel(str(tmp_path)).outcomes()
    assert (outcome.rank, outcome.state, outcome.code, outcome.ran_s) == (3, "exited", 1, 0.5)
    assert outcome.kind == "TypeError"
    assert outcome.message.startswith("TypeError: unsupported operand") and outcome.where


def test_a_stand_in_alone_reports_any_exit_code_and_nothing_the_agent_caused(tmp_path: Path) -> None:
    agent, worker = AgentChannel(str(tmp_path)), WorkerChannel(str(tmp_path))
    report_exit(worker, 0, -11, "", 2.0)  # killed by SIGSEGV: the code alone
    report_exit(worker, 1, 0, "", 2.0)  # exited 0: nothing to say
    assert agent.take_outcomes() == [Outcome(0, "exited", code=-11, ran_s=2.0)]
    agent.give_up("workers did not reach a step boundary")  # the agent ended the group itself
    report_exit(worker, 1, 1, "ReformAbandoned: ...", 1.0)
    assert agent.take_outcomes() == []
    ProcessLink(worker).report_exit(raised())  # the worker says it leaves for the restart path ...
    report_exit(worker, 0, 1, "TypeError: ...", 1.0)  # ... and its stand-in keeps that
    [left] = agent.outcomes()
    assert left.state == "restarting" and exit_report([left]) is None


def test_a_group_that_could_not_re_form_is_the_restart_paths_not_a_failure(tmp_path: Path) -> None:
    from elastic_train.train.errors import ReformAbandoned

    ProcessLink(WorkerChannel(str(tmp_path))).report_exit(ReformAbandoned("no new round within 120 s"))
    [left] = AgentChannel(str(tmp_path)).outcomes()
    assert (left.state, left.message) == ("restarting", "ReformAbandoned: no new round within 120 s")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGSEGV, signal.SIGSTOP])
def test_the_stand_in_ends_as_its_worker_did_without_a_traceback(sig: signal.Signals) -> None:
    code = f"from elastic_train.worker.forkserver import exit_like\nexit_like(-{int(sig)})\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert proc.stderr == ""
    # a stop signal ends nothing: the shell's code for it instead of stopping the stand-in
    assert proc.returncode == (128 + sig if sig == signal.SIGSTOP else -sig)
