"""A job's connection to etcd: its rendezvous settings, probed on the run's own keys."""

from __future__ import annotations

from elastic_train.etcd.client import Etcd, connect_config
from elastic_train.rendezvous.config import RendezvousConfig, run_prefix


def open_etcd(
    cfg: RendezvousConfig, *, timeout: float | None = None, connect_timeout: float | None = None
) -> Etcd:
    """Connect to the job's etcd with its TLS/auth settings; the probe reads the run's ``config`` key, so a
    user limited to the run prefix passes it.

    Args:
        cfg: the job's rendezvous settings.
        timeout: deadline of each RPC (default ``cfg.rpc_timeout``).
        connect_timeout: seconds to wait for an unreachable etcd (default ``cfg.connect_timeout``).

    Raises:
        EtcdError: unreachable, TLS or authentication problem (one line).
        ConfigError: a user without a password.
    """
    return connect_config(
        cfg, probe_key=run_prefix(cfg.run_id) + "config", timeout=timeout, connect_timeout=connect_timeout
    )
