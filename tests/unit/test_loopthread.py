"""The asyncio loop thread under the loopback link and the latency proxy: start-up errors reach the caller,
calls run on the loop, stop runs the teardown and cancels every task left."""

from __future__ import annotations

import asyncio
import threading

import pytest

from elastic_train.launch.loopthread import LoopThread


def test_setup_error_is_raised_by_start() -> None:
    async def setup() -> None:
        raise OSError("address in use")

    thread = LoopThread("probe", setup)
    with pytest.raises(RuntimeError, match="probe did not start: OSError") as info:
        thread.start()
    assert isinstance(info.value.__cause__, OSError)
    thread.stop()  # nothing left to stop: returns


def test_call_runs_on_the_loop_and_stop_tears_down() -> None:
    seen: list[str] = []
    done = threading.Event()
    pending: list[asyncio.Task[None]] = []

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async def setup() -> None:
        pending.append(asyncio.ensure_future(forever()))

    async def teardown() -> None:
        seen.append("teardown")

    thread = LoopThread("probe", setup, teardown)
    thread.start()
    thread.call(lambda: (seen.append(threading.current_thread().name), done.set()))
    assert done.wait(10)
    thread.stop()
    assert seen == ["probe", "teardown", "cancelled"]
    assert pending[0].cancelled()
    thread.call(seen.append, "late")  # after stop: dropped, no error
    assert seen[-1] == "cancelled"
