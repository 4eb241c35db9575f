"""The publish gate: before a durable checkpoint becomes visible, a worker asks its agent whether its round is
still the run's current one.

The agent serves ``gate.sock`` in the node's directory (:class:`GateServer`); it answers from a fresh
(linearizable) read of the coordination service: :data:`CURRENT`, :data:`STALE` (a newer round closed: this
world is stale) or :data:`UNKNOWN` (no answer within its bound). One line each way: the round as
decimal digits, the answer as a word. Outside such an agent there is no socket and every publish is allowed.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable, Mapping

from elastic_train.node.beat import Beat

#: The agent's socket in the node's directory.
SOCKET = "gate.sock"
#: Seconds a worker waits for the gate's answer (the agent bounds its own retries well below this).
TIMEOUT = 120.0
#: The gate's answers.
CURRENT, STALE, UNKNOWN = "current", "stale", "unknown"


def ask(directory: str, round: int, timeout: float = TIMEOUT) -> str:
    """Whether ``round`` is still current, as the agent of ``directory`` answers: :data:`CURRENT`,
    :data:`STALE`, or :data:`UNKNOWN` (it could not confirm in time, or did not answer)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(os.path.join(directory, SOCKET))
            s.sendall(f"{int(round)}\n".encode())
            answer = s.makefile("r", encoding="ascii").readline(16).strip()
    except (OSError, ValueError):
        return UNKNOWN
    return answer if answer in (CURRENT, STALE) else UNKNOWN


class Link:
    """A worker's link to its agent for one round: what a checkpoint manager needs (the round its
    checkpoints carry, the publish gate of that round, a progress beat while it waits for its own writer).

    Args:
        directory: the node's directory (None: no agent to talk to: nothing is counted, every publish is
            allowed).
        round: the worker group's round (None: not known; publishing is then never gated).
    """

    def __init__(self, directory: str | None, round: int | None) -> None:
        self.directory = directory if directory and os.path.isdir(directory) else None
        self.round = round
        self._beat = Beat(self.directory)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Link:
        """The link of a process that knows only its environment: its node's directory and the round of the
        assignment its agent published last (the checkpoint manager's default; workers pass their own)."""
        from elastic_train.node.channel import WorkerChannel

        channel = WorkerChannel.from_environ(os.environ if environ is None else environ)
        assignment = channel.assignment() if channel is not None else None
        return cls(
            channel.directory if channel is not None else None,
            assignment.round if assignment is not None else None,
        )

    @property
    def gated(self) -> bool:
        """Whether an agent answers the publish gate for this worker."""
        return self.directory is not None and self.round is not None

    def beat(self) -> None:
        """Count progress that is not a step (the worker waits for its own writer, not for a peer)."""
        self._beat.progress()

    def may_publish(self, timeout: float = TIMEOUT) -> str:
        """:func:`ask` for this link's round; :data:`CURRENT` without an agent."""
        if not self.gated:
            return CURRENT
        assert self.directory is not None and self.round is not None
        return ask(self.directory, self.round, timeout)

    def close(self) -> None:
        self._beat.close()


class GateServer:
    """The agent's side: answers each question on ``gate.sock`` with ``answer(round)`` (on a thread of its
    own per question: the answer may wait for etcd).

    Args:
        directory: the node's directory.
        answer: the round's state, :data:`CURRENT`, :data:`STALE` or :data:`UNKNOWN`.
    """

    def __init__(self, directory: str, answer: Callable[[int], str]) -> None:
        self.path = os.path.join(directory, SOCKET)
        self._answer = answer
        self._stop = threading.Event()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.path)
        self._server.listen(16)
        self._server.settimeout(0.5)
        self._thread = threading.Thread(target=self._serve, name="publish-gate", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            answer = threading.Thread(target=self._reply, args=(conn,), name="gate-answer", daemon=True)
            answer.start()

    def _reply(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(5.0)
                line = conn.makefile("r", encoding="ascii").readline(32).strip()
                answer = self._answer(int(line)) if line.isdigit() and len(line) < 20 else UNKNOWN
                conn.sendall(f"{answer}\n".encode())
            except (OSError, ValueError) as exc:
                from elastic_train.log import get_logger  # the agent's side only: workers need no logging

                get_logger(__name__).warning("publish_gate_failed", error=str(exc))

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._server.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
