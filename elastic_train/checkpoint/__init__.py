"""Checkpoints: a shared-memory tier every step, a durable fsspec tier every N steps, collective restore.

See docs/checkpoints.md for the layout, the manifest format and the recovery decision.
"""

from __future__ import annotations

from elastic_train.checkpoint.config import CheckpointConfig
from elastic_train.checkpoint.errors import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointNotFound,
    ModelMismatch,
    StorageError,
    WriteFailed,
)
from elastic_train.checkpoint.manager import CheckpointManager, Committed, Restored

__all__ = [
    "CheckpointConfig",
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointNotFound",
    "Committed",
    "ModelMismatch",
    "Restored",
    "StorageError",
    "WriteFailed",
]
