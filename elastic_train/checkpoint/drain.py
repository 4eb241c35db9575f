"""A worker told to stop (SIGTERM) first finishes the memory snapshot it is copying.

torchrun stops every worker of a node with SIGTERM when the group restarts. A worker killed while its copier
thread seals the snapshot of step N keeps only step N-1, so after the restart that rank receives step N from
another holder (a second receiver in the restore chain, the whole state over the network) although it
nearly had it. Here the process waits for the copy in flight, at most :data:`DRAIN_LIMIT` seconds, and
then dies of the signal as it would have.

The training thread may be blocked in a collective that never returns (a peer died), where a Python signal
handler would not run until it does: so the handler itself does nothing, and a thread waiting on the
interpreter's wakeup fd (written by the C-level handler in whatever thread the kernel chose) does the work.
It is installed on the main thread when the first memory snapshot is created, only where SIGTERM still has
its default action (a script's own handler is left alone) and the wakeup fd is free.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
import time
import weakref
from typing import Any, Protocol

from elastic_train.log import get_logger

log = get_logger(__name__)

#: Most seconds a stopped worker waits for the snapshot copy in flight before it dies.
DRAIN_LIMIT = 1.0


class Drainable(Protocol):
    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until the snapshot in flight is sealed or failed; False if still busy after ``timeout``."""
        ...


_SNAPSHOTS: weakref.WeakSet[Any] = weakref.WeakSet()
_LOCK = threading.Lock()
_installed = False


def register(snapshot: Drainable) -> None:
    """Finish ``snapshot``'s copy in flight before the process dies of SIGTERM (installs the handler when
    called on the main thread for the first time)."""
    with _LOCK:
        _SNAPSHOTS.add(snapshot)
    install()


def install(*, claim: bool = False) -> bool:
    """Install the drain on SIGTERM; True when it is installed (now or before).

    ``claim``: take SIGTERM over from a handler someone else installed meanwhile (Lightning's, which must
    not run: it broadcasts from inside the handler). Without it a handler other than the default is left
    alone. Only on the main thread (Python's rule for signal handlers).
    """
    global _installed
    if threading.current_thread() is not threading.main_thread():
        return _installed
    current = signal.getsignal(signal.SIGTERM)
    if _installed:
        if current is not _ignore and (claim or current in (signal.SIG_DFL, None)):
            signal.signal(signal.SIGTERM, _ignore)
        return True
    if current not in (signal.SIG_DFL, None) and not claim:
        return False
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        previous = signal.set_wakeup_fd(w)
    except ValueError:
        os.close(r)
        os.close(w)
        return False
    if previous != -1:  # someone else's (an event loop): leave it
        signal.set_wakeup_fd(previous)
        os.close(r)
        os.close(w)
        return False
    signal.signal(signal.SIGTERM, _ignore)
    threading.Thread(target=_watch, args=(r,), name="sigterm-drain", daemon=True).start()
    _installed = True
    return True


def _ignore(signum: int, frame: object) -> None:
    """The Python-level handler: nothing (the wakeup fd's thread drains and ends the process)."""


def _watch(fd: int) -> None:
    while True:
        try:
            data = os.read(fd, 64)
        except InterruptedError:
            continue
        except OSError:
            return
        if signal.SIGTERM in data:
            drain(DRAIN_LIMIT)
            _die()


def drain(limit: float) -> None:
    """Wait for every registered snapshot's copy in flight, at most ``limit`` seconds in all."""
    started = time.monotonic()
    with _LOCK:
        snapshots = list(_SNAPSHOTS)
    busy = 0
    for s in snapshots:
        left = max(0.0, limit - (time.monotonic() - started))
        with contextlib.suppress(Exception):  # a failing snapshot must not keep the process alive
            if not s.wait_idle(timeout=left):
                busy += 1
    took = round(time.monotonic() - started, 3)
    log.info("sigterm_drained", snapshots=len(snapshots), busy=busy, seconds=took)


def _die() -> None:
    """End the process by SIGTERM's default action (its parent sees it killed by the signal)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal(signal.SIGTERM, 0)  # SIG_DFL, from a thread other than the main one
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5.0)
    os._exit(128 + signal.SIGTERM)
