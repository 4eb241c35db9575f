"""The agent-worker channel of in-process re-formation, and which failures a worker re-forms after."""

from __future__ import annotations

import os
import threading
import time

import pytest

from elastic_train.envvars import ENV_REFORM_DIR
from elastic_train.reform import Assignment, Channel
from elastic_train.train.hot import GroupChanged, group_failure


def assignment(round_: int = 2, **kw) -> Assignment:
    base = dict(round=round_, node_rank=1, nodes=2, ranks=[2, 3], world_size=4, master_addr="127.0.0.1",
                master_port=29500)  # fmt: skip
    base.update(kw)
    return Assignment(**base)  # type: ignore[arg-type]


def test_worker_and_agent_see_each_others_records(tmp_path):
    ch = Channel(str(tmp_path))
    assert ch.ready() == {} and ch.requests() == {} and ch.assignment() is None
    ch.register(0, 1)
    ch.register(1, 1)
    assert ch.ready() == {0: 1, 1: 1}
    assert ch.registered()[0]["pid"] == os.getpid()
    ch.request(1, 1, "Connection reset by peer")
    assert ch.requests() == {1: {"round": 1, "reason": "Connection reset by peer"}}
    assert not ch.change_after(1)
    ch.announce(1)
    assert ch.change_after(1) and not ch.change_after(2)
    ch.publish(assignment())
    assert ch.assignment() == assignment() and ch.assignment().rank(1) == 3
    ch.reset()
    assert os.listdir(tmp_path) == []


def test_waiting_worker_gets_the_newer_assignment_or_the_agents_refusal(tmp_path):
    ch = Channel(str(tmp_path))
    ch.publish(assignment(1))
    threading.Timer(0.2, ch.publish, args=(assignment(2),)).start()
    started = time.monotonic()
    got = ch.wait_assignment(after=1, timeout=30)
    assert got is not None and got.round == 2 and time.monotonic() - started < 10
    threading.Timer(0.2, ch.give_up, args=("workers did not reach a step boundary",)).start()
    assert ch.wait_assignment(after=2, timeout=30) is None
    assert ch.fallback() == "workers did not reach a step boundary"


@pytest.mark.parametrize(
    "record",
    [
        {"round": 1, "node_rank": 2, "nodes": 2, "ranks": [0], "world_size": 2, "master_addr": "h",
         "master_port": 1},
        {"round": 1, "node_rank": 0, "nodes": 2, "ranks": [5], "world_size": 2, "master_addr": "h",
         "master_port": 1},
        {"round": 1, "node_rank": 0, "nodes": 2, "ranks": [0], "world_size": 2, "master_addr": "h",
         "master_port": 0},
        {"round": "x"},
    ],
)  # fmt: skip
def test_a_malformed_assignment_is_no_assignment(tmp_path, record):
    import json

    (tmp_path / "assignment.json").write_text(json.dumps(record))
    assert Channel(str(tmp_path)).assignment() is None


def test_the_channel_comes_from_the_environment(tmp_path):
    assert Channel.from_environ({}) is None
    assert Channel.from_environ({ENV_REFORM_DIR: str(tmp_path / "gone")}) is None
    assert Channel.from_environ({ENV_REFORM_DIR: str(tmp_path)}).directory == str(tmp_path)  # type: ignore[union-attr]


def test_only_a_broken_group_is_re_formed_in_process():
    gloo = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1455: "
        "Connection reset by peer"
    )
    assert group_failure(gloo) is not None
    try:
        try:
            raise gloo
        except RuntimeError as exc:
            raise ValueError("a checkpoint write failed") from exc
    except ValueError as wrapped:
        assert group_failure(wrapped) is not None  # the cause counts
    assert group_failure(GroupChanged("round 3")) == "membership change announced"
    assert group_failure(RuntimeError("shapes do not match")) is None  # the user's own error
    assert group_failure(KeyError("x")) is None
    # NCCL: a peer gone re-forms, a poisoned CUDA context restarts (tests/unit/test_hot_failure.py)
    assert (
        group_failure(RuntimeError("NCCL error: unhandled system error, Connection reset by peer"))
        is not None
    )
    assert group_failure(RuntimeError("CUDA error: an illegal memory access was encountered")) is None


def test_a_standby_worker_reports_ready_and_learns_that_the_run_ended(tmp_path):
    ch = Channel(str(tmp_path))
    ch.standby(0, 4)
    assert ch.standbys() == {0: {"round": 4, "pid": os.getpid()}}
    assert ch.ready() == {}  # not registered for re-formations before it is admitted
    threading.Timer(0.2, ch.end, args=("run r finished at step 9; this node has nothing left to do",)).start()
    started = time.monotonic()
    assert ch.wait_assignment(after=4, timeout=30) is None and time.monotonic() - started < 10
    assert ch.ended() == "run r finished at step 9; this node has nothing left to do"


def test_a_standby_worker_exits_0_when_its_run_ended_before_admission(tmp_path, monkeypatch):
    from elastic_train.envvars import ENV_ROUND, ENV_STANDBY
    from elastic_train.train.env import WorkerEnv
    from elastic_train.train.hot import Reformer, RunEnded, run

    monkeypatch.setenv(ENV_REFORM_DIR, str(tmp_path))
    monkeypatch.setenv(ENV_ROUND, "3")
    monkeypatch.setenv(ENV_STANDBY, "30")
    env = WorkerEnv.from_environ(os.environ)
    reformer = Reformer.from_environ(env)
    assert reformer is not None and reformer.standby == 30.0
    Channel(str(tmp_path)).end("run r finished")
    called = []
    with pytest.raises(RunEnded) as ended:
        run(called.append, env)
    assert ended.value.code == 0 and ended.value.message == "run r finished" and called == []
    assert Channel(str(tmp_path)).standbys()[0]["round"] == 3
    assert ENV_STANDBY not in os.environ  # later re-formations wait as long as any worker's
