"""Translate between torchrun's rendezvous parameters and :class:`RendezvousConfig`.

``--rdzv-conf`` keys of the ``etcd3`` handler: lease_ttl, settle, join_timeout (alias timeout),
failure_budget, user, password_env, password_file, ca_file, cert_file, key_file. Anything else is refused
with one clear line.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from elastic_train.errors import ConfigError
from elastic_train.etcd.client import read_password
from elastic_train.rendezvous.config import RendezvousConfig, TLSConfig

if TYPE_CHECKING:
    # Not imported at run time: importing torch's rendezvous package loads the torchrun.handlers entry
    # points, which import this module again (a cycle when this module is imported first).
    from torch.distributed.elastic.rendezvous.api import RendezvousParameters

#: Our --rdzv-conf keys (``timeout`` is torchrun's name for the join timeout; torchrun always passes it).
CONF_KEYS = (
    "lease_ttl",
    "settle",
    "join_timeout",
    "failure_budget",
    "identity_wait",
    "user",
    "password_env",
    "password_file",
    "ca_file",
    "cert_file",
    "key_file",
)
ALIASES = {"timeout": "join_timeout"}
#: torch's DynamicRendezvousHandler keys, accepted by ``etcd3-dynamic``.
DYNAMIC_KEYS = (
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "heartbeat_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
)
_FLOATS = ("lease_ttl", "settle", "join_timeout", "identity_wait")
_INTS = ("failure_budget",)


def conf_to_config(
    conf: Mapping[str, Any],
    *,
    endpoint: str,
    run_id: str,
    min_nodes: int,
    max_nodes: int,
    allowed_extra: tuple[str, ...] = (),
) -> RendezvousConfig:
    """Build a validated config from rdzv-conf style key/values.

    Raises:
        ConfigError: unknown key, a value of the wrong type, or an invalid value.
    """
    values: dict[str, Any] = {}
    tls: dict[str, str] = {}
    explicit_join = "join_timeout" in conf
    for key, raw in conf.items():
        if key in allowed_extra:
            continue
        name = ALIASES.get(key, key)
        if key == "timeout" and explicit_join:
            continue
        if name not in CONF_KEYS:
            raise ConfigError(
                f"rdzv-conf: unknown key {key!r} (known: {', '.join(CONF_KEYS + tuple(ALIASES))})"
            )
        try:
            if name in _FLOATS:
                values[name] = float(raw)
            elif name in _INTS:
                values[name] = int(raw)
            elif name in ("ca_file", "cert_file", "key_file"):
                tls[name] = str(raw)
            else:
                values[name] = str(raw)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"rdzv-conf: {key}={raw!r} is not a number") from exc
    try:
        return RendezvousConfig(
            endpoint=endpoint,
            run_id=run_id,
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            tls=TLSConfig(**tls) if tls else None,
            **values,
        )
    except ValueError as exc:
        raise ConfigError(f"rdzv-conf: {exc}") from exc


def config_from_params(
    params: RendezvousParameters, *, allowed_extra: tuple[str, ...] = ()
) -> RendezvousConfig:
    """The :class:`RendezvousConfig` for torchrun's parameters (``params.config`` holds the rdzv-conf)."""
    return conf_to_config(
        params.config,
        endpoint=params.endpoint or "127.0.0.1:2379",
        run_id=params.run_id,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        allowed_extra=allowed_extra,
    )


def rdzv_conf(cfg: RendezvousConfig) -> dict[str, str]:
    """The ``--rdzv-conf`` key/values that reproduce ``cfg`` (defaults included, secrets never)."""
    out = {
        "lease_ttl": f"{cfg.lease_ttl:g}",
        "settle": f"{cfg.settle:g}",
        "join_timeout": f"{cfg.join_timeout:g}",
        "failure_budget": str(cfg.failure_budget),
        "identity_wait": f"{cfg.identity_wait:g}",
    }
    if cfg.user is not None:
        out["user"] = cfg.user
        out["password_env"] = cfg.password_env
        if cfg.password_file:
            out["password_file"] = cfg.password_file
    if cfg.tls is not None:
        for name in ("ca_file", "cert_file", "key_file"):
            value = getattr(cfg.tls, name)
            if value:
                out[name] = value
    return out


def torchrun_args(cfg: RendezvousConfig) -> list[str]:
    """torchrun flags for ``cfg``: node range, processes per node, the etcd3 backend, endpoint, id, conf."""
    conf = ",".join(f"{k}={v}" for k, v in rdzv_conf(cfg).items())
    for value in rdzv_conf(cfg).values():
        if "," in value or "=" in value:
            raise ConfigError(f"rdzv-conf value {shlex.quote(value)} must not contain ',' or '='")
    endpoint = ",".join(ep.strip() for ep in cfg.endpoint.split(","))
    return [
        f"--nnodes={cfg.min_nodes}:{cfg.max_nodes}",
        f"--nproc-per-node={cfg.nproc_per_node}",
        "--rdzv-backend=etcd3",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={cfg.run_id}",
        f"--rdzv-conf={conf}",
    ]


__all__ = ["CONF_KEYS", "conf_to_config", "config_from_params", "rdzv_conf", "read_password", "torchrun_args"]
