"""Does the memory tier fit this node's shared memory? Decided before a snapshot file is allocated.

Every local rank of a node keeps a snapshot file of :data:`~elastic_train.checkpoint.slots.SLOTS` copies of
its state in the same tmpfs (``/dev/shm``: in a container, as large as its memory-backed volume). One rank
finding the space full after the others took theirs fails later and alone; so each allocation checks the
node's whole need (local ranks times the file) against what the tmpfs holds for this run, and refuses with one
line naming the figures: a :class:`CheckpointSetupError`, no restart can fix it. (The allocation itself is a
``posix_fallocate``: a full tmpfs fails there, never as a bus error mid-run.)
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from elastic_train.checkpoint.errors import CheckpointSetupError
from elastic_train.checkpoint.shmfiles import held_bytes
from elastic_train.checkpoint.slots import SLOTS, free_bytes

GIB = 1 << 30


def _gib(n: float) -> str:
    """A size for one line: MiB below a GiB, else GiB."""
    if n < GIB:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / GIB:.2f} GiB" if n < 100 * GIB else f"{n / GIB:.0f} GiB"


def memory_tier_refusal(
    *, directory: str, local_ranks: int, slots: int, file_bytes: int, state_bytes: int, room: int
) -> str | None:
    """Why the node's snapshots cannot fit (one line), or None when they do.

    Args:
        directory: the tmpfs (``checkpoint.memory_dir``).
        local_ranks: worker processes on this node, each with its own snapshot file.
        slots: copies of the state in each file.
        file_bytes: one rank's file (its slots and headers).
        state_bytes: one rank's state.
        room: bytes of the tmpfs this run may use: free space plus its snapshot files already there.
    """
    need = local_ranks * file_bytes
    if need <= room:
        return None
    fits = room // max(1, local_ranks * slots)
    return (
        f"the memory tier needs {local_ranks} local rank(s) x {slots} slots x {_gib(file_bytes / slots)} (a "
        f"{_gib(state_bytes)} state per rank) = {_gib(need)} in {directory}, which holds {_gib(room)} for it "
        f"(room for a {_gib(fits)} state per rank); make {directory} larger (Kubernetes: the memory-backed "
        "emptyDir's sizeLimit, within the container's memory limit; Docker: --shm-size) or set "
        "checkpoint.memory: false"
    )


def check_memory_tier(
    *, directory: str, local_ranks: int, slots: int, file_bytes: int, state_bytes: int, room: int
) -> None:
    """Raise :class:`CheckpointSetupError` with :func:`memory_tier_refusal`'s line when the tier cannot fit.

    Raises:
        CheckpointSetupError: the node's snapshots do not fit its tmpfs.
    """
    line = memory_tier_refusal(
        directory=directory,
        local_ranks=local_ranks,
        slots=slots,
        file_bytes=file_bytes,
        state_bytes=state_bytes,
        room=room,
    )
    if line is not None:
        raise CheckpointSetupError(line)


def check_node_room(
    path: str, file_bytes: int, state_bytes: int, environ: Mapping[str, str] | None = None
) -> None:
    """Before ``path``, one rank's snapshot file of ``file_bytes``, is allocated: refuse a memory tier the
    node's tmpfs cannot hold for all its local ranks (``LOCAL_WORLD_SIZE``, torchrun's).

    The room is the free space plus the snapshot files of this run and owner already there (this rank's old
    one, which is replaced, and its siblings', which count in the need).

    Raises:
        CheckpointSetupError: the node's snapshots do not fit.
    """
    raw = (os.environ if environ is None else environ).get("LOCAL_WORLD_SIZE", "")
    directory = os.path.dirname(path)
    check_memory_tier(
        directory=directory,
        local_ranks=int(raw) if raw.isdigit() and int(raw) > 0 else 1,
        slots=SLOTS,
        file_bytes=file_bytes,
        state_bytes=state_bytes,
        room=free_bytes(directory) + held_bytes(path),
    )
