"""The initial nodes of ``elastic-train local`` enter their first rendezvous together: each waits until all of
them are ready, and goes on alone (saying so) when one never comes."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from elastic_train.envvars import ENV_START_BARRIER
from elastic_train.launch.run import start_barrier


def test_without_a_barrier_a_node_goes_on_at_once() -> None:
    assert start_barrier({})


def test_a_node_waits_for_the_others_then_goes_on(tmp_path: Path) -> None:
    env = {ENV_START_BARRIER: f"{tmp_path}:2"}
    done: list[float] = []
    t = threading.Thread(target=lambda: done.append(time.monotonic()) if start_barrier(env, 30) else None)
    t.start()
    time.sleep(0.3)
    assert not done, "went on before the other node was ready"
    assert (tmp_path / str(os.getpid())).exists()
    ready = time.monotonic()
    (tmp_path / "4242").touch()  # the other node
    t.join(10)
    assert done and done[0] >= ready


def test_a_node_that_never_comes_is_not_waited_for_past_the_limit(tmp_path: Path) -> None:
    started = time.monotonic()
    assert not start_barrier({ENV_START_BARRIER: f"{tmp_path}:3"}, timeout=0.3)
    assert time.monotonic() - started < 5


def test_an_unusable_barrier_is_no_reason_to_stop(tmp_path: Path) -> None:
    assert not start_barrier({ENV_START_BARRIER: f"{tmp_path / 'missing'}:2"})
    assert not start_barrier({ENV_START_BARRIER: "nonsense"})
