"""etcd v3 rendezvous for torchrun: the ``etcd3`` handler, the ``etcd3-dynamic`` backend, job status.

Importing this package stays light (no torch, no gRPC): :func:`create_backend` is loaded on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_backend"]


def __getattr__(name: str) -> Any:
    if name == "create_backend":
        from elastic_train.rendezvous.backend import create_backend

        return create_backend
    raise AttributeError(name)
