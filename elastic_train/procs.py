"""Process-tree helpers: find, signal and reap the processes a node consists of.

torchrun starts its workers in their own sessions, so "a node" is the agent process plus every descendant;
a node failure is SIGKILL of all of them, a hung node SIGSTOP of all of them. Everything works by PID on
processes this program started, never by name. An agent's scratch directories are named by their owner
(:func:`scratch_dir`), so the next agent on the machine removes those of one that was killed.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable

import psutil

_PR_SET_PDEATHSIG = 1
#: Clock ticks a second, the unit of :func:`start_ticks`.
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _libc_prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


#: libc's ``prctl``, looked up once at import.
_PRCTL = _libc_prctl()


def die_with_parent() -> None:
    """Ask the kernel for SIGTERM when this process's parent dies (Linux; a no-op elsewhere).

    Called by a helper itself, first thing (or by :func:`tied`'s launcher), never as a ``preexec_fn``: code
    run between fork and exec in the child of a process with other threads (gRPC's, a watcher's) can
    crash or deadlock on a lock another thread held at the fork, and a ``preexec_fn`` also makes
    ``subprocess`` fork where it would otherwise use ``vfork``, running every at-fork handler."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


#: The launcher of :func:`tied`: asks for the parent-death signal, ends if its parent is already gone (the
#: signal would never come), then becomes the command. ``-S -I``: no site packages, no user paths (the command
#: gets the environment as given); about 40 ms before the command starts.
_TIED = """\
import ctypes, os, sys
try:
    ctypes.CDLL("libc.so.6").prctl(1, 15)
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def tied(command: list[str]) -> list[str]:
    """``command`` run so that it gets SIGTERM when the process starting it now dies: a launcher asks the
    kernel for it, then execs the command (same PID). For helpers that cannot ask for it themselves (etcd);
    see :func:`die_with_parent` for why not a ``preexec_fn``."""
    return [sys.executable, "-S", "-I", "-c", _TIED, str(os.getpid()), *command]


def running(pid: int) -> bool:
    """Whether process ``pid`` runs (one that exited, or a zombie not reaped yet, does not)."""
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except (psutil.Error, ValueError):
        return False


def tree(pid: int) -> list[psutil.Process]:
    """The process ``pid`` and all its descendants (empty if it is gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def signal_tree(pid: int, sig: int, walked: Callable[[], None] | None = None) -> list[int]:
    """Send ``sig`` to ``pid`` and its descendants (children first for SIGSTOP, so none can react).

    Args:
        pid: the root of the tree.
        sig: the signal.
        walked: called once the tree is known, right before the first signal: finding the descendants
            reads all of ``/proc`` and takes 0.1-0.3 s on a busy machine, which a fault's clock must not
            count.

    Returns:
        The PIDs signalled.
    """
    procs = tree(pid)
    if walked is not None:
        walked()
    if sig == signal.SIGSTOP:
        procs = list(reversed(procs))
    return signal_all(procs, sig)


def signal_all(procs: list[psutil.Process], sig: int) -> list[int]:
    """Send ``sig`` to each of ``procs`` that still runs (one that exited meanwhile is skipped); returns
    the PIDs signalled."""
    sent = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            p.send_signal(sig)
            sent.append(p.pid)
    return sent


def kill_tree(pid: int, timeout: float = 10.0) -> None:
    """SIGKILL ``pid`` and all its descendants and wait for them (resuming stopped ones first)."""
    procs = tree(pid)
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            p.kill()
    psutil.wait_procs(procs, timeout=timeout)


def terminate_tree(pid: int, grace: float = 10.0) -> None:
    """SIGTERM ``pid`` and its descendants, SIGKILL whatever is left after ``grace`` seconds."""
    procs = tree(pid)
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            if p.status() == psutil.STATUS_STOPPED:
                p.send_signal(signal.SIGCONT)
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            p.kill()
    psutil.wait_procs(alive, timeout=grace)


def wait_gone(pids: list[int], timeout: float) -> bool:
    """True when none of ``pids`` is alive (zombies count as gone) before ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and _not_zombie(p)]
        if not alive:
            return True
        time.sleep(0.05)
    return False


def _not_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


#: An agent's scratch path: ``elastic_train-KIND-PID-START`` and a suffix (START: the owner's start time in
#: ms, so that a reused PID does not keep a dead agent's path alive; names without it: older versions).
_SCRATCH_RE = re.compile(r"^elastic_train-(?P<kind>[a-z]+)-(?P<pid>\d+)(?:-(?P<start>\d+))?(?:[-.]|$)")


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (:data:`CLOCK_TICKS` a second): the kernel's
    ``starttime``, field 22 of ``/proc/PID/stat``, which no wall-clock change moves. None where ``/proc``
    does not say (not Linux).

    Raises:
        psutil.NoSuchProcess: no such process.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        raise psutil.NoSuchProcess(pid) from None
    except OSError:
        return None
    try:
        return int(stat.rsplit(b")", 1)[1].split()[19])  # the name before it may hold ") "
    except (IndexError, ValueError):
        return None


def start_ms(pid: int) -> int:
    """Start time of process ``pid`` in ms: with the PID, an identity no later process reuses.

    On Linux it is the kernel's start tick since boot (:func:`start_ticks`). psutil's ``create_time`` adds
    the boot time the kernel derives from the wall clock, and that figure steps when the clock is adjusted
    (seen here: +1 to +15 s), after which every live owner would look gone and its snapshots be swept.
    Elsewhere: psutil's ``create_time``.

    Raises:
        psutil.NoSuchProcess: no such process.
    """
    ticks = start_ticks(pid)
    if ticks is None:
        return int(psutil.Process(pid).create_time() * 1000)
    return ticks * 1000 // CLOCK_TICKS


def owner_alive(pid: int, started_ms: int) -> bool:
    """Whether the process ``pid`` that started at ``started_ms`` (:func:`start_ms`) still runs."""
    try:
        return start_ms(pid) == started_ms
    except psutil.NoSuchProcess:
        return False


def _owner() -> str:
    pid = os.getpid()
    return f"{pid}-{start_ms(pid)}"


def scratch_dir(kind: str) -> str:
    """A new scratch directory of this process in the temporary directory, named by its owner; the ``kind``
    paths of owners that are gone (a killed agent cleans nothing up) are removed first."""
    sweep_scratch(kind)
    return tempfile.mkdtemp(prefix=f"elastic_train-{kind}-{_owner()}-")


def scratch_path(kind: str, suffix: str) -> str:
    """A path for a file of this process (a socket) in the temporary directory, named by its owner; the
    ``kind`` paths of owners that are gone are removed first."""
    sweep_scratch(kind)
    return os.path.join(tempfile.gettempdir(), f"elastic_train-{kind}-{_owner()}{suffix}")


def sweep_scratch(kind: str, directory: str | None = None) -> list[str]:
    """Remove the ``kind`` scratch paths whose owner process is gone; returns them."""
    base = directory or tempfile.gettempdir()
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(base):
            m = _SCRATCH_RE.match(name)
            if m is None or m["kind"] != kind:
                continue
            pid = int(m["pid"])
            alive = owner_alive(pid, int(m["start"])) if m["start"] else psutil.pid_exists(pid)
            if alive:
                continue
            path = os.path.join(base, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            removed.append(path)
    return removed
