"""Exception roots shared by every subsystem.

Each subsystem defines its own family under :class:`ElasticTrainError` (``RendezvousError``,
``CheckpointError``, ``EtcdError`` …) so the CLI can turn any of them into one clear line.
"""

from __future__ import annotations


class ElasticTrainError(Exception):
    """Base of every error elastic_train raises on purpose; its message is meant for the user."""

    #: Process exit code the CLI uses for this error.
    exit_code: int = 1


class NonRetryableError(ElasticTrainError):
    """An error that fails the same way however often it is retried (a bad config, a missing resume source,
    an incompatible checkpoint).

    A worker that fails with one ends its job at once instead of spending the failure budget on restarts;
    the launcher's top line names the cause. Exit code 2: on Kubernetes, ``podFailurePolicy: FailJob``.
    Subsystems mix it into their own family, e.g. ``class ResumeSourceError(CheckpointError,
    NonRetryableError)``.
    """

    exit_code = 2


def is_non_retryable(exc: BaseException) -> bool:
    """True when ``exc`` (or an error it was raised from) is a :class:`NonRetryableError`."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, NonRetryableError):
            return True
        seen.add(id(cur))
        cur = cur.__cause__
    return False


class ConfigError(NonRetryableError, ValueError):
    """A configuration value, file or command-line option is invalid (a user mistake)."""

    exit_code = 2
