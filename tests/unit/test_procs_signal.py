"""signal_tree tells its caller when the tree is known, right before the first signal."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import psutil

from elastic_train.procs import signal_tree, tied


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


#: A parent with other threads (as an agent with gRPC's and its watchers') that starts a helper through
#: ``tied``, prints its PID once the helper runs its own command, and waits.
PARENT = """
import subprocess, sys, threading, time
import psutil
from elastic_train.procs import tied
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
child = subprocess.Popen(tied([sys.executable, "-c", "import time; time.sleep(60)"]))
while "time.sleep(60)" not in " ".join(psutil.Process(child.pid).cmdline()):
    time.sleep(0.01)
print(child.pid, flush=True)
time.sleep(60)
"""


def test_a_helper_started_tied_is_its_command_and_ends_with_its_parent() -> None:
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


def test_a_tied_helper_whose_parent_is_already_gone_never_runs_its_command(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The launcher finds another parent than the one that asked (the starter died before the kernel could
    be asked): it ends at once, and the command, which nothing would end, never starts."""
    marker = tmp_path / "ran"
    command = tied(["touch", str(marker)])
    command[command.index(str(os.getpid()))] = str(os.getpid() + 1_000_000)  # a parent that is not this one
    assert subprocess.run(command, timeout=30).returncode == 1
    assert not marker.exists()
    assert subprocess.run(tied(["touch", str(marker)]), timeout=30).returncode == 0 and marker.exists()
