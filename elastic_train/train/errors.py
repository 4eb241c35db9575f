"""Errors of the training subsystem."""

from __future__ import annotations

from elastic_train.errors import ElasticTrainError, NonRetryableError


class TrainingError(ElasticTrainError):
    """Training cannot go on (bad task, incompatible state, broken collective set-up)."""


class TaskError(TrainingError, NonRetryableError):
    """The configured task cannot be loaded or does not return a valid ``Task`` (the same on every retry)."""

    exit_code = 2
