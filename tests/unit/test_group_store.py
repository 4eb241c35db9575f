"""The bootstrap store of a worker group: ranks other than 0 reach rank 0's store as soon as it listens."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from elastic_train.net import free_port
from elastic_train.train import group
from elastic_train.train.env import WorkerEnv
from elastic_train.train.errors import TrainingError


def _env(rank: int, port: int) -> WorkerEnv:
    return WorkerEnv(
        rank=rank,
        world_size=2,
        local_rank=0,
        round=1,
        round_is_global=True,
        local_world_size=1,
        restart_count=0,
        run_id=None,
        master_addr="127.0.0.1",
        master_port=port,
        agent_store=False,
    )


def test_a_rank_reaches_a_store_as_soon_as_it_opens() -> None:
    """torch's own client retries a refused connection after a jittered delay (hundreds of milliseconds);
    ours polls, so a rank that started looking before rank 0 opened its store is connected right after."""
    port = free_port()
    got: dict[str, object] = {}

    def client() -> None:
        store = group._open_store(_env(1, port), timedelta(seconds=30))
        got["connected"] = time.perf_counter()
        store.set("from-1", "hello")

    thread = threading.Thread(target=client)
    thread.start()
    time.sleep(0.3)
    opened = time.perf_counter()
    server = group._open_store(_env(0, port), timedelta(seconds=30))
    thread.join(30)
    assert not thread.is_alive()
    assert server.get("from-1") == b"hello"
    lag = float(got["connected"]) - opened  # type: ignore[arg-type]
    assert lag < 0.1, f"connected {lag:.3f} s after the store opened"


def test_a_store_that_never_opens_is_an_error_naming_it() -> None:
    port = free_port()
    with pytest.raises(TrainingError, match=f"127.0.0.1:{port} did not open within 0.2 s"):
        group._open_store(_env(1, port), timedelta(seconds=0.2))
