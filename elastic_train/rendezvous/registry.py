"""torchrun entry points (group ``torchrun.handlers``): ``etcd3`` and ``etcd3-dynamic``.

Each entry point is a zero-argument function returning the creator torch registers,
``(RendezvousParameters) -> RendezvousHandler``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from torch.distributed.elastic.rendezvous.api import RendezvousHandler, RendezvousParameters

from elastic_train.etcd.client import Etcd, connect_config
from elastic_train.rendezvous.config import RendezvousConfig
from elastic_train.rendezvous.params import DYNAMIC_KEYS, config_from_params

if TYPE_CHECKING:
    from elastic_train.rendezvous.protocol import ProtocolSettings

#: torch's DynamicRendezvousHandler shares a TCPStore across rounds unless this is "1" (see docs).
ENV_DISABLE_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"

Creator = Callable[[RendezvousParameters], RendezvousHandler]


def open_etcd(cfg: RendezvousConfig, timeout: float = 5.0) -> Etcd:
    """Connect to the job's etcd with its TLS/auth settings; the probe reads the run's own prefix.

    Raises:
        EtcdError: unreachable, TLS or authentication problem (one line).
        ConfigError: a user without a password.
    """
    return Etcd(connect_config(cfg, timeout))


def settings_from_config(cfg: RendezvousConfig) -> ProtocolSettings:
    from elastic_train.rendezvous.protocol import ProtocolSettings

    return ProtocolSettings(
        run_id=cfg.run_id,
        min_nodes=cfg.min_nodes,
        max_nodes=cfg.max_nodes,
        lease_ttl=cfg.lease_ttl,
        settle=cfg.settle,
        join_timeout=cfg.join_timeout,
        failure_budget=cfg.failure_budget,
        identity_wait=cfg.identity_wait,
    )


def create_etcd3_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The ``etcd3`` handler for torchrun's parameters (our --rdzv-conf keys only)."""
    from elastic_train.rendezvous.handler import Etcd3RendezvousHandler

    cfg = config_from_params(params)
    return Etcd3RendezvousHandler(open_etcd(cfg), settings_from_config(cfg), params.local_addr)


def create_etcd3_dynamic_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's DynamicRendezvousHandler on the etcd v3 backend (:func:`create_backend`).

    Sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` unless the environment already chose: with the shared
    store, stale bootstrap keys survive rounds and scale-ups block (DESIGN.md, "Measured pitfalls").
    """
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    from elastic_train.rendezvous.backend import create_backend

    os.environ.setdefault(ENV_DISABLE_SHARED_STORE, "1")
    backend, store = create_backend(params)
    return create_handler(store, backend, params)


def etcd3() -> Creator:
    """Entry point ``etcd3``."""
    return create_etcd3_handler


def etcd3_dynamic() -> Creator:
    """Entry point ``etcd3-dynamic``."""
    return create_etcd3_dynamic_handler


__all__ = ["DYNAMIC_KEYS", "etcd3", "etcd3_dynamic", "open_etcd"]
