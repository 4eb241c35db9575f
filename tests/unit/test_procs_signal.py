"""signal_tree tells its caller when the tree is known, right before the first signal."""

from __future__ import annotations

import signal
import subprocess
import sys

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
