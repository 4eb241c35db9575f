"""This worker process's end of the node contract, and what it keeps across the groups it trains in.

One object per process, :func:`process_link`, is the seam between the training loop and the node's agent:

- the node's channel (:mod:`elastic_train.node`) when an ``etcd3`` agent started this worker, else none;
- the assignment the process trains in: its round (the agent writes it; the process adopts a new one when
  it re-forms in-process, :mod:`elastic_train.train.hot`);
- whether the process re-forms in-process (registered with its agent), so that the step boundary stops
  for an announced membership change (:meth:`ProcessLink.boundary` raises :class:`GroupChanged`);
- the step beat the agent's fence reads, counted at the step boundary, and the trained mark;
- the figures of the agent's metrics (steps/s, snapshot and durable write seconds), counted per committed
  step and reported at most once a second (:class:`~elastic_train.node.stats.StatsCounter`);
- which step the model's and optimizer's live tensors hold (:class:`LiveMark`), which outlives the
  checkpointers of the groups the process trains in.

The training loop calls :meth:`ProcessLink.boundary` once per step (:class:`~elastic_train.train.
checkpointer.Checkpointer` does, for the built-in loop and the own-loop API alike). Outside an agent every
call is cheap and does nothing.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from elastic_train.node import Assignment, Beat, Link, Outcome, StatsCounter, WorkerChannel
from elastic_train.train.env import WorkerEnv
from elastic_train.train.errors import ReformAbandoned


class TrainState(Protocol):
    """What :class:`LiveMark` reads of a :class:`~elastic_train.train.state.TrainState`."""

    model: Any
    optimizer: Any


class GroupChanged(Exception):
    """Raised at a step boundary when the agent announced that this group must re-form."""


class LiveMark:
    """Which step the live tensors of this process's model and optimizer hold, as far as it knows.

    Set when a step's snapshot is taken from them or a restored step is loaded into them; cleared by the
    next optimizer step (a pre-hook, registered once per optimizer). A worker that re-forms its group
    in-process passes it to the restore, which then hashes those tensors where they are instead of reading
    its snapshot again (``CheckpointManager.restore(live=...)``). It is a hint: the slot's checksum decides,
    so a tensor changed some other way (a buffer updated in a forward pass, weights edited by hand) costs a
    second read, never a wrong state.
    """

    def __init__(self) -> None:
        self._model: weakref.ref[Any] | None = None
        self._optimizer: Callable[[], Any] = _none
        self._step: int | None = None
        self._watched: weakref.WeakSet[Any] = weakref.WeakSet()

    def set(self, state: TrainState, step: int) -> None:
        import torch

        if self._model is not None and self._model() is state.model and self._optimizer() is state.optimizer:
            self._step = step  # every commit: the same objects as the last time
            return
        optimizer = state.optimizer
        if isinstance(optimizer, torch.optim.Optimizer) and optimizer not in self._watched:
            optimizer.register_step_pre_hook(self._changed)
            self._watched.add(optimizer)
        self._model, self._optimizer = weakref.ref(state.model), _ref(optimizer)
        self._step = step

    def get(self, state: TrainState) -> int | None:
        return self._step if self._model is not None and self._model() is state.model else None

    def clear(self) -> None:
        self._model, self._step = None, None

    def _changed(self, *args: Any) -> None:
        self._step = None


def _none() -> None:
    return None


def _ref(obj: Any) -> Callable[[], Any]:
    return _none if obj is None else weakref.ref(obj)


class ProcessLink:
    """A worker process's end of the node contract (see the module docstring).

    Args:
        channel: the node's channel (None: not started by an ``etcd3`` agent).
    """

    def __init__(self, channel: WorkerChannel | None) -> None:
        self.channel = channel
        #: The assignment this process trains in (the one it started with, then each it re-formed in).
        self.assignment: Assignment | None = channel.assignment() if channel is not None else None
        #: True once the agent was told this process re-forms in-process (:meth:`register`).
        self.registered = False
        self.live = LiveMark()
        self._beat = Beat(channel.directory if channel is not None else None)
        self._trained: int | None = -1  # the round last marked trained (-1: none)
        #: This process's figures for its agent's metrics (None outside an agent: nothing is counted).
        self.stats: StatsCounter | None = channel.stats_counter() if channel is not None else None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> ProcessLink:
        return cls(WorkerChannel.from_environ(environ))

    # -- the assignment ------------------------------------------------------------------------------------
    @property
    def round(self) -> int | None:
        """The round this process trains in (None outside an ``etcd3`` agent)."""
        return self.assignment.round if self.assignment is not None else None

    @property
    def reform(self) -> bool:
        """Whether the agent re-forms this node's groups in-process (hot recovery)."""
        return self.channel is not None and self.assignment is not None and self.assignment.reform

    @property
    def standby_s(self) -> float | None:
        """Seconds this process may wait for its admission when its agent started it on standby, else None."""
        return self.assignment.standby_s if self.assignment is not None else None

    def adopt(self, assignment: Assignment) -> None:
        """This process trains in ``assignment`` from now on (it formed the assignment's group)."""
        self.assignment = assignment

    # -- the step boundary ---------------------------------------------------------------------------------
    def boundary(self, step: int) -> None:
        """A step boundary of the training loop: count the step for the agent's fence; raises
        :class:`GroupChanged` when this process re-forms in-process and the agent announced a change."""
        self._beat.step()
        if self.registered and self.change_pending():
            raise GroupChanged(f"the group of round {self.round} re-forms after step {step}")

    def change_pending(self) -> bool:
        """True when the agent announced that this process's group re-forms at its next step boundary (a
        test's gate that holds a step stops holding then); False outside an agent that re-forms in-process."""
        round = self.round
        return self.channel is not None and round is not None and self.channel.change_after(round)

    def mark_trained(self) -> None:
        """Tell the agent that this process committed a step in its round (once per round): a failure from
        then on is not one before the round's first step (docs/operating.md)."""
        if self.channel is not None and self._trained != self.round:
            self._trained = self.round
            self.channel.mark_trained(self.round)

    def mark_finished(self, step: int, local_workers: int) -> None:
        """Tell the agent that this process, one of ``local_workers`` on its node, ended its training at
        ``step``, its final checkpoint committed: a membership change seen from now on (its lease lost as the
        workers exit) no longer stops the node's workers, which exit into torchrun's exit barrier."""
        if self.channel is not None:
            self.channel.mark_finished(step, local_workers, self.round)

    def committed(
        self,
        step: int,
        save_s: float,
        durable: tuple[int, float, int] | None = None,
        busy_s: float | None = None,
    ) -> None:
        """Count a committed step for the agent's metrics and slow-node detection: the seconds its save took,
        the newest durable checkpoint committed so far (``(step, seconds, bytes)``) and the step's busy time
        (:mod:`elastic_train.train.busy`); reported at most once a second."""
        if self.stats is not None:
            self.stats.committed(self.round, step, save_s, durable, busy_s)

    def report_exit(self, exc: BaseException, code: int = 1) -> None:
        """Tell the agent how this worker ends: the exception that escapes the script (its type, where it
        was raised, its line), for the start-up failure rule (docs/operating.md). Nothing outside an agent,
        for an interrupt, or when the group could not re-form in-process (the agent gave up on it, no round
        came, or the run ended): that exit is the restart path's, not the script's failure."""
        channel = self.channel
        if channel is None or isinstance(exc, KeyboardInterrupt | SystemExit):
            return
        kind, where, line = describe(exc)
        rank = os.environ.get("RANK", "0")
        rank_ = int(rank) if rank.isdigit() else 0
        if isinstance(exc, ReformAbandoned) or channel.fallback() is not None or channel.ended() is not None:
            channel.report(Outcome(rank_, "restarting", message=line))
            return
        channel.report(Outcome(rank_, "exited", code=code, message=line, kind=kind, where=where))

    def checkpoint_link(self) -> Link:
        """What a checkpoint manager of this round needs: the round its checkpoints carry, the publish gate,
        progress while it waits for its own writer."""
        return Link(self.channel.directory if self.channel is not None else None, self.round)

    # -- in-process re-formation ---------------------------------------------------------------------------
    def register(self, round: int, *, cut: bool) -> None:
        """Tell the agent this process re-forms in-process from ``round`` on; ``cut``: it cuts its group's
        connections when asked."""
        assert self.channel is not None
        self.channel.register(round, cut=cut)
        self.registered = True


def describe(exc: BaseException) -> tuple[str, str, str]:
    """(type, where it was raised, its line) of an exception: ``("RuntimeError", "train.py:42",
    "RuntimeError: mat1 and mat2 must have the same dtype")``; the line is what Python prints last."""
    import traceback

    kind = type(exc).__qualname__
    text = str(exc).strip()
    line = f"{kind}: {text.splitlines()[0]}" if text else kind
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
    where = f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
    return kind, where, line[:2000]


_PROCESS: ProcessLink | None = None
_PROCESS_PID = -1


def process_link() -> ProcessLink:
    """This process's link, made from its environment on first use (a process forked from another, as the
    fork server's workers are, makes its own)."""
    global _PROCESS, _PROCESS_PID
    if _PROCESS is None or os.getpid() != _PROCESS_PID:
        _PROCESS, _PROCESS_PID = ProcessLink.from_environ(os.environ), os.getpid()
    return _PROCESS


def use_process_link(link: ProcessLink | None) -> None:
    """Replace this process's link (tests; None: made from the environment again on next use)."""
    global _PROCESS, _PROCESS_PID
    _PROCESS, _PROCESS_PID = link, os.getpid() if link is not None else -1


def worker_env() -> WorkerEnv:
    """This process's place in its current group: torchrun's variables and the round of its assignment.

    Raises:
        ConfigError: torchrun's variables are inconsistent or not integers.
    """
    return WorkerEnv.from_environ(os.environ, process_link().assignment)
