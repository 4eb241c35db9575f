"""signal_tree tells its caller when the tree is known, right before the first signal."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys

import psutil

from elastic_train.procs import signal_tree


def test_walked_is_called_after_the_walk_and_before_any_signal() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        seen: list[int | None] = []
        sent = signal_tree(child.pid, signal.SIGKILL, walked=lambda: seen.append(child.poll()))
        assert seen == [None]  # the child was still alive when the callback ran
        assert sent == [child.pid]
        assert child.wait(10) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


#: A parent that starts a helper with ``die_with_parent`` from a second thread of its own (as the fork
#: server's supervisor and the slow-node driver's watcher do), prints its PID and waits.
PARENT = """
import subprocess, sys, threading, time
from elastic_train.procs import die_with_parent
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # a process with other threads
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn=die_with_parent)
print(child.pid, flush=True)
time.sleep(60)
"""


def test_a_helper_started_with_die_with_parent_ends_with_its_parent() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        assert parent.stdout is not None
        child = psutil.Process(int(parent.stdout.readline()))
        parent.kill()
        parent.wait()
        child.wait(timeout=10)  # the kernel's SIGTERM on its parent's death (psutil.TimeoutExpired if not)
    finally:
        for p in (parent, child):
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                if p is not None:
                    p.kill()
