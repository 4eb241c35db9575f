"""Errors of the etcd3 rendezvous.

They extend torch's rendezvous error types so torchrun's agent treats them as it treats its own backends'
errors, except those that end this node: :class:`FailureBudgetExhausted` and :class:`StandbyFailed`
(status 1), :class:`RunRefused`
(status 2) and :class:`RunFinished` (status 0) are ``SystemExit``s. torch 2.13's agent and launcher let a
``SystemExit`` through without a traceback, after stopping the workers and shutting the handler down, so the
node ends with one line and the documented status under ``elastic-train run`` and plain torchrun alike.

:class:`RendezvousClosed` never leaves the handler: it is a torch ``RendezvousGracefulExitError``, on which
torch's agent returns ``None`` and its launcher then fails with ``AttributeError: 'NoneType' object has no
attribute 'is_failed'``; the handler turns it into :class:`RunFinished`.
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)

from elastic_train.errors import ElasticTrainError


class RendezvousClosed(RendezvousClosedError, RendezvousGracefulExitError):
    """The job finished and closed its rendezvous: a late agent leaves without error.

    Raised by :class:`~elastic_train.rendezvous.protocol.Participant`; the torchrun handler turns it into
    :class:`RunFinished` (torch's agent cannot take a graceful-exit error, see the module docstring).
    """


class RunFinished(SystemExit):
    """The run finished without this node (a late node, one cut off until the end, a second start of a
    finished run within ``identity_wait``): it leaves with status 0 after one line, :attr:`message`."""

    def __init__(self, message: str) -> None:
        super().__init__(0)
        self.message = message

    def __str__(self) -> str:
        return self.message


class RendezvousJoinTimeout(RendezvousTimeoutError, ElasticTrainError):
    """No round including this node formed within ``join_timeout``."""


class FailureBudgetExhausted(SystemExit):
    """The job's global failure budget is spent: every agent stops with this message (exit status 1)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"elastic-train: error: {message}")
        self.message = message

    def __str__(self) -> str:
        return self.message


class StandbyFailed(SystemExit):
    """This node's workers failed :data:`~elastic_train.rendezvous.standby.STANDBY_ATTEMPTS` times in a row
    while they built on standby: the node leaves with this message (exit status 1); the running job, which
    never admitted them, trains on without it."""

    def __init__(self, message: str) -> None:
        super().__init__(f"elastic-train: error: {message}")
        self.message = message

    def __str__(self) -> str:
        return self.message


class RunRefused(SystemExit):
    """This node must not take part in the run (other settings, a finished or failed run, a failed job).

    Exit status 2 without a traceback: a retry cannot help, and on Kubernetes ``podFailurePolicy: FailJob``
    fails the whole Job instead of re-creating the pod. The handler writes :attr:`message` as one line.
    """

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


class JobFailed(RunRefused):
    """A worker failed with an error no retry can fix; the run is closed as failed (exit status 2)."""


class NodeLeft(SystemExit):
    """This node left the run on purpose (SIGTERM: :mod:`elastic_train.rendezvous.leave`) and joins no more
    rounds: status 128 + SIGTERM, as a process ended by the signal (on Kubernetes a non-zero status keeps its
    index from counting as succeeded)."""

    def __init__(self, message: str) -> None:
        super().__init__(143)
        self.message = message

    def __str__(self) -> str:
        return self.message
