"""What a worker tells its agent and asks it, without knowing what the agent coordinates through.

Two things cross from a worker to the torchrun agent that started it (the ``etcd3`` handler's side is
:mod:`elastic_train.rendezvous.fence`), both through the agent's directory named in
:data:`~elastic_train.envvars.ENV_OUTCOME_DIR`:

- **Progress.** :meth:`AgentLink.beat` counts a finished step into ``beat-<pid>``, an 8-byte file mapped
  into memory: a store to a mapped page, no system call per step. The agent reads the counters to tell a
  node whose collectives make progress from one blocked in a collective whose peers went away.
- **The publish gate.** :meth:`AgentLink.may_publish` asks the agent, over ``gate.sock``, whether this
  worker's rendezvous round is still the run's current one, right before a durable checkpoint is made
  visible. The agent answers from a fresh (linearizable) read of the coordination service: ``current``,
  ``stale`` (a newer round closed: this world is fenced off), or ``unknown`` (no answer within its bound).

Outside such an agent (plain processes, other rendezvous backends) there is no directory: nothing is
counted and every publish is allowed, as before.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import struct
from collections.abc import Mapping

from elastic_train.envvars import ENV_OUTCOME_DIR, ENV_ROUND

#: File name prefix of a worker's progress counter (``beat-<pid>``) in the agent's directory.
BEAT_PREFIX = "beat-"
#: The agent's publish-gate socket in its directory.
GATE_SOCKET = "gate.sock"
#: Seconds a worker waits for the gate's answer (the agent bounds its own etcd retries well below this).
GATE_TIMEOUT = 120.0
#: The gate's answers.
CURRENT, STALE, UNKNOWN = "current", "stale", "unknown"

_COUNTER = struct.Struct("<Q")


class AgentLink:
    """A worker's link to its agent (see the module docstring).

    Args:
        directory: the agent's directory (None: no agent to talk to).
        round: the worker group's rendezvous round (None: not known).
    """

    def __init__(self, directory: str | None, round: int | None) -> None:
        self.directory = directory if directory and os.path.isdir(directory) else None
        self.round = round
        self._map: mmap.mmap | None = None
        self._count = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> AgentLink:
        env = os.environ if environ is None else environ
        raw = env.get(ENV_ROUND, "")
        return cls(env.get(ENV_OUTCOME_DIR), int(raw) if raw.isdigit() else None)

    @property
    def fenced(self) -> bool:
        """Whether an agent answers the publish gate for this worker."""
        return self.directory is not None and self.round is not None

    def beat(self) -> None:
        """Count one finished step (cheap: a store into a mapped page after the first call)."""
        if self.directory is None:
            return
        if self._map is None:
            path = os.path.join(self.directory, f"{BEAT_PREFIX}{os.getpid()}")
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    os.ftruncate(fd, _COUNTER.size)
                    self._map = mmap.mmap(fd, _COUNTER.size)
                finally:
                    os.close(fd)
            except OSError:
                self.directory = None  # the agent went away; nothing to tell
                return
        self._count += 1
        _COUNTER.pack_into(self._map, 0, self._count)

    def may_publish(self, timeout: float = GATE_TIMEOUT) -> str:
        """Ask the agent whether this worker's round is still current: :data:`CURRENT`, :data:`STALE` or
        :data:`UNKNOWN` (the agent could not confirm it in time, or did not answer). Without an agent:
        :data:`CURRENT`."""
        if not self.fenced:
            return CURRENT
        assert self.directory is not None
        path = os.path.join(self.directory, GATE_SOCKET)
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(timeout)
                s.connect(path)
                s.sendall(f"{self.round}\n".encode())
                answer = s.makefile("r", encoding="ascii").readline().strip()
        except OSError:
            return UNKNOWN
        return answer if answer in (CURRENT, STALE) else UNKNOWN

    def close(self) -> None:
        if self._map is not None:
            with contextlib.suppress(BufferError, ValueError):
                self._map.close()
            self._map = None


def read_beats(directory: str) -> dict[int, int]:
    """The progress counters in an agent's directory: ``{worker pid: steps counted}`` (unreadable ones
    left out)."""
    out: dict[int, int] = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return out
    for name in names:
        if not name.startswith(BEAT_PREFIX) or not name[len(BEAT_PREFIX) :].isdigit():
            continue
        try:
            with open(os.path.join(directory, name), "rb") as f:
                raw = f.read(_COUNTER.size)
        except OSError:
            continue
        if len(raw) == _COUNTER.size:
            out[int(name[len(BEAT_PREFIX) :])] = _COUNTER.unpack(raw)[0]
    return out


def clear_beats(directory: str) -> None:
    """Remove the progress counters of a worker group that ended."""
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if name.startswith(BEAT_PREFIX):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(directory, name))
