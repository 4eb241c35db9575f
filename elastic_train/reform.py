"""The local channel between a node's agent and its workers for in-process re-formation (hot recovery).

The agent (the ``etcd3`` handler, :mod:`elastic_train.rendezvous.hot`) creates a directory per node and names
it in :data:`~elastic_train.envvars.ENV_REFORM_DIR`; its workers inherit the variable. Everything is a small
JSON file replaced atomically, so a reader never sees half a record and a dead writer leaves nothing
half-written:

- ``ready-<local_rank>.json`` (worker → agent) ``{"round", "pid", "cut"}``: this worker re-forms in-process
  from that round on. The agent handles a membership change in-process only when every local worker
  registered. ``cut``: the worker watches ``cut.json`` (a gloo group's connections can be cut from another
  thread).
- ``request-<local_rank>.json`` (worker → agent) ``{"round", "reason"}``: the worker's group of that round
  failed (a collective error) or it stopped at a step boundary; it waits for the next assignment.
- ``change.json`` (agent → workers) ``{"round"}``: the group of that round must re-form; workers stop at their
  next step boundary.
- ``cut.json`` (agent → workers) ``{"round"}``: the workers are blocked in a collective of that round with a
  member whose lease expired (a stopped peer): cut the group's connections, so that the collective fails
  and the group re-forms without it.
- ``assignment.json`` (agent → workers): the new round, this node's rank among the nodes, the number of nodes
  and processes per node, and the new group's bootstrap address.
- ``standby-<local_rank>.json`` (worker → agent) ``{"round", "pid"}``: a worker started on standby (a node
  joining a running job, :mod:`elastic_train.rendezvous.standby`) has built its model and asks to be admitted
  to the round after ``round``.
- ``ended.json`` (agent → workers) ``{"message"}``: the run ended before this node's standby workers were
  admitted; they exit with status 0.

Workers look at ``change.json`` once per step (one ``stat``) and poll ``assignment.json`` every few
milliseconds while they wait. No torch, no etcd: both sides import only this module.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from elastic_train.envvars import ENV_REFORM_DIR

#: Seconds between two looks at the assignment file while a worker waits for it.
POLL_INTERVAL = 0.005


@dataclass(frozen=True, slots=True)
class Assignment:
    """Where a node's workers train after a re-formation (one record for all local workers)."""

    round: int
    node_rank: int
    """This node's rank among the round's nodes."""
    nodes: int
    """Nodes in the round."""
    ranks: list[int]
    """Global rank of each local worker, by local rank (torchrun's assignment)."""
    world_size: int
    master_addr: str
    master_port: int

    def rank(self, local_rank: int) -> int:
        """Global rank of local worker ``local_rank``."""
        return self.ranks[local_rank]

    @staticmethod
    def decode(d: Mapping[str, Any]) -> Assignment:
        """Raises ValueError/KeyError/TypeError on a malformed record."""
        a = Assignment(
            int(d["round"]),
            int(d["node_rank"]),
            int(d["nodes"]),
            [int(r) for r in d["ranks"]],
            int(d["world_size"]),
            str(d["master_addr"]),
            int(d["master_port"]),
        )
        if not (
            0 <= a.node_rank < a.nodes
            and a.ranks
            and all(0 <= r < a.world_size for r in a.ranks)
            and 0 < a.master_port < 65536
        ):
            raise ValueError(f"inconsistent assignment {d!r}")
        return a


class Channel:
    """The files of one node's re-formation channel (see the module docstring)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Channel | None:
        """The channel the agent named, or None (hot recovery off, or not under an ``etcd3`` agent)."""
        directory = environ.get(ENV_REFORM_DIR)
        return cls(directory) if directory and os.path.isdir(directory) else None

    # -- files ---------------------------------------------------------------------------------------------
    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def _write(self, name: str, record: Mapping[str, Any]) -> None:
        path = self._path(name)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(dict(record), f)
        os.replace(tmp, path)

    def _read(self, name: str) -> dict[str, Any] | None:
        try:
            with open(self._path(name), encoding="utf-8") as f:
                d = json.load(f)
        except (OSError, ValueError):
            return None
        return d if isinstance(d, dict) else None

    def _per_rank(self, prefix: str) -> dict[int, dict[str, Any]]:
        out: dict[int, dict[str, Any]] = {}
        try:
            names = os.listdir(self.directory)
        except OSError:
            return out
        for name in names:
            if name.startswith(prefix) and name.endswith(".json"):
                rank = name[len(prefix) : -len(".json")]
                d = self._read(name)
                if rank.isdigit() and d is not None and isinstance(d.get("round"), int):
                    out[int(rank)] = d
        return out

    # -- worker side ---------------------------------------------------------------------------------------
    def register(self, local_rank: int, round: int, *, cut: bool = False) -> None:
        """This worker re-forms in-process from ``round`` on (written once its group is formed); ``cut``: it
        cuts its group's connections when the agent asks (:meth:`cut_asked`)."""
        self._write(f"ready-{local_rank}.json", {"round": round, "pid": os.getpid(), "cut": cut})

    def cut_asked(self, round: int) -> bool:
        """True when the agent asked the workers of ``round`` (or a later one) to cut their group's
        connections."""
        if not os.path.exists(self._path("cut.json")):  # one stat in the common case
            return False
        d = self._read("cut.json")
        return d is not None and isinstance(d.get("round"), int) and d["round"] >= round

    def request(self, local_rank: int, round: int, reason: str) -> None:
        """The group of ``round`` failed or stopped here; this worker waits for the next assignment."""
        self._write(f"request-{local_rank}.json", {"round": round, "reason": reason[:500]})

    def change_after(self, round: int) -> bool:
        """True when the agent announced that the group of ``round`` (or a later one) must re-form."""
        d = self._read("change.json")
        return d is not None and isinstance(d.get("round"), int) and d["round"] >= round

    def assignment(self) -> Assignment | None:
        d = self._read("assignment.json")
        if d is None:
            return None
        try:
            return Assignment.decode(d)
        except (ValueError, KeyError, TypeError):
            return None

    def wait_assignment(self, after: int, timeout: float) -> Assignment | None:
        """The first assignment of a round newer than ``after``, or None after ``timeout`` seconds, when the
        agent gave up on re-forming in-process (``fallback.json``: its workers are restarted instead) or when
        the run ended (``ended.json``)."""
        deadline = time.monotonic() + timeout
        while True:
            a = self.assignment()
            if a is not None and a.round > after:
                return a
            if self.fallback() is not None or self.ended() is not None or time.monotonic() >= deadline:
                return None
            time.sleep(POLL_INTERVAL)

    def standby(self, local_rank: int, round: int) -> None:
        """This standby worker has built what it trains and asks to join the round after ``round``."""
        self._write(f"standby-{local_rank}.json", {"round": round, "pid": os.getpid()})

    # -- agent side ----------------------------------------------------------------------------------------
    def ready(self) -> dict[int, int]:
        """Local rank → the round from which that worker re-forms in-process."""
        return {r: int(d["round"]) for r, d in self._per_rank("ready-").items()}

    def cuttable(self) -> bool:
        """True when every registered worker cuts its group's connections when asked."""
        registered = self._per_rank("ready-").values()
        return bool(registered) and all(d.get("cut") is True for d in registered)

    def cut(self, round: int) -> None:
        """Ask the workers of ``round`` to cut their group's connections (a stopped peer blocks them)."""
        self._write("cut.json", {"round": round, "time": time.time()})

    def standbys(self) -> dict[int, dict[str, Any]]:
        """Local rank → its standby record ``{"round", "pid"}`` (built, waiting for admission)."""
        return self._per_rank("standby-")

    def end(self, message: str) -> None:
        """Tell standby workers that the run ended before they were admitted (they exit with status 0)."""
        self._write("ended.json", {"message": message[:500], "time": time.time()})

    def ended(self) -> str | None:
        d = self._read("ended.json")
        return str(d.get("message")) if d is not None else None

    def registered(self) -> dict[int, dict[str, Any]]:
        """Local rank → its registration ``{"round", "pid"}``."""
        return self._per_rank("ready-")

    def requests(self) -> dict[int, dict[str, Any]]:
        """Local rank → its latest request ``{"round", "reason"}``."""
        return self._per_rank("request-")

    def announce(self, round: int) -> None:
        """Tell the workers that the group of ``round`` must re-form (they stop at their next step)."""
        self._write("change.json", {"round": round, "time": time.time()})

    def publish(self, assignment: Assignment) -> None:
        self._write("assignment.json", asdict(assignment))

    def give_up(self, reason: str) -> None:
        """Tell waiting workers that no assignment will come (the agent restarts them instead)."""
        self._write("fallback.json", {"reason": reason[:500], "time": time.time()})

    def fallback(self) -> str | None:
        d = self._read("fallback.json")
        return str(d.get("reason")) if d is not None else None

    def reset(self) -> None:
        """Forget everything (a new worker group starts: the restart path)."""
        with contextlib.suppress(OSError):
            for name in os.listdir(self.directory):
                with contextlib.suppress(OSError):
                    os.unlink(self._path(name))
