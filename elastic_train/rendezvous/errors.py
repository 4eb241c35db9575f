"""Errors of the etcd3 rendezvous.

They extend torch's rendezvous error types so torchrun's agent treats them as it treats its own backends'
errors, except :class:`FailureBudgetExhausted`, which is a ``SystemExit``: torchrun lets it through without
a traceback, every agent of the job exits with status 1 and prints the one-line message.
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)

from elastic_train.errors import ElasticTrainError


class RendezvousClosed(RendezvousClosedError, RendezvousGracefulExitError):
    """The job finished and closed its rendezvous: a late agent leaves without error."""


class RendezvousJoinTimeout(RendezvousTimeoutError, ElasticTrainError):
    """No round including this node formed within ``join_timeout``."""


class FailureBudgetExhausted(SystemExit):
    """The job's global failure budget is spent: every agent stops with this message (exit status 1)."""

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
