"""elastic_train: fault-tolerant elastic training for PyTorch on an etcd v3 rendezvous.

The names below are the API for a training loop of your own (docs/own-loop.md). They are loaded on first
use: ``import elastic_train`` alone does not import torch, so the CLI and the config loader stay fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from elastic_train.version import __version__

if TYPE_CHECKING:
    from elastic_train.elastic import (
        Checkpointer,
        ElasticBatchSampler,
        Stateful,
        TrainState,
        World,
        current_world,
        device_mesh,
        init,
        load_full,
        run,
        shard_model,
        shutdown,
        time_collectives,
    )

__all__ = [
    "Checkpointer",
    "ElasticBatchSampler",
    "Stateful",
    "TrainState",
    "World",
    "__version__",
    "current_world",
    "device_mesh",
    "init",
    "load_full",
    "run",
    "shard_model",
    "shutdown",
    "time_collectives",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from elastic_train import elastic

        return getattr(elastic, name)
    raise AttributeError(f"module 'elastic_train' has no attribute {name!r}")
