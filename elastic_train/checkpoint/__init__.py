"""Checkpoints: a shared-memory tier every step, a durable fsspec tier every N steps, collective restore.

See docs/checkpoints.md for the layout, the manifest format and the recovery decision.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from elastic_train.checkpoint.config import CheckpointConfig
from elastic_train.checkpoint.errors import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointNotFound,
    CheckpointSetupError,
    ModelMismatch,
    StorageError,
    WriteFailed,
)

if TYPE_CHECKING:
    from elastic_train.checkpoint.manager import CheckpointManager, Committed, Restored

_LAZY = ("CheckpointManager", "Committed", "Restored")


def __getattr__(name: str) -> Any:
    # The manager needs torch; importing the package (config, errors) must not, so the CLI and the
    # config loader stay fast.
    if name in _LAZY:
        from elastic_train.checkpoint import manager

        return getattr(manager, name)
    raise AttributeError(name)


__all__ = [
    "CheckpointConfig",
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointNotFound",
    "CheckpointSetupError",
    "Committed",
    "ModelMismatch",
    "Restored",
    "StorageError",
    "WriteFailed",
]
