"""The durable writers' background thread: one job in flight, waited for with heartbeats, stopped cleanly."""

from __future__ import annotations

import threading
import time

import pytest
import structlog

from elastic_train.checkpoint.background import BEAT_WHILE_WAITING, OneJob


def test_jobs_run_in_turn_on_one_named_thread() -> None:
    seen: list[tuple[int, str]] = []
    jobs: OneJob[int] = OneJob(lambda j: seen.append((j, threading.current_thread().name)), "test-writer")
    for j in range(3):
        jobs.submit(j)
        jobs.wait(beat=lambda: None)
        assert not jobs.busy
    assert seen == [(0, "test-writer"), (1, "test-writer"), (2, "test-writer")]
    assert jobs.stop(timeout=5)


def test_wait_beats_while_the_job_runs() -> None:
    release = threading.Event()
    beats: list[float] = []
    jobs: OneJob[None] = OneJob(lambda _: release.wait(10), "test-writer")
    jobs.submit(None)
    assert jobs.busy
    threading.Timer(4 * BEAT_WHILE_WAITING, release.set).start()
    jobs.wait(beat=lambda: beats.append(time.monotonic()))
    assert not jobs.busy and release.is_set()
    assert len(beats) >= 2, beats
    assert jobs.stop(timeout=5)


def test_a_job_that_raises_is_logged_and_the_next_one_runs() -> None:
    done: list[int] = []

    def run(j: int) -> None:
        if j == 0:
            raise RuntimeError("disk on fire")
        done.append(j)

    jobs: OneJob[int] = OneJob(run, "test-writer")
    with structlog.testing.capture_logs() as logs:
        jobs.submit(0)
        jobs.wait(beat=lambda: None)
        jobs.submit(1)
        jobs.wait(beat=lambda: None)
    assert done == [1]
    assert jobs.stop(timeout=5)
    (rec,) = [r for r in logs if r["event"] == "background_job_failed"]
    assert rec["thread"] == "test-writer" and "disk on fire" in rec["error"]


def test_stop_lets_the_job_in_flight_end_and_says_whether_it_did() -> None:
    release = threading.Event()
    jobs: OneJob[None] = OneJob(lambda _: release.wait(10), "test-writer")
    assert jobs.stop(timeout=0)  # no thread made yet
    jobs = OneJob(lambda _: release.wait(10), "test-writer")
    jobs.submit(None)
    assert not jobs.stop(timeout=0.2)  # the job holds it
    release.set()
    assert jobs.stop(timeout=5)
    assert not jobs.busy


def test_a_second_job_while_one_is_in_flight_is_a_caller_error() -> None:
    release = threading.Event()
    jobs: OneJob[None] = OneJob(lambda _: release.wait(10), "test-writer")
    jobs.submit(None)
    with pytest.raises(AssertionError, match="wait"):
        jobs.submit(None)
    release.set()
    assert jobs.stop(timeout=5)
