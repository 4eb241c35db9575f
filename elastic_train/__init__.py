"""elastic_train: fault-tolerant elastic training for PyTorch on an etcd v3 rendezvous.

The names below are the API for a training loop of your own (docs/own-loop.md). They are loaded on first
use: ``import elastic_train`` alone does not import torch, so the CLI and the config loader stay fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from elastic_train.elastic import (
        Checkpointer as Checkpointer,
    )
    from elastic_train.elastic import (
        ElasticBatchSampler as ElasticBatchSampler,
    )
    from elastic_train.elastic import (
        Stateful as Stateful,
    )
    from elastic_train.elastic import (
        TrainState as TrainState,
    )
    from elastic_train.elastic import (
        World as World,
    )
    from elastic_train.elastic import (
        current_world as current_world,
    )
    from elastic_train.elastic import (
        init as init,
    )
    from elastic_train.elastic import (
        shutdown as shutdown,
    )

_API = (
    "Checkpointer",
    "ElasticBatchSampler",
    "Stateful",
    "TrainState",
    "World",
    "current_world",
    "init",
    "shutdown",
)


def __getattr__(name: str) -> Any:
    if name in _API:
        from elastic_train import elastic

        return getattr(elastic, name)
    raise AttributeError(f"module 'elastic_train' has no attribute {name!r}")


__all__ = [*_API, "__version__"]
