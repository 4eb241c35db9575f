"""``python -m elastic_train.worker.standin [-m MODULE | SCRIPT] ARGS...``: run any torchrun worker fast.

What torchrun starts when ``elastic-train run --entry ...`` launches a user's own training script. With
this node's fork server (started by ``elastic-train run``) the script runs in a process forked from one that
already imported torch; without one it simply runs here. Either way the script sees itself as ``__main__``
with its own ``sys.argv``, exactly as under plain torchrun.

The script's stderr passes through this process unchanged (a pipe, copied as it comes), so that when the
script exits non-zero the stand-in can leave its exit code and last stderr line for the agent
(:class:`~elastic_train.node.Outcome`): the same failure on every node before any step ends the run with
that line instead of burning the failure budget (docs/operating.md).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import replace

from elastic_train.node import Outcome, WorkerChannel
from elastic_train.worker.forkserver import ENV_SOCKET, exit_like, run_entry, run_standin

#: Bytes of the script's stderr kept to find its last line.
TAIL_BYTES = 4096


class StderrTail:
    """Copy everything written to fd 2 through a pipe to the real stderr, keeping the last bytes.

    Installed before the script starts, so the script (in this process, or forked by the fork server with
    this process's fd 2) writes into the pipe; :meth:`close` restores fd 2 and returns the last line.
    """

    def __init__(self) -> None:
        sys.stderr.flush()
        self._real = os.dup(2)
        read, write = os.pipe()
        os.dup2(write, 2)
        os.close(write)
        self._read = read
        self._tail = b""
        self._thread = threading.Thread(target=self._copy, name="stderr-tail", daemon=True)
        self._thread.start()

    def _copy(self) -> None:
        while True:
            try:
                chunk = os.read(self._read, 65536)
            except OSError:
                return
            if not chunk:
                return
            self._tail = (self._tail + chunk)[-TAIL_BYTES:]
            view = memoryview(chunk)
            while view:
                try:
                    view = view[os.write(self._real, view) :]
                except OSError:
                    break

    def close(self) -> str:
        """Restore fd 2, wait for what the script wrote (its copies of the pipe are closed once it exited)."""
        sys.stderr.flush()
        os.dup2(self._real, 2)
        self._thread.join(timeout=5)
        os.close(self._real)
        lines = [ln.strip() for ln in self._tail.decode("utf-8", "replace").splitlines() if ln.strip()]
        return lines[-1] if lines else ""


def split_entry(args: list[str]) -> tuple[list[str], list[str]]:
    """``["-m", "pkg.train", "--lr", "1"]`` → (["-m", "pkg.train"], ["--lr", "1"]); a script is one item."""
    if not args:
        sys.stderr.write("usage: python -m elastic_train.worker.standin [-m MODULE | SCRIPT] ARGS...\n")
        raise SystemExit(2)
    if args[0] == "-m":
        if len(args) < 2:
            sys.stderr.write("elastic_train.worker.standin: -m needs a module name\n")
            raise SystemExit(2)
        return args[:2], args[2:]
    return args[:1], args[1:]


def main() -> None:
    entry, argv = split_entry(sys.argv[1:])
    socket_path = os.environ.get(ENV_SOCKET)
    rank_text = os.environ.get("RANK", "0")
    rank = int(rank_text) if rank_text.isdigit() else 0
    channel = WorkerChannel.from_environ(os.environ)
    if channel is not None:
        channel.mark_script(rank, started=False)
    started = time.monotonic()

    def on_start() -> None:
        nonlocal started
        started = time.monotonic()
        if channel is not None:
            channel.mark_script(rank, started=True)

    signalled: list[int] = []
    tail = StderrTail()
    try:
        if socket_path:
            code = run_standin(socket_path, argv, entry, on_start, signalled.append)
        else:
            on_start()
            code = run_entry(entry, argv)
    finally:
        last = tail.close()
    if channel is not None and not signalled:  # a worker its agent stopped did not fail
        report_exit(channel, rank, code, last, round(time.monotonic() - started, 3))
    exit_like(code)


def report_exit(channel: WorkerChannel, rank: int, code: int, line: str, ran_s: float | None) -> None:
    """Leave a worker's exit for its agent (the start-up failure rule, docs/operating.md): its exit code
    (any but 0; negative: the signal that killed it), its last stderr line, and how long the script ran,
    completing what the worker reported itself (the exception's type and where it was raised). Nothing
    when the agent itself ended the group (it gave up on the in-process re-formation, or the run ended)."""
    if code == 0 or channel.fallback() is not None or channel.ended() is not None:
        return
    own = channel.outcome(rank)
    if own is None:
        channel.report(Outcome(rank, "exited", code=code, message=line, ran_s=ran_s))
    elif own.state == "exited":
        channel.report(replace(own, code=code, message=own.message or line, ran_s=ran_s))


if __name__ == "__main__":
    main()
