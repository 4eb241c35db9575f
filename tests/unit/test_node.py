"""The node contract: each message survives its file, anything else in the directory is no message, and the
agent's and a worker's side of one directory see what the other wrote."""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from elastic_train.envvars import ENV_NODE_DIR
from elastic_train.node import (
    CURRENT,
    STALE,
    UNKNOWN,
    AgentChannel,
    Assignment,
    Beat,
    Beats,
    GateServer,
    Link,
    Outcome,
    WorkerChannel,
    messages,
)
from elastic_train.node.beat import read_beats
from elastic_train.node.gate import ask


def assignment(round_: int = 2, **kw: Any) -> Assignment:
    base: dict[str, Any] = dict(round=round_, node_rank=1, nodes=2, master_addr="127.0.0.1",
                                master_port=29500, ranks=(2, 3), world_size=4)  # fmt: skip
    base.update(kw)
    return Assignment(**base)


EXAMPLES = [
    messages.Ready(3, 1234, cut=True),
    messages.Request(3, "Connection reset by peer"),
    messages.Standby(4, 99),
    assignment(),
    assignment(5, ranks=(), world_size=0, standby_s=660.0, reform=True),  # a standby start
    messages.Change(3),
    messages.Cut(3),
    messages.Ended("run r finished at step 9; this node has nothing left to do"),
    messages.Fallback("workers did not reach a step boundary"),
    Outcome(0, "finished", step=100),
    Outcome(1, "exited", code=-11, message="", ran_s=0.5, kind="RuntimeError", where="train.py:3"),
    messages.ScriptStart(2, None),
    messages.ScriptStart(2, 12.5),
    messages.Trained(7),
    messages.Finished(90, 2, 3),
    messages.Finished(0, 1, None),
    messages.Stats(pid=77, round=3, step=40, time=1.7e9, round_first_step=1.7e9 - 5, steps_per_s=12.5),
    messages.Stats(
        pid=78,
        round=None,
        step=40,
        time=1.7e9,
        round_first_step=1.7e9,
        snapshots=40,
        snapshot_s=0.4,
        snapshot_last_s=0.01,
        durables=2,
        durable_s=3.0,
        durable_last_s=1.5,
        durable_bytes=1 << 20,
    ),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_survives_its_file(message: Any) -> None:
    encoded = json.loads(json.dumps(message.encode()))
    assert type(message).decode(encoded) == message


@pytest.mark.parametrize(
    ("kind", "record"),
    [
        (Assignment, {"round": 1, "node_rank": 2, "nodes": 2, "ranks": [0], "world_size": 2,
                      "master_addr": "h", "master_port": 1}),  # node rank beyond the nodes
        (Assignment, {"round": 1, "node_rank": 0, "nodes": 2, "ranks": [5], "world_size": 2,
                      "master_addr": "h", "master_port": 1}),  # a rank beyond the world
        (Assignment, {"round": 1, "node_rank": 0, "nodes": 2, "ranks": [0], "world_size": 2,
                      "master_addr": "h", "master_port": 0}),  # no port
        (Assignment, {"round": 1, "node_rank": 0, "nodes": 1, "master_addr": "h", "master_port": 1,
                      "standby_s": math.inf}),
        (Assignment, {"round": "x"}),
        (Assignment, {"round": True, "node_rank": 0, "nodes": 1, "master_addr": "h", "master_port": 1}),
        (messages.Ready, {"round": 1, "pid": 0}),
        (messages.Ready, {"round": 1, "pid": 5, "cut": "yes"}),
        (messages.Request, {"round": -1, "reason": "x"}),
        (Outcome, {"rank": 0, "state": "exploded"}),
        (Outcome, {"rank": 0, "state": "exited", "code": 1e9}),
        (Outcome, {"rank": 0, "state": "exited", "ran_s": float("nan")}),
        (messages.ScriptStart, {"rank": 0, "at": "soon"}),
        (messages.Finished, {"step": 9, "local_workers": 0}),
        (messages.Finished, {"step": -1, "local_workers": 1}),
        (messages.Change, {}),
        (messages.Stats, {"pid": 5, "round": 1, "step": "x", "time": 1.0, "round_first_step": 1.0}),
        (messages.Stats, {"pid": 5, "round": 1, "step": 1, "time": 1.0, "round_first_step": 1.0,
                          "snapshot_s": -1.0}),
        (messages.Stats, {"pid": 5, "round": 1, "step": 1, "time": float("inf"), "round_first_step": 1.0}),
    ],
)  # fmt: skip
def test_a_malformed_message_is_refused(kind: Any, record: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        kind.decode(record)


def test_an_unreadable_file_is_no_message(tmp_path: Path) -> None:
    worker = WorkerChannel(str(tmp_path))
    agent = AgentChannel(str(tmp_path))
    (tmp_path / "assignment.json").write_text("[1, 2")
    (tmp_path / "ready-0.json").write_text(json.dumps({"round": "x"}))
    (tmp_path / "ready-zz.json").write_text(json.dumps({"round": 1, "pid": 2}))
    (tmp_path / "change.json").write_text("null")
    assert worker.assignment() is None and agent.ready() == {} and not worker.change_after(0)


def test_worker_and_agent_see_each_others_messages(tmp_path: Path) -> None:
    agent = AgentChannel(str(tmp_path))
    workers = [WorkerChannel(str(tmp_path), r) for r in range(2)]
    assert agent.ready() == {} and agent.requests() == {} and workers[0].assignment() is None
    workers[0].register(1)
    workers[1].register(1, cut=True)
    assert {r: m.round for r, m in agent.ready().items()} == {0: 1, 1: 1}
    assert agent.ready()[0].pid == os.getpid() and not agent.cuttable()
    workers[1].request(1, "Connection reset by peer")
    assert agent.requests() == {1: messages.Request(1, "Connection reset by peer")}
    assert not workers[0].change_after(1)
    agent.announce(1)
    assert workers[0].change_after(1) and not workers[0].change_after(2)
    agent.cut(1)
    assert workers[0].cut_asked(1) and not workers[0].cut_asked(2)
    agent.assign(assignment())
    assert workers[1].assignment() == assignment() and assignment().rank(1) == 3
    workers[0].report(Outcome(0, "finished", step=5))
    workers[0].mark_trained(2)
    agent.start_group()  # a new worker group: the re-formation's messages go, the outcome and mark stay
    assert sorted(os.listdir(tmp_path)) == ["rank-0.json", "trained.json"]
    assert agent.take_outcomes() == [Outcome(0, "finished", step=5)] and agent.outcomes() == []
    assert agent.trained() == messages.Trained(2)


def test_the_node_is_finished_once_every_local_worker_marked_its_training_ended(tmp_path: Path) -> None:
    agent = AgentChannel(str(tmp_path))
    workers = [WorkerChannel(str(tmp_path), r) for r in range(2)]
    assert agent.finished() is None
    workers[1].mark_finished(90, 2, 3)
    assert agent.finished() is None  # one of the node's two workers: the other may still train or write
    workers[0].mark_finished(90, 2, 3)
    assert agent.finished() == 90
    agent.start_group()  # an in-process re-formation's messages go; the marks are the group's
    assert agent.finished() == 90
    agent.take_outcomes()  # torchrun asks for the next round: a new group starts, none of it finished
    assert agent.finished() is None
    (tmp_path / "finished-0.json").write_text(json.dumps({"step": 9, "local_workers": "all"}))
    assert agent.finished() is None  # a mark that does not decode is none


def test_a_worker_reports_at_most_once_a_second_and_at_once_in_a_new_round(tmp_path: Path) -> None:
    agent, worker = AgentChannel(str(tmp_path)), WorkerChannel(str(tmp_path))
    counter = worker.stats_counter()
    counter.committed(1, 1, 0.01)  # the first step: reported at once
    counter.committed(1, 2, 0.03, (2, 1.5, 100))
    counter.committed(1, 3, 0.02, (2, 1.5, 100))  # the same checkpoint: counted once
    (mine,) = agent.stats().values()
    assert (mine.pid, mine.round, mine.step, mine.snapshots, mine.durables) == (os.getpid(), 1, 1, 1, 0)
    counter.committed(2, 4, 0.02)  # a new round: reported at once
    (mine,) = agent.stats().values()
    assert (mine.round, mine.step, mine.snapshots, mine.durables, mine.durable_bytes) == (2, 4, 4, 1, 100)
    assert mine.snapshot_s == pytest.approx(0.08) and mine.round_first_step <= time.time()
    counter.count_durable(9, 2.0, 50)  # the final checkpoint, reported when the training ends
    counter.flush()
    (mine,) = agent.stats().values()
    assert (mine.durables, mine.durable_bytes, mine.durable_last_s) == (2, 150, 2.0)
    agent.forget_stats(os.getpid())
    assert agent.stats() == {}


def test_figures_in_a_file_named_for_another_process_are_no_message(tmp_path: Path) -> None:
    record = {"pid": 5, "round": 1, "step": 1, "time": 1.0, "round_first_step": 1.0}
    (tmp_path / "stats-6.json").write_text(json.dumps(record))
    assert AgentChannel(str(tmp_path)).stats() == {}


def test_a_waiting_worker_gets_the_newer_assignment_or_the_agents_refusal(tmp_path: Path) -> None:
    agent, worker = AgentChannel(str(tmp_path)), WorkerChannel(str(tmp_path))
    agent.assign(assignment(1))
    threading.Timer(0.2, agent.assign, args=(assignment(2),)).start()
    started = time.monotonic()
    got = worker.wait_assignment(after=1, timeout=30)
    assert got is not None and got.round == 2 and time.monotonic() - started < 10
    threading.Timer(0.2, agent.give_up, args=("workers did not reach a step boundary",)).start()
    assert worker.wait_assignment(after=2, timeout=30) is None
    assert worker.fallback() == "workers did not reach a step boundary"


def test_a_standby_worker_reports_ready_and_learns_that_the_run_ended(tmp_path: Path) -> None:
    agent, worker = AgentChannel(str(tmp_path)), WorkerChannel(str(tmp_path))
    worker.standby(4)
    assert agent.standbys() == {0: messages.Standby(4, os.getpid())}
    assert agent.ready() == {}  # not registered for re-formations before it is admitted
    line = "run r finished at step 9; this node has nothing left to do"
    threading.Timer(0.2, agent.end, args=(line,)).start()
    started = time.monotonic()
    assert worker.wait_assignment(after=4, timeout=30) is None and time.monotonic() - started < 10
    assert worker.ended() == line


def test_the_scripts_start_marks_tell_how_far_the_scripts_got(tmp_path: Path) -> None:
    agent = AgentChannel(str(tmp_path))
    workers = [WorkerChannel(str(tmp_path), r) for r in range(2)]
    assert agent.script_clock() is None
    workers[0].mark_script(0, started=False)
    workers[1].mark_script(1, started=False)
    assert agent.script_clock() == (True, None)
    before = time.monotonic()
    workers[0].mark_script(0, started=True)
    pending, at = agent.script_clock()  # type: ignore[misc]
    assert pending and at is not None and at >= before
    workers[1].mark_script(1, started=True)
    assert agent.script_clock() == (False, pytest.approx(time.monotonic(), abs=5))
    (tmp_path / "start-2.json").write_text("[1, 2")  # torn or foreign: ignored
    assert agent.script_clock()[0] is False  # type: ignore[index]
    agent.take_outcomes()
    assert agent.script_clock() is None


def test_the_channel_comes_from_the_environment(tmp_path: Path) -> None:
    assert WorkerChannel.from_environ({}) is None
    assert WorkerChannel.from_environ({ENV_NODE_DIR: str(tmp_path / "gone")}) is None
    channel = WorkerChannel.from_environ({ENV_NODE_DIR: str(tmp_path), "LOCAL_RANK": "3"})
    assert channel is not None and channel.directory == str(tmp_path) and channel.local_rank == 3


def test_beats_count_steps_and_other_progress_into_one_file_per_process(tmp_path: Path) -> None:
    loop, manager = Beat(str(tmp_path)), Beat(str(tmp_path))  # two counters of one process add up
    for _ in range(5):
        loop.step()
    manager.progress()
    manager.progress()
    assert read_beats(str(tmp_path)) == {os.getpid(): Beats(steps=5, other=2)}
    (tmp_path / "beat-77").write_bytes(b"\x01")  # torn: left out
    assert AgentChannel(str(tmp_path)).beats() == {os.getpid(): Beats(5, 2)}
    loop.close()
    manager.close()
    AgentChannel(str(tmp_path)).clear_beats()
    assert read_beats(str(tmp_path)) == {}
    Beat(None).step()  # outside an agent: nothing


def test_the_publish_gate_answers_for_the_round_asked(tmp_path: Path) -> None:
    asked: list[int] = []

    def answer(round_: int) -> str:
        asked.append(round_)
        return CURRENT if round_ == 4 else STALE

    server = GateServer(str(tmp_path), answer)
    try:
        assert ask(str(tmp_path), 4) == CURRENT and ask(str(tmp_path), 3) == STALE and asked == [4, 3]
        assert Link(str(tmp_path), 4).may_publish() == CURRENT
    finally:
        server.close()
    assert ask(str(tmp_path), 4, timeout=1) == UNKNOWN  # nobody answers: unconfirmed
    assert Link(None, None).may_publish() == CURRENT and not Link(None, None).gated  # outside an agent
    assert Link(str(tmp_path), 3).may_publish(timeout=1) == UNKNOWN  # an agent dir without a gate


def test_a_link_from_the_environment_carries_the_round_of_the_last_assignment(tmp_path: Path) -> None:
    AgentChannel(str(tmp_path)).assign(assignment(6))
    link = Link.from_env({ENV_NODE_DIR: str(tmp_path)})
    assert (link.directory, link.round, link.gated) == (str(tmp_path), 6, True)
    assert Link.from_env({}).round is None


def test_the_contract_imports_neither_torch_nor_etcd() -> None:
    """Both sides import the contract: the stand-in (no torch) and the agent's layer (no training)."""
    import ast

    package = Path(__file__).resolve().parents[2] / "elastic_train" / "node"
    third_party = set()
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                third_party.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                third_party.add(node.module.split(".")[0])
    assert not third_party & {"torch", "etcd3", "grpc", "psutil", "numpy"}, third_party
