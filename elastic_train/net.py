"""Small network helpers every layer may use (no knowledge of etcd, jobs or training)."""

from __future__ import annotations

import os
import socket
import stat
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")

#: Connections other layers' process groups opened (a checkpoint manager's replica group), by owner: file
#: descriptor -> socket inode. :func:`cut_extra_links` shuts them down with the training group's own (a cut
#: of a group blocked on a stopped peer must also fail a replica exchange waiting on that peer).
_EXTRA: dict[int, dict[int, int]] = {}
_EXTRA_LOCK = threading.Lock()

#: The threads freeing destroyed process groups (:func:`free_groups`).
_FREEING: list[threading.Thread] = []
_FREEING_LOCK = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (another process may take it before you bind it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def stream_sockets(*, connected: bool = False) -> dict[int, int]:
    """This process's TCP sockets, file descriptor -> inode (none where ``/proc/self/fd`` does not exist);
    with ``connected``, listening sockets left out."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return {}
    found: dict[int, int] = {}
    for name in names:
        fd = int(name)
        try:
            st = os.fstat(fd)
        except OSError:
            continue
        if not stat.S_ISSOCK(st.st_mode):
            continue
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            if connected and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                continue
            found[fd] = st.st_ino
        except OSError:
            continue
        finally:
            sock.close()
    return found


def opened_by(make: Callable[[], T]) -> tuple[T, dict[int, int]]:
    """Call ``make`` (e.g. forming a gloo process group); returns its result and the connected TCP sockets it
    opened (file descriptor -> inode; empty where ``/proc/self/fd`` does not exist)."""
    before = stream_sockets()
    made = make()
    opened = stream_sockets(connected=True)
    return made, {fd: ino for fd, ino in opened.items() if before.get(fd) != ino}


def shut_down(links: Mapping[int, int]) -> int:
    """Shut down (both directions) the sockets ``links`` names, file descriptor -> inode; returns how many.

    Each is checked by inode: its owner (gloo) may have closed it, and the descriptor may by now belong to
    another connection of this process. A thread blocked on such a socket then fails at once."""
    cut = 0
    for fd, inode in links.items():
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:  # closed by its owner already
            continue
        try:
            if os.fstat(sock.fileno()).st_ino == inode:
                sock.shutdown(socket.SHUT_RDWR)
                cut += 1
        except OSError:  # not connected any more
            pass
        finally:
            sock.close()  # the duplicate only
    return cut


def add_extra_links(owner: object, links: Mapping[int, int]) -> None:
    """Let :func:`cut_extra_links` cut ``links`` (connections of ``owner``'s process group) until
    :func:`drop_extra_links`."""
    with _EXTRA_LOCK:
        _EXTRA.setdefault(id(owner), {}).update(links)


def drop_extra_links(owner: object) -> None:
    """Forget ``owner``'s links (its group is destroyed: the descriptors may be reused)."""
    with _EXTRA_LOCK:
        _EXTRA.pop(id(owner), None)


def cut_extra_links() -> int:
    """Shut down every registered group's connections (:func:`add_extra_links`); returns how many."""
    with _EXTRA_LOCK:
        links = {fd: ino for owned in _EXTRA.values() for fd, ino in owned.items()}
    return shut_down(links)


def destroy_groups(groups: list[Any]) -> list[str]:
    """Destroy process groups other than the default one (``destroy_process_group`` of each, now, on this
    thread) and free them on a thread of their own (:func:`free_groups`); ``groups`` (None entries allowed)
    is emptied, and the caller must hold no other reference. Returns the errors of groups that could not be
    destroyed (the default group already gone, say)."""
    import torch.distributed as dist

    errors = []
    for i in range(len(groups)):  # by index: no loop variable keeps a group alive past the hand-off
        if groups[i] is not None:
            try:
                dist.destroy_process_group(groups[i])
            except Exception as exc:
                errors.append(str(exc))
    free_groups(groups)
    return errors


def free_groups(groups: list[Any]) -> None:
    """Drop the references to destroyed process groups on a thread of their own; ``groups`` is emptied.

    A gloo group's C++ teardown stops its device's event loop, which notices only at its next poll (every
    10 ms): about 10 ms a group, 50 ms for a training group and a checkpoint manager's three (torch 2.13,
    measured on this project's 2-core machine). torch releases the GIL in a process group's destructor, so
    the caller forms its next group meanwhile. A group that something else still refers to (a DDP reducer,
    a device mesh) is freed where that last reference goes, as without this. The thread is not a daemon: an
    interpreter that exits waits for it rather than stopping a destructor half-way."""
    doomed = [g for g in groups if g is not None]
    groups.clear()
    if not doomed:
        return
    thread = threading.Thread(target=doomed.clear, name="process-group-free")
    with _FREEING_LOCK:
        _FREEING[:] = [t for t in _FREEING if t.is_alive()]
        _FREEING.append(thread)
    thread.start()


def wait_groups_freed(timeout: float | None = None) -> bool:
    """Block until every group handed to :func:`free_groups` so far is freed; False on ``timeout``."""
    with _FREEING_LOCK:
        threads = list(_FREEING)
    for thread in threads:
        thread.join(timeout)
    return not any(t.is_alive() for t in threads)
