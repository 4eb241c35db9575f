"""A worker stopped with SIGTERM first finishes the snapshot copy in flight (at most DRAIN_LIMIT), then dies
of the signal as before, also while its training thread is busy; a script's own handler is left alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from elastic_train.checkpoint import drain

CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    from elastic_train.checkpoint import drain

    busy_s, marker, own_handler = float(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
    if own_handler:
        signal.signal(signal.SIGTERM, lambda *a: (open(marker + ".own", "w").close(), os._exit(7)))

    class Copying:
        def __init__(self):
            self.until = time.monotonic() + busy_s

        def wait_idle(self, timeout=None):
            left = self.until - time.monotonic()
            if timeout is not None and left > timeout:
                time.sleep(timeout)
                return False
            time.sleep(max(0.0, left))
            open(marker, "w").close()  # sealed
            return True

    snap = Copying()
    drain.register(snap)
    snap.until = time.monotonic() + busy_s
    open(marker + ".ready", "w").close()
    while True:
        time.sleep(60)  # the training thread, busy elsewhere
    """
)


def run_child(tmp_path: Path, busy_s: float, *, own_handler: bool = False) -> tuple[int, float, Path]:
    marker = tmp_path / "sealed"
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(busy_s), str(marker), "1" if own_handler else "0"], env=env
    )
    try:
        deadline = time.monotonic() + 60
        while not Path(str(marker) + ".ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the child did not start"
            time.sleep(0.02)
        # the copy still has about busy_s to go
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        return code, time.monotonic() - started, marker
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_stopped_worker_seals_the_copy_in_flight_then_dies_of_the_signal(tmp_path: Path) -> None:
    code, took, marker = run_child(tmp_path, 0.5)
    assert code == -signal.SIGTERM
    assert marker.exists(), "the process died before the copy in flight was sealed"
    assert took >= 0.3


def test_a_copy_that_does_not_finish_holds_the_process_no_longer_than_the_limit(tmp_path: Path) -> None:
    code, took, marker = run_child(tmp_path, 60.0)
    assert code == -signal.SIGTERM
    assert not marker.exists()
    assert drain.DRAIN_LIMIT * 0.8 <= took < drain.DRAIN_LIMIT + 10


def test_a_scripts_own_sigterm_handler_is_left_alone(tmp_path: Path) -> None:
    code, _, marker = run_child(tmp_path, 0.5, own_handler=True)
    assert code == 7 and Path(str(marker) + ".own").exists()
