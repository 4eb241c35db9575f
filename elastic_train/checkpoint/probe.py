"""Is the checkpoint URL one storage for every node? Checked when a process group forms, before a step.

A local path on separate machines (``checkpoint.url: /data/ckpt`` without a shared filesystem) looks fine
on every node until the first restore from durable storage, when no node finds the others' shares. So when
a group forms with a node that has not been checked yet (the first round, a restarted group, a node that
joins), every node writes a small probe under the run's directory (``<url>/<run>/.probes/``) and reads the
others' back: a node that cannot read another's probe means the URL is not shared, and the job is refused
with one line naming the URL and the nodes that cannot see each other (a :class:`CheckpointSetupError`: no
restart can fix it). Probes are deleted once read.

The exchange goes through the checkpoint manager's process group (no coordination service here): one small
all-gather per restore says whether any node is new; only then are probes written and read (one more
all-gather for the names, one for the verdicts). One process per node (local rank 0) writes and reads; a
storage error while probing is logged and the check skipped (an outage is not a misconfiguration).
:func:`refusal` is the line.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from elastic_train.checkpoint.errors import CheckpointSetupError, StorageError
from elastic_train.checkpoint.storage import Storage
from elastic_train.envvars import ENV_NODE_ID
from elastic_train.log import get_logger

log = get_logger(__name__)

#: Directory of the probes under a run's checkpoint directory.
PROBES = ".probes"
#: Most probes one node reads at once.
READERS = 16
#: Node pairs named in a refusal line (the rest are counted).
MOST_NAMED = 4

#: Run directories this process has been checked against (a new process, or a new run, is checked again).
_checked: set[str] = set()


@dataclass(frozen=True, slots=True)
class Probe:
    """One node's probe, as the others learn of it."""

    node: str
    """The node's name (``ELASTIC_TRAIN_NODE_ID``, else its host name)."""
    name: str | None
    """The probe's file name under :data:`PROBES` (None: it could not be written)."""
    token: str
    """What the file holds."""


def node_name(environ: Mapping[str, str]) -> str:
    """How a refusal names this node: the launcher's node id, else the host name."""
    return environ.get(ENV_NODE_ID) or socket.gethostname()


def refusal(url: str, pairs: Sequence[tuple[str, str]]) -> str:
    """The one line that refuses a checkpoint URL the nodes do not share."""
    named = [f"{reader} cannot read {writer}'s" for reader, writer in pairs[:MOST_NAMED]]
    more = f" and {len(pairs) - MOST_NAMED} more" if len(pairs) > MOST_NAMED else ""
    return (
        f"checkpoint.url {url} is not shared between the nodes: {', '.join(named)}{more} probe written there "
        "(a local path on separate machines?); every node must reach the same storage: a shared filesystem "
        "mounted at that path, or an object store URL (s3://, gs://)"
    )


class SharedStorageCheck:
    """The check of one manager's group (see the module docstring).

    Args:
        storage: the checkpoint storage.
        run_path: the run's directory in it.
        url: the checkpoint URL, for the refusal line.
        rank: this process's rank in the group (its place in what ``gather`` returns).
        local_rank: this process's local rank (0 writes and reads the node's probe).
        gather: all-gather of a small picklable object over the group, in rank order.
        environ: where the node's name comes from.
    """

    def __init__(
        self,
        storage: Storage,
        run_path: str,
        url: str,
        *,
        rank: int,
        local_rank: int,
        gather: Callable[[Any], list[Any]],
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.storage = storage
        self.run_path = run_path
        self.url = url
        self.rank = rank
        self.leader = local_rank == 0
        self.gather = gather
        self.node = node_name(os.environ if environ is None else environ)

    def run(self) -> None:
        """Collective (every rank of the group): check that every node reads the others' probes.

        Raises:
            CheckpointSetupError: a node cannot read another node's probe (on every rank).
        """
        flags = self.gather((self.leader, self.run_path not in _checked))
        leaders = [i for i, (leader, _) in enumerate(flags) if leader]
        new = {i for i in leaders if flags[i][1]}
        if len(leaders) < 2 or not new:
            _checked.add(self.run_path)
            return
        mine = self._write() if self.leader else None
        gathered: list[Probe | None] = self.gather(mine)
        probes = {i: p for i, p in enumerate(gathered) if p is not None and p.name is not None}
        missing = self._read(probes, new) if self.leader else None
        reports: list[list[int] | None] = self.gather(missing)  # a barrier: every probe was read
        if mine is not None and mine.name is not None:
            self._remove(mine.name)
        names = _display(probes)
        pairs = [(names[i], names[j]) for i in probes for j in reports[i] or [] if j in probes]
        if pairs:
            log.error("checkpoint_url_not_shared", url=self.url, pairs=pairs[:MOST_NAMED])
            raise CheckpointSetupError(refusal(self.url, pairs))
        _checked.add(self.run_path)
        log.info("checkpoint_url_shared", url=self.url, nodes=len(probes), new=len(new))

    def _write(self) -> Probe:
        token = secrets.token_hex(8)
        name = f"{_safe(self.node)}-{os.getpid()}-{token}"
        try:
            self.storage.write_small(self._path(name), token.encode())
        except StorageError as exc:  # storage unavailable: nothing to compare, the check is skipped
            log.warning("checkpoint_probe_unwritten", url=self.url, error=str(exc))
            return Probe(self.node, None, token)
        return Probe(self.node, name, token)

    def _read(self, probes: Mapping[int, Probe], new: set[int]) -> list[int]:
        """Ranks whose node's probe this node cannot read: every other node's when this node is new, else
        the new nodes'."""
        todo = [i for i in probes if i != self.rank and (self.rank in new or i in new)]

        def readable(i: int) -> bool:
            p = probes[i]
            assert p.name is not None
            try:
                return self.storage.read(self._path(p.name)) == p.token.encode()
            except StorageError:
                return False

        if not todo:
            return []
        with ThreadPoolExecutor(min(READERS, len(todo)), thread_name_prefix="probe") as pool:
            seen = list(pool.map(readable, todo))
        return [i for i, ok in zip(todo, seen, strict=True) if not ok]

    def _remove(self, name: str) -> None:
        try:
            self.storage.remove(self._path(name))
        except StorageError as exc:
            log.warning("checkpoint_probe_not_removed", path=self._path(name), error=str(exc))

    def _path(self, name: str) -> str:
        return self.storage.join(self.run_path, PROBES, name)


def _display(probes: Mapping[int, Probe]) -> dict[int, str]:
    """Each probing rank's node name, with the rank where two nodes share a name."""
    counts: dict[str, int] = {}
    for p in probes.values():
        counts[p.node] = counts.get(p.node, 0) + 1
    return {i: p.node if counts[p.node] == 1 else f"{p.node} (rank {i})" for i, p in probes.items()}


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:80]
