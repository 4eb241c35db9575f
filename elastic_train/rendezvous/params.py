"""Translate between torchrun's rendezvous parameters and :class:`RendezvousConfig`.

One table says what each handler does with each ``--rdzv-conf`` key (docs/rendezvous.md shows it next to
torch's ``c10d`` and ``etcd-v2``): our keys (lease_ttl, keepalive_interval, settle, join_timeout,
failure_budget, identity_wait, connect_timeout, rpc_timeout, user, password_env, password_file, ca_file,
cert_file, key_file), the keys torch's backends take that mean the same here (``timeout``, ``read_timeout``,
etcd-v2's ``protocol``/``ca_cert``/``ssl_cert``/``ssl_cert_key``), torch's DynamicRendezvousHandler keys
(``etcd3-dynamic``), and torch keys without a meaning here, which are ignored with a warning. Anything else
is refused with one clear line.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from elastic_train.errors import ConfigError
from elastic_train.etcd.config import TLSConfig
from elastic_train.etcd.endpoints import format_endpoints, parse_endpoints
from elastic_train.rendezvous.config import RendezvousConfig
from elastic_train.straggler.config import StragglerConfig

if TYPE_CHECKING:
    # Not imported at run time: importing torch's rendezvous package loads the torchrun.handlers entry
    # points, which import this module again (a cycle when this module is imported first).
    from torch.distributed.elastic.rendezvous.api import RendezvousParameters

#: Handler names (``--rdzv-backend``).
ETCD3 = "etcd3"
ETCD3_DYNAMIC = "etcd3-dynamic"

#: Our --rdzv-conf keys of the job's :class:`RendezvousConfig` (both handlers).
CONF_KEYS = (
    "lease_ttl",
    "settle",
    "join_window",
    "join_timeout",
    "failure_budget",
    "failure_window",
    "metrics_port",
    "keepalive_interval",
    "connect_timeout",
    "rpc_timeout",
    "identity_wait",
    "hot",
    "user",
    "password_env",
    "password_file",
    "ca_file",
    "cert_file",
    "key_file",
)
#: torch's names for our keys: torchrun's ``timeout`` (always passed) and etcd-v2's TLS files.
ALIASES = {
    "timeout": "join_timeout",
    "ca_cert": "ca_file",
    "ssl_cert": "cert_file",
    "ssl_cert_key": "key_file",
}
#: torch's DynamicRendezvousHandler keys (whole seconds / counts), accepted by ``etcd3-dynamic``.
DYNAMIC_KEYS = (
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "heartbeat_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
)
#: torch's keys that configure a store or transport we do not have: ignored with a warning.
IGNORED_KEYS = {
    "store_type": "the rendezvous store is etcd (c10d's tcp/file store types do not apply)",
    "is_host": "no agent hosts a rendezvous store for the whole job here",
}
#: What the etcd3 handler does instead of the DynamicRendezvousHandler keys (ignored there with a warning).
ETCD3_INSTEAD = {
    "last_call_timeout": "rounds close after `settle` seconds without a join",
    "close_timeout": "closing is one etcd write",
    "heartbeat_timeout": "liveness is an etcd lease (`lease_ttl`)",
    "keep_alive_interval": "the lease keep-alive interval is `keepalive_interval` (default lease_ttl/3)",
    "keep_alive_max_attempt": "liveness is an etcd lease (`lease_ttl`)",
}
#: Our etcd3 protocol keys, without effect under etcd3-dynamic (ignored there with a warning).
DYNAMIC_INSTEAD = {
    "lease_ttl": "liveness is torch's heartbeat (keep_alive_interval, heartbeat_timeout)",
    "keepalive_interval": "liveness is torch's heartbeat (keep_alive_interval, heartbeat_timeout)",
    "settle": "rounds close after torch's last_call_timeout",
    "join_window": "rounds close after torch's last_call_timeout",
    "failure_budget": "restarts are counted by torchrun's --max-restarts",
    "failure_window": "restarts are counted by torchrun's --max-restarts",
    "metrics_port": "the agent serves no metrics (docs/metrics.md: the etcd3 handler's)",
    "hot": "every membership change restarts the worker group",
}
#: Default of ``state_ttl`` (etcd3-dynamic): torch's etcd-v2 backend keeps its state two hours after a write.
DEFAULT_STATE_TTL = 7200
_FLOATS = (
    "lease_ttl",
    "settle",
    "join_window",
    "join_timeout",
    "keepalive_interval",
    "connect_timeout",
    "rpc_timeout",
    "identity_wait",
    "failure_window",
)
_INTS = ("failure_budget", "metrics_port")
_TLS = ("ca_file", "cert_file", "key_file")
#: Settings of :class:`StragglerConfig` and their types (rdzv-conf ``straggler`` and ``straggler_<name>``).
STRAGGLER_FIELDS: dict[str, type[int] | type[float] | type[str]] = {
    "policy": str,
    "threshold": float,
    "clear_below": float,
    "report_every": float,
    "window": int,
    "slow_steps": int,
    "slow_seconds": float,
    "warmup_reports": int,
    "max_evictions": int,
    "eviction_window": float,
    "probation_seconds": float,
    "max_trials": int,
    "probe_patience": float,
}


@dataclass(kw_only=True, slots=True)
class StoreOptions:
    """rdzv-conf keys of the handler's store (and of the etcd3-dynamic state) beyond the job config."""

    read_timeout: float | None = None
    """Seconds a blocking store read (get, wait, multi_get) waits; None: the handler's default."""
    state_ttl: int = DEFAULT_STATE_TTL
    """etcd3-dynamic: seconds the rendezvous state and store keys live after a node's last write."""
    dynamic: dict[str, int] = field(default_factory=dict)
    """etcd3-dynamic: torch's DynamicRendezvousHandler keys that were given, validated."""

    def __post_init__(self) -> None:
        if self.read_timeout is not None and not self.read_timeout > 0:
            raise ValueError(f"read_timeout: {self.read_timeout:g} must be > 0 seconds")
        if self.state_ttl < 1:
            raise ValueError(f"state_ttl: {self.state_ttl} must be >= 1 second")
        for key, value in self.dynamic.items():
            if value < 1:
                raise ValueError(f"{key}: {value} must be >= 1")
        interval = self.dynamic.get("keep_alive_interval", 5)
        if self.state_ttl <= interval:
            raise ValueError(
                f"state_ttl: {self.state_ttl} s must exceed keep_alive_interval ({interval} s), "
                "or the state expires between heartbeats"
            )


@dataclass(kw_only=True, slots=True)
class ParsedConf:
    """An rdzv-conf read for one handler."""

    config: RendezvousConfig
    """Connection and protocol settings (endpoint, run, TLS, auth, our etcd3 keys)."""
    store: StoreOptions
    """Store timeout and etcd3-dynamic settings."""
    ignored: dict[str, str]
    """Keys accepted but without effect here, with why (the handler logs a warning for each)."""


def _number(key: str, raw: Any, kind: type[int] | type[float]) -> Any:
    """``raw`` as a finite ``kind``, or a one-line :class:`ConfigError` naming the key."""
    try:
        value = kind(raw)
    except (TypeError, ValueError):
        value = None
    if value is None or not math.isfinite(value):
        what = "a whole number" if kind is int else "a number"
        raise ConfigError(f"rdzv-conf: {key}={raw!r} is not {what}")
    return value


def parse_conf(
    conf: Mapping[str, Any],
    *,
    backend: str = ETCD3,
    endpoint: str,
    run_id: str,
    min_nodes: int,
    max_nodes: int,
) -> ParsedConf:
    """Read an rdzv-conf for ``backend`` (``etcd3`` or ``etcd3-dynamic``); every value is checked.

    Raises:
        ConfigError: unknown key, a key of the other handler, a value of the wrong type, an invalid value.
    """
    assert backend in (ETCD3, ETCD3_DYNAMIC), backend
    dynamic = backend == ETCD3_DYNAMIC
    values: dict[str, Any] = {}
    tls: dict[str, str] = {}
    store: dict[str, Any] = {}
    torch_dynamic: dict[str, int] = {}
    ignored: dict[str, str] = {}
    protocol: str | None = None
    straggler: dict[str, Any] = {}
    explicit_join = "join_timeout" in conf
    for key, raw in conf.items():
        if key == "timeout" and explicit_join:
            continue
        if key == "timeout" and dynamic:
            # torchrun always passes it; torch's DynamicRendezvousHandler reads join_timeout only (as c10d).
            continue
        if dynamic and key in DYNAMIC_KEYS:
            torch_dynamic[key] = _number(key, raw, int)
            if key != "join_timeout":
                continue
        elif not dynamic and key in ETCD3_INSTEAD:
            ignored[key] = f"torch's DynamicRendezvousHandler key; in etcd3 {ETCD3_INSTEAD[key]}"
            continue
        elif dynamic and key in DYNAMIC_INSTEAD:
            ignored[key] = f"etcd3 handler key; in etcd3-dynamic {DYNAMIC_INSTEAD[key]}"
            continue
        if key in IGNORED_KEYS:
            ignored[key] = IGNORED_KEYS[key]
            continue
        if key == "read_timeout":
            store["read_timeout"] = _number(key, raw, float)
            continue
        if key == "state_ttl":
            if not dynamic:
                raise ConfigError(f"rdzv-conf: state_ttl applies to --rdzv-backend={ETCD3_DYNAMIC} only")
            store["state_ttl"] = _number(key, raw, int)
            continue
        if key == "protocol":
            protocol = str(raw).strip().lower()
            if protocol not in ("http", "https"):
                raise ConfigError(f"rdzv-conf: protocol={raw!r} must be http or https")
            continue
        if key == "straggler" or key.startswith("straggler_"):
            if dynamic:
                ignored[key] = "slow-node detection runs in the etcd3 handler only"
            else:
                straggler[key] = raw
            continue
        name = ALIASES.get(key, key)
        if name not in CONF_KEYS:
            known = [*CONF_KEYS, *ALIASES, "read_timeout", "protocol"]
            if dynamic:
                known += [k for k in DYNAMIC_KEYS if k not in known] + ["state_ttl"]
            raise ConfigError(f"rdzv-conf: unknown key {key!r} (known: {', '.join(known)})")
        if name in _FLOATS:
            values[name] = _number(key, raw, float)
        elif name in _INTS:
            values[name] = _number(key, raw, int)
        elif name == "hot":
            flag = str(raw).strip().lower()
            if flag not in ("0", "1", "true", "false", "yes", "no", "on", "off"):
                raise ConfigError(f"rdzv-conf: hot={raw!r} must be 1 or 0 (true or false)")
            values[name] = flag in ("1", "true", "yes", "on")
        elif name in _TLS:
            if name in tls:
                other = next(k for k in conf if k != key and ALIASES.get(k, k) == name)
                raise ConfigError(f"rdzv-conf: {other} and {key} name the same file; give one")
            tls[name] = str(raw)
        else:
            values[name] = str(raw)
    slow_nodes = straggler_config(straggler)
    if protocol == "https" and "ca_file" not in tls:
        raise ConfigError("rdzv-conf: protocol=https needs ca_file (or ca_cert): the etcd server's CA bundle")
    if protocol == "http" and tls:
        raise ConfigError(f"rdzv-conf: protocol=http contradicts {', '.join(sorted(tls))} (TLS); use https")
    try:
        config = RendezvousConfig(
            endpoint=endpoint,
            run_id=run_id,
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            tls=TLSConfig(**tls) if tls else None,
            straggler=slow_nodes,
            **values,
        )
        options = StoreOptions(**store, dynamic=torch_dynamic)
    except ValueError as exc:
        raise ConfigError(f"rdzv-conf: {exc}") from exc
    return ParsedConf(config=config, store=options, ignored=ignored)


def straggler_config(conf: Mapping[str, Any]) -> StragglerConfig:
    """The :class:`StragglerConfig` of the rdzv-conf keys ``straggler`` (the policy) and ``straggler_<name>``
    (each other setting, e.g. ``straggler_threshold=1.5``).

    Raises:
        ConfigError: an unknown setting, a value of the wrong type, or an invalid value.
    """
    values: dict[str, Any] = {}
    for key, raw in conf.items():
        name = "policy" if key == "straggler" else key[len("straggler_") :]
        if name not in STRAGGLER_FIELDS or (key != "straggler" and name == "policy"):
            known = ", ".join(["straggler", *(f"straggler_{f}" for f in STRAGGLER_FIELDS if f != "policy")])
            raise ConfigError(f"rdzv-conf: unknown key {key!r} (slow-node keys: {known})")
        kind = STRAGGLER_FIELDS[name]
        values[name] = _number(key, raw, kind) if kind is int or kind is float else str(raw).strip()
    try:
        return StragglerConfig(**values)
    except ValueError as exc:
        raise ConfigError(f"rdzv-conf: slow-node settings (straggler keys): {exc}") from None


def conf_to_config(
    conf: Mapping[str, Any], *, endpoint: str, run_id: str, min_nodes: int, max_nodes: int
) -> RendezvousConfig:
    """The ``etcd3`` handler's validated :class:`RendezvousConfig` for rdzv-conf style key/values.

    Raises:
        ConfigError: unknown key, a value of the wrong type, or an invalid value.
    """
    return parse_conf(conf, endpoint=endpoint, run_id=run_id, min_nodes=min_nodes, max_nodes=max_nodes).config


def parse_params(params: RendezvousParameters, *, backend: str = ETCD3) -> ParsedConf:
    """:func:`parse_conf` for torchrun's parameters (``params.config`` holds the rdzv-conf)."""
    return parse_conf(
        params.config,
        backend=backend,
        endpoint=params.endpoint or "127.0.0.1:2379",
        run_id=params.run_id,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
    )


def config_from_params(params: RendezvousParameters, *, backend: str = ETCD3) -> RendezvousConfig:
    """The :class:`RendezvousConfig` for torchrun's parameters (``params.config`` holds the rdzv-conf)."""
    return parse_params(params, backend=backend).config


def rdzv_conf(cfg: RendezvousConfig) -> dict[str, str]:
    """The ``--rdzv-conf`` key/values that reproduce ``cfg`` (defaults included, secrets never)."""
    out = {
        "lease_ttl": f"{cfg.lease_ttl:g}",
        "settle": f"{cfg.settle:g}",
        "join_timeout": f"{cfg.join_timeout:g}",
        "failure_budget": str(cfg.failure_budget),
        "failure_window": f"{cfg.failure_window:g}",
        "connect_timeout": f"{cfg.connect_timeout:g}",
        "rpc_timeout": f"{cfg.rpc_timeout:g}",
        "identity_wait": f"{cfg.identity_wait:g}",
        "hot": "1" if cfg.hot else "0",
    }
    if cfg.join_window is not None:
        out["join_window"] = f"{cfg.join_window:g}"
    default = StragglerConfig()
    out["straggler"] = cfg.straggler.policy
    for name in STRAGGLER_FIELDS:
        value = getattr(cfg.straggler, name)
        if name != "policy" and value != getattr(default, name):
            out[f"straggler_{name}"] = f"{value:g}"
    if cfg.metrics_port is not None:
        out["metrics_port"] = str(cfg.metrics_port)
    if cfg.keepalive_interval is not None:
        out["keepalive_interval"] = f"{cfg.keepalive_interval:g}"
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
    endpoint = format_endpoints(parse_endpoints(cfg.endpoint))
    return [
        f"--nnodes={cfg.min_nodes}:{cfg.max_nodes}",
        f"--nproc-per-node={cfg.nproc_per_node}",
        "--rdzv-backend=etcd3",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={cfg.run_id}",
        f"--rdzv-conf={conf}",
    ]


__all__ = [
    "CONF_KEYS",
    "ParsedConf",
    "StoreOptions",
    "conf_to_config",
    "config_from_params",
    "parse_conf",
    "parse_params",
    "rdzv_conf",
    "torchrun_args",
]
