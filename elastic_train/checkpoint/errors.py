"""The checkpoint exception family; every message is one line meant for the user."""

from __future__ import annotations

from elastic_train.errors import ConfigError, ElasticTrainError


class CheckpointError(ElasticTrainError):
    """Root of every checkpoint failure (storage, format, integrity, model mismatch, failed write)."""


class StorageError(CheckpointError):
    """A storage URL cannot be opened, read, written or listed (wraps fsspec / OS errors)."""


class CheckpointNotFound(CheckpointError):
    """No valid checkpoint exists where one was asked for."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint exists but is torn or corrupt (no manifest, missing file, size or sha256 mismatch)."""


class CheckpointSetupError(CheckpointError, ConfigError):
    """The job's checkpoint settings can never work: the checkpoint root is a file or not writable, the resume
    source does not exist or holds no valid checkpoint, the checkpoint is of another model. Restarting the
    workers cannot help, so it is not worth a retry (exit code 2, like any configuration error)."""

    exit_code = 2


class ModelMismatch(CheckpointSetupError):
    """A checkpoint was saved from a different model (parameter names, shapes or dtypes differ)."""


class WriteFailed(CheckpointError):
    """A background durable write failed (after its retries); raised in the training loop."""
