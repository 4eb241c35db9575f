"""A per-node fork server that starts workers with torch already imported.

On a small job most of a recovery is worker start-up: a fresh interpreter importing torch, torch.distributed
and DDP takes 1.5 s or more per worker, every time the group restarts. ``elastic-train run`` therefore starts
one fork server per node, which imports everything a worker needs once and then forks a worker on request.
The first one is a fork of the agent taken right after the agent imported torch, while the agent runs no
other thread yet (no gRPC channel: a fork copies every lock another thread may hold), so that torch is
imported once per node; a replacement for a server that died is a fresh interpreter.

torchrun still starts ``python -m elastic_train.worker`` as usual. When :data:`ENV_SOCKET` is set, that
process is a thin *stand-in*: it hands its argv, environment, working directory and stdio to the fork server,
which forks the real worker. The stand-in forwards signals to the worker and exits with the worker's status,
so the agent's view (a PID per worker, its exit code, SIGTERM/SIGKILL on stop) is unchanged. If the stand-in
dies (SIGKILL), the server kills its worker; if the server dies, stand-ins kill their workers and fail.

The server never runs a tensor operation, so torch's intra-op thread pool (OpenMP) is not started before a
fork; the only native thread a preloaded torch has is OpenBLAS's, which re-initialises itself in the child
through its own fork handlers.

Wire format on the Unix socket: the stand-in sends one length-prefixed JSON request with fds 0, 1, 2 attached
(SCM_RIGHTS); the server answers ``{"pid": N}`` and later ``{"exit": CODE}`` (negative: killed by signal).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import select
import signal
import socket
import struct
import sys
from collections.abc import Callable, Sequence
from typing import Any

from elastic_train import torchcompat
from elastic_train.envvars import ENV_SHM_OWNER

#: Unix socket of this node's fork server; when set, ``python -m elastic_train.worker`` is a stand-in.
ENV_SOCKET = "ELASTIC_TRAIN_FORKSERVER"
#: Modules the server imports before forking (everything a worker needs except the user's task module).
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch.optim",
    *torchcompat.PRELOAD,  # torch._dynamo: imported lazily by the first Optimizer(), over a second on its own
    "elastic_train.train.tasks.charlm",
    "elastic_train.train.tasks.regression",
    "elastic_train.worker.main",
    "elastic_train.worker.run",
    "elastic_train.train.loop",
    "elastic_train.checkpoint",
)
#: Further modules to preload, comma-separated (``elastic-train run --preload``): a user's framework
#: (Lightning) and own modules, so a restarted worker does not import them again.
ENV_PRELOAD = "ELASTIC_TRAIN_PRELOAD"
#: PID of that fork server; a stand-in waits for the socket only while this process lives.
ENV_PID = "ELASTIC_TRAIN_FORKSERVER_PID"
#: Seconds a stand-in waits for a fork server that is still importing before starting the worker itself.
CONNECT_WAIT = 60.0
_LEN = struct.Struct("!I")
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
#: Signals whose default action stops a process rather than ending it.
_STOP_SIGNALS = frozenset({signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU})


def _send(sock: socket.socket, obj: dict[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(obj).encode()
    payload = _LEN.pack(len(data)) + data
    if fds:
        sent = socket.send_fds(sock, [payload], list(fds))
        payload = payload[sent:]
    if payload:
        sock.sendall(payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("connection closed")
        buf += chunk
    return buf


def _recv(sock: socket.socket) -> dict[str, Any]:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    result: dict[str, Any] = json.loads(_recv_exact(sock, n))
    return result


# -- stand-in (the process torchrun sees) ----------------------------------------------------------------


def run_standin(
    path: str,
    argv: Sequence[str],
    entry: Sequence[str] = (),
    on_start: Callable[[], None] | None = None,
    on_signal: Callable[[int], None] | None = None,
) -> int:
    """Have the fork server start the worker, mirror its life, return its exit code.

    Args:
        path: the server's socket.
        argv: the worker's arguments.
        entry: what the worker runs: empty for ``elastic_train.worker``, ``["-m", MODULE]`` or ``[SCRIPT]``.
        on_start: called once the worker runs (forked, or about to run here).
        on_signal: called with each signal forwarded to the worker (its agent stops it).

    Falls back to running the worker in this process when the server cannot be reached.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        _connect(sock, path, os.environ.get(ENV_PID))
        env = dict(os.environ)
        env.pop(ENV_SOCKET, None)
        env.pop(ENV_PID, None)
        env.setdefault(ENV_SHM_OWNER, str(os.getppid()))
        request = {"argv": list(argv), "entry": list(entry), "env": env, "cwd": os.getcwd()}
        _send(sock, request, [0, 1, 2])
        pid = int(_recv(sock)["pid"])
    except (OSError, EOFError, ValueError, KeyError) as exc:
        sock.close()
        sys.stderr.write(f"elastic_train: fork server unavailable ({exc}); starting the worker directly\n")
        if on_start is not None:
            on_start()
        return run_entry(list(entry), list(argv))
    if on_start is not None:
        on_start()

    def forward(signum: int, _frame: object) -> None:
        if on_signal is not None:
            on_signal(signum)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for sig in _FORWARDED:
        signal.signal(sig, forward)
    try:
        while True:
            try:
                return int(_recv(sock)["exit"])
            except InterruptedError:
                continue
    except (OSError, EOFError, ValueError, KeyError):
        # The server went away: the worker must not outlive its stand-in's knowledge of it.
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        sys.stderr.write("elastic_train.worker: fork server lost; worker killed\n")
        return 1
    finally:
        sock.close()


def _connect(sock: socket.socket, path: str, server_pid: str | None) -> None:
    """Connect, waiting while the server (started in parallel with the rendezvous) is still importing."""
    import time

    deadline = time.monotonic() + CONNECT_WAIT
    while True:
        try:
            sock.connect(path)
            return
        except (FileNotFoundError, ConnectionRefusedError):
            if not _alive(server_pid) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _alive(pid: str | None) -> bool:
    """Whether ``pid`` is a running process (a zombie that nobody reaped yet is not)."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def exit_like(code: int) -> None:
    """Exit this process the way the worker did: killed by its signal when it was killed by one.

    The signal's default action is restored first where a handler can be set (SIGKILL has none: its default
    applies anyway) and it is unblocked; a signal that killed the worker ends a process by default. A stop
    signal is never raised here (it would stop this process instead of ending it), and should this process
    still live, it exits with the shell's code for the signal, 128 + its number.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:
        sig = -code
        if sig not in _STOP_SIGNALS:
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, signal.SIG_DFL)
            with contextlib.suppress(OSError, ValueError):
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
                os.kill(os.getpid(), sig)
        code = 128 + sig
    sys.exit(code)


# -- server ----------------------------------------------------------------------------------------------


class ForkServer:
    """Single-threaded accept/fork/reap loop; forking only ever happens with this one thread alive."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self.listener.bind(path)
        os.chmod(path, 0o600)
        self.listener.listen(64)
        self.children: dict[int, socket.socket] = {}  # worker pid -> its stand-in's connection
        self.conns: dict[socket.socket, int] = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        signal.signal(signal.SIGCHLD, lambda *_: _poke(self._wake_w))
        self.running = True
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._stop)

    def _stop(self, *_: object) -> None:
        self.running = False
        _poke(self._wake_w)

    def serve(self) -> None:
        while self.running:
            watched: list[Any] = [self.listener, self._wake_r, *self.conns]
            ready, _, _ = select.select(watched, [], [], 1.0)
            for r in ready:
                if r is self.listener:
                    self._accept()
                elif r == self._wake_r:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                elif isinstance(r, socket.socket):
                    self._on_standin_readable(r)
            self._reap()
        self.close()

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        try:
            conn.settimeout(10.0)
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            (n,) = _LEN.unpack(msg[: _LEN.size])
            body = msg[_LEN.size :]
            if len(body) < n:
                body += _recv_exact(conn, n - len(body))
            request = json.loads(body[:n])
            conn.settimeout(None)
        except (OSError, ValueError, EOFError):
            conn.close()
            return
        pid = os.fork()
        if pid == 0:  # the worker
            code = 1
            try:
                self.listener.close()
                for c in self.conns:
                    c.close()
                conn.close()
                os.close(self._wake_r)
                os.close(self._wake_w)
                code = _become_worker(request, fds)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException:
                # as the interpreter would: an excepthook the worker installed (elastic_train.init's
                # one-line errors) applies
                sys.excepthook(*sys.exc_info())
            finally:
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)
        for fd in fds:
            os.close(fd)
        self.children[pid] = conn
        self.conns[conn] = pid
        with contextlib.suppress(OSError):
            _send(conn, {"pid": pid})

    def _on_standin_readable(self, conn: socket.socket) -> None:
        # A stand-in never sends after its request: readable means it closed (it died): kill its worker.
        pid = self.conns.get(conn)
        with contextlib.suppress(OSError):
            if conn.recv(1):
                return
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._forget(conn)

    def _forget(self, conn: socket.socket) -> None:
        pid = self.conns.pop(conn, None)
        if pid is not None:
            self.children.pop(pid, None)
        conn.close()

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.get(pid)
            if conn is not None:
                with contextlib.suppress(OSError):
                    _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                self._forget(conn)

    def close(self) -> None:
        for pid in list(self.children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for conn in list(self.conns):
            self._forget(conn)
        self.listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _poke(fd: int) -> None:
    with contextlib.suppress(BlockingIOError, OSError):
        os.write(fd, b"x")


def _become_worker(request: dict[str, Any], fds: list[int]) -> int:
    """In the forked child: take over the stand-in's stdio, environment, cwd and argv; run the worker."""
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    for target, fd in zip((0, 1, 2), fds, strict=False):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = io.TextIOWrapper(os.fdopen(0, "rb", buffering=0), errors="replace")
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0), write_through=True, errors="replace")
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", buffering=0), write_through=True, errors="replace")
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    return run_entry(list(request.get("entry") or []), list(request["argv"]))


def run_entry(entry: list[str], argv: list[str]) -> int:
    """Run the worker ``entry`` (see :func:`run_standin`) with ``argv`` in this process; its exit code.

    Wrapped in torch's ``@record``: an exception the worker (ours or a user's script) lets escape is written
    to torchrun's error file, so the agent's failure summary shows it and its traceback. (Imported here: the
    stand-in, which imports this module, must stay free of torch.)
    """
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(_run_entry)(entry, argv) or 0


def _run_entry(entry: list[str], argv: list[str]) -> int:
    import runpy

    if not entry:
        sys.argv = [sys.argv[0], *argv]
        from elastic_train.worker.main import main

        return main(argv) or 0
    try:
        if entry[0] == "-m":
            sys.argv = [entry[1], *argv]
            runpy.run_module(entry[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = [entry[0], *argv]
            sys.path.insert(0, os.path.dirname(os.path.abspath(entry[0])))
            runpy.run_path(entry[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        sys.stderr.write(f"{exc.code}\n")
        return 1
    return 0


def parse_preload(value: str | None) -> list[str]:
    """``MOD[,MOD...]`` → module names (empty entries dropped).

    Raises:
        ValueError: a name is not a dotted Python module name.
    """
    names = [n.strip() for n in (value or "").split(",") if n.strip()]
    for name in names:
        if not all(part.isidentifier() for part in name.split(".")):
            raise ValueError(f"--preload: {name!r} is not a module name")
    return names


def serve(path: str, preload: Sequence[str] = ()) -> None:
    """Import what workers need (and ``preload``), then listen on ``path`` and serve until SIGTERM.

    A module of ``preload`` that fails to import is reported on stderr and skipped: the worker that imports
    it reports the error itself.
    """
    import importlib
    import time

    from elastic_train.log import get_logger  # not at the top: a stand-in needs no structlog

    started = time.perf_counter()
    inherited = "torch" in sys.modules  # a fork of an agent that imported torch: imported once on this node
    for name in PRELOAD:
        importlib.import_module(name)
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception as exc:  # the user's module: its own workers report it with a traceback
            sys.stderr.write(f"elastic_train: fork server: --preload {name}: not preloaded ({exc})\n")
    server = ForkServer(path)
    # a stand-in waits for this moment: a joining node's start is timed against it (benchmarks/hot.py)
    get_logger("elastic_train.worker.forkserver").info(  # __name__ is __main__ in a fresh server
        "forkserver_ready",
        pid=os.getpid(),
        import_s=round(time.perf_counter() - started, 3),
        torch_inherited=inherited,
    )
    server.serve()


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    from elastic_train.log import configure_logging

    p = argparse.ArgumentParser(prog="python -m elastic_train.worker.forkserver")
    p.add_argument("--socket", required=True, help="Unix socket path to listen on")
    p.add_argument("--preload", default="", metavar="MOD[,MOD]", help="further modules to import first")
    args = p.parse_args(argv)
    try:
        preload = parse_preload(args.preload)
    except ValueError as exc:
        p.error(str(exc))
    configure_logging()  # a fresh server (a replacement): its events as the agent's (JSON off a terminal)
    serve(args.socket, preload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
