"""torchrun entry points (group ``torchrun.handlers``): ``etcd3`` and ``etcd3-dynamic``.

Each entry point is a zero-argument function returning the creator torch registers,
``(RendezvousParameters) -> RendezvousHandler``. A creator that cannot build its handler (a bad rdzv-conf,
etcd unreachable, TLS or authentication failure) prints one line, ``torchrun: error: ...``, and exits
(status 2 for a configuration mistake, 1 otherwise) instead of a traceback through torchrun.

This module is the top of the rendezvous package: nothing in elastic_train imports it (torch loads it through
the entry points whenever its own rendezvous package is imported). The handler and the backend are imported
when a creator runs, since both import torch's rendezvous package themselves.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
)

from elastic_train.errors import ElasticTrainError
from elastic_train.log import get_logger
from elastic_train.rendezvous.connect import open_etcd
from elastic_train.rendezvous.params import DYNAMIC_KEYS, ETCD3, parse_params

#: torch's DynamicRendezvousHandler shares a TCPStore across rounds unless this is "1" (see docs).
ENV_DISABLE_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"

Creator = Callable[[RendezvousParameters], RendezvousHandler]

log = get_logger(__name__)


def _exit_with_one_line(exc: BaseException, code: int) -> NoReturn:
    sys.stderr.write(f"torchrun: error: {exc}\n")
    sys.stderr.flush()
    raise SystemExit(code) from None


def _one_line_errors(create: Creator) -> Creator:
    """Turn a creator's configuration and connection errors into one line and an exit status."""

    @functools.wraps(create)
    def wrapper(params: RendezvousParameters) -> RendezvousHandler:
        try:
            return create(params)
        except ElasticTrainError as exc:
            _exit_with_one_line(exc, exc.exit_code)
        except RendezvousConnectionError as exc:
            _exit_with_one_line(exc, 1)

    return wrapper


def closed_run_exits(handler: RendezvousHandler) -> RendezvousHandler:
    """``handler`` (torch's DynamicRendezvousHandler, and still one: a drop-in keeps its type), except that
    a node finding the rendezvous closed leaves with one line and status 0 (:class:`RunFinished`) instead
    of a traceback.

    torch 2.13's agent returns ``None`` on the ``RendezvousGracefulExitError`` that handler raises for a
    node on its redundancy list (the launcher then fails on ``result.is_failed()``), and lets the
    ``RendezvousClosedError`` of a late node escape as a traceback. Only this instance's
    ``next_rendezvous`` is replaced; everything else is torch's.
    """
    inner = handler.next_rendezvous

    def next_rendezvous() -> RendezvousInfo:
        try:
            return inner()
        except (RendezvousClosedError, RendezvousGracefulExitError):
            from elastic_train.rendezvous.errors import RunFinished

            line = (
                f"rendezvous of run {handler.get_run_id()} is closed (its job ended); this node has nothing "
                "left to do"
            )
            sys.stderr.write(f"elastic-train: {line}\n")
            sys.stderr.flush()
            raise RunFinished(line) from None

    handler.next_rendezvous = next_rendezvous  # type: ignore[method-assign]
    return handler


def create_etcd3_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The ``etcd3`` handler for torchrun's parameters (docs/rendezvous.md lists the rdzv-conf keys).

    Raises:
        ConfigError: unknown rdzv-conf key or invalid value.
        EtcdError: etcd unreachable, TLS or authentication failure.
    """
    from elastic_train.rendezvous.handler import STORE_TIMEOUT, Etcd3RendezvousHandler
    from elastic_train.rendezvous.protocol import ProtocolSettings

    parsed = parse_params(params, backend=ETCD3)
    for key, why in parsed.ignored.items():
        log.warning("rdzv_conf_ignored", backend=ETCD3, key=key, reason=why)
    return Etcd3RendezvousHandler(
        open_etcd(parsed.config),
        ProtocolSettings.from_config(parsed.config),
        params.local_addr,
        store_timeout=parsed.store.read_timeout or STORE_TIMEOUT,
        metrics_port=parsed.config.metrics_port,
    )


def create_etcd3_dynamic_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's DynamicRendezvousHandler on the etcd v3 backend (:func:`create_backend`).

    Sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` unless the environment already chose: with the shared
    store, stale bootstrap keys survive rounds and scale-ups block (DESIGN.md, "Measured pitfalls").

    Raises:
        ConfigError: unknown rdzv-conf key or invalid value.
        RendezvousConnectionError: etcd unreachable, TLS or authentication failure.
    """
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    from elastic_train.rendezvous.backend import create_backend

    os.environ.setdefault(ENV_DISABLE_SHARED_STORE, "1")
    backend, store = create_backend(params)
    return create_handler(store, backend, params)


def torchrun_etcd3_dynamic_handler(params: RendezvousParameters) -> RendezvousHandler:
    """:func:`create_etcd3_dynamic_handler` as torchrun gets it: a closed rendezvous is one line, status 0."""
    return closed_run_exits(create_etcd3_dynamic_handler(params))


# One creator per backend for the life of the process: torch's registry refuses a second registration of a
# name with a creator that compares unequal (it logs a ValueError), and it registers the entry points again
# each time it is asked to (torch's own out-of-tree plugin test does).
_ETCD3 = _one_line_errors(create_etcd3_handler)
_ETCD3_DYNAMIC = _one_line_errors(torchrun_etcd3_dynamic_handler)


def etcd3() -> Creator:
    """Entry point ``etcd3`` (the same creator on every call)."""
    return _ETCD3


def etcd3_dynamic() -> Creator:
    """Entry point ``etcd3-dynamic`` (the same creator on every call)."""
    return _ETCD3_DYNAMIC


__all__ = ["DYNAMIC_KEYS", "etcd3", "etcd3_dynamic"]
