"""Errors of the training subsystem."""

from __future__ import annotations

from elastic_train.errors import ElasticTrainError, NonRetryableError


class TrainingError(ElasticTrainError):
    """Training cannot go on (bad task, incompatible state, broken collective set-up)."""


class ReformAbandoned(TrainingError):
    """The group could not be re-formed in-process; the worker exits and its agent restarts it (the restart
    path: not a failure of the script's own)."""


class TaskError(TrainingError, NonRetryableError):
    """The configured task cannot be loaded or does not return a valid ``Task`` (the same on every retry)."""

    exit_code = 2


class NotStateful(TrainingError, TypeError):
    """An object given to the training state cannot be checkpointed (no state_dict/load_state_dict)."""

    exit_code = 2


class StateMismatch(TrainingError):
    """A restored state does not fit the objects it is loaded into (other optimizer, changed dataset …)."""

    exit_code = 2
