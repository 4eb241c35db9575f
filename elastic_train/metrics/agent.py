"""The agent's Prometheus metrics (``prometheus-client``) and their HTTP endpoint, on an opt-in port.

Event counters live here, in this module's :data:`REGISTRY`, so any part of the agent increments them without
knowing where they are served: :func:`count_fence`, :func:`observe_recovery`. Figures
read at scrape time (the run's round, world size, failure budget, and the workers' figures) come from
collectors the rendezvous adds (:func:`add_collector`; :mod:`elastic_train.rendezvous.observe`).

Every sample carries the run id as the label ``run_id``, so one Prometheus (and one dashboard) tells the
jobs on one etcd apart. docs/metrics.md lists every metric.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

from elastic_train.log import get_logger

log = get_logger(__name__)

REGISTRY = CollectorRegistry(auto_describe=True)
"""Everything one agent serves (not prometheus-client's global registry: no process metrics of its own)."""

#: Buckets of the recovery histogram (seconds): hot recoveries take about a second, restarts several,
#: a resume from durable storage or a wait for a replacement node minutes.
RECOVERY_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
#: What brought a recovery about (the round record's kind) and how the workers came back.
RECOVERY_KINDS = ("failure", "leave", "scale")
RECOVERY_PATHS = ("hot", "restart")

RECOVERIES = Histogram(
    "elastic_train_recovery_seconds",
    "Seconds from the first node asking for a new round to this node's first step in it, by what caused the "
    "round (failure, leave, scale) and how the workers came back (hot: in-process; restart: new processes)",
    ["run_id", "kind", "path"],
    buckets=RECOVERY_BUCKETS,
    registry=REGISTRY,
)
FENCES = Counter(
    "elastic_train_fences",
    "Times this node fenced itself off (its lease lost, or etcd silent while its workers were blocked)",
    ["run_id", "reason"],
    registry=REGISTRY,
)

_lock = threading.Lock()
_run_id = ""
_server: Any = None


def run_id() -> str:
    """The run this agent's metrics are labelled with (set by :func:`serve`)."""
    return _run_id


def observe_recovery(kind: str, path: str, seconds: float) -> None:
    RECOVERIES.labels(_run_id, kind, path).observe(max(0.0, seconds))


def count_fence(reason: str) -> None:
    FENCES.labels(_run_id, reason).inc()


def add_collector(collector: Collector) -> None:
    """Serve what ``collector`` yields at each scrape as well."""
    REGISTRY.register(collector)


def remove_collector(collector: Collector) -> None:
    with contextlib.suppress(KeyError):
        REGISTRY.unregister(collector)


def serve(port: int, addr: str, run: str) -> int:
    """Serve :data:`REGISTRY` on ``http://ADDR:PORT/metrics`` from a daemon thread (once per process);
    returns the port (``port`` 0: a free one).

    Raises:
        OSError: the port cannot be bound.
    """
    global _server, _run_id
    with _lock:
        _run_id = run
        for kind in RECOVERY_KINDS:  # every series exists from the start: rate() and dashboards see zeros
            for path in RECOVERY_PATHS:
                RECOVERIES.labels(run, kind, path)
        if _server is None:
            _server, _ = start_http_server(port, addr=addr, registry=REGISTRY)
        bound = int(_server.server_port)
    log.info("metrics_serving", port=bound, addr=addr or "0.0.0.0", path="/metrics")
    return bound


def stop() -> None:
    """Stop serving (tests; an agent serves until it exits)."""
    global _server
    with _lock:
        if _server is not None:
            _server.shutdown()
            _server.server_close()
            _server = None
