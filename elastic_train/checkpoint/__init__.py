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
    from elastic_train.checkpoint.manager import CheckpointManager
    from elastic_train.checkpoint.restore import Restored
    from elastic_train.checkpoint.writer import Committed

#: The names that need torch, and the module each lives in.
_LAZY = {"CheckpointManager": "manager", "Committed": "writer", "Restored": "restore"}


def __getattr__(name: str) -> Any:
    # The manager needs torch; importing the package (config, errors) must not, so the CLI and the
    # config loader stay fast.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"elastic_train.checkpoint.{_LAZY[name]}"), name)
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
