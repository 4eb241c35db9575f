"""Rendezvous settings of a job (the ``rendezvous:`` section of job.yaml), the settings a participant runs
with, and where a run's keys live."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from elastic_train.etcd.config import EtcdConfig
from elastic_train.rendezvous.identity import JobIdentity
from elastic_train.straggler.config import StragglerConfig

#: Every run's keys live under this etcd prefix.
ROOT = "/elastic_train/"
#: Largest failure budget (the run's ``budget`` record keeps one time per failure in the window).
MAX_FAILURE_BUDGET = 10_000
#: Longest failure window: 30 days.
MAX_FAILURE_WINDOW = 30 * 86400
#: Run ids become etcd key prefixes and Kubernetes-style names: keep them tame.
RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def validate_run_id(run_id: str) -> str:
    """Return ``run_id`` if it is valid, else raise ``ValueError`` naming it and the allowed form."""
    if not RUN_ID_PATTERN.match(run_id):
        raise ValueError(
            f"run_id: {run_id!r} is invalid (1-128 characters of letters, digits, '_', '.', '-', "
            "starting with a letter or digit)"
        )
    return run_id


def run_prefix(run_id: str) -> str:
    """The etcd key prefix of a run (the run id is validated: it must not escape the prefix)."""
    return f"{ROOT}{validate_run_id(run_id)}/"


@dataclass(kw_only=True, slots=True)
class RendezvousConfig(EtcdConfig):
    """Where and how the agents of a job meet: the etcd connection (:class:`EtcdConfig`: endpoint, TLS,
    user and password source, timeouts) and the rendezvous settings below."""

    run_id: str = "elastic-train"
    """Job identity; every etcd key of the job lives under a prefix made from it."""
    min_nodes: int = 1
    """Fewest nodes the job trains with."""
    max_nodes: int = 1
    """Most nodes the job trains with."""
    nproc_per_node: int = 1
    """Worker processes per node (one per GPU on GPU nodes)."""
    lease_ttl: float = 3.0
    """Seconds without a keep-alive after which a node counts as lost (a kill -9 or SIGSTOP)."""
    keepalive_interval: float | None = None
    """Seconds between lease keep-alives, also each keep-alive's deadline (default lease_ttl/3; at most
    lease_ttl/2, so that a lost keep-alive is retried, on another etcd member, before the lease expires)."""
    settle: float = 1.0
    """Seconds without a new joiner before a round with at least min_nodes closes."""
    join_window: float | None = None
    """Seconds after the first node asked for a follow-up round (a recovery or a resize) before the round
    closes without live nodes that have not asked yet (default: ``settle``). Shorter: a recovery waits less
    for a member that will not come; a member slower than the window misses the round and causes another."""
    join_timeout: float = 600.0
    """Seconds a node waits for a round to reach min_nodes before giving up."""
    failure_budget: int = 10
    """Worker-group failures the job may survive in any ``failure_window`` seconds (scale-ups and clean leaves
    on SIGTERM do not count)."""
    failure_window: float = 3600.0
    """Seconds over which failures count against ``failure_budget`` (0: the run's whole life). An hour: a
    crash loop spends any budget within minutes, while a job that lives for weeks forgets its old churn."""
    identity_wait: float = 120.0
    """Seconds a node whose settings differ from a live run's waits for that run's nodes to leave (a Job
    deleted moments ago) before it is refused; then it takes the run over."""

    metrics_port: int | None = None
    """Port the agent serves Prometheus metrics on (docs/metrics.md; 0: a free one; None: no metrics)."""

    hot: bool = True
    """Survivors of a membership change keep their worker processes and re-form the process group in-process
    (docs/rendezvous.md, "Hot recovery"); false: every change restarts every worker."""

    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    """Slow nodes: when a node counts as slow, and whether it is only reported or evicted
    (docs/stragglers.md)."""

    def __post_init__(self) -> None:
        validate_run_id(self.run_id)
        if self.min_nodes < 1:
            raise ValueError(f"min_nodes: {self.min_nodes} must be >= 1")
        if self.max_nodes < self.min_nodes:
            raise ValueError(f"max_nodes: {self.max_nodes} must be >= min_nodes ({self.min_nodes})")
        if self.nproc_per_node < 1:
            raise ValueError(f"nproc_per_node: {self.nproc_per_node} must be >= 1")
        if not 0.5 <= self.lease_ttl <= 600:
            raise ValueError(f"lease_ttl: {self.lease_ttl} must be between 0.5 and 600 seconds")
        if not 0 <= self.settle <= 600:
            raise ValueError(f"settle: {self.settle} must be between 0 and 600 seconds")
        if self.join_window is not None and not 0 <= self.join_window <= 600:
            raise ValueError(f"join_window: {self.join_window} must be between 0 and 600 seconds")
        if self.join_timeout <= 0:
            raise ValueError(f"join_timeout: {self.join_timeout} must be > 0")
        if not 0 <= self.identity_wait <= 3600:
            raise ValueError(f"identity_wait: {self.identity_wait} must be between 0 and 3600 seconds")
        if not 0 <= self.failure_budget <= MAX_FAILURE_BUDGET:
            raise ValueError(
                f"failure_budget: {self.failure_budget} must be between 0 and {MAX_FAILURE_BUDGET}"
            )
        if not (self.failure_window == 0 or 1 <= self.failure_window <= MAX_FAILURE_WINDOW):
            raise ValueError(
                f"failure_window: {self.failure_window:g} must be 0 (the run's whole life) or between 1 and "
                f"{MAX_FAILURE_WINDOW} seconds"
            )
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port: {self.metrics_port} is not a TCP port (0-65535)")
        if self.keepalive_interval is not None and not (
            0.05 <= self.keepalive_interval <= self.lease_ttl / 2
        ):
            raise ValueError(
                f"keepalive_interval: {self.keepalive_interval:g} s does not fit "
                f"lease_ttl {self.lease_ttl:g} s "
                "(it must be between 0.05 s and lease_ttl/2, so that a failed keep-alive is retried before "
                "the lease expires)"
            )
        # Not super(): a slots dataclass is a new class, and the zero-argument form would name the old one.
        EtcdConfig.__post_init__(self)

    @property
    def keepalive_every(self) -> float:
        """The effective keep-alive interval: ``keepalive_interval``, else a third of the lease TTL."""
        return self.keepalive_interval if self.keepalive_interval is not None else self.lease_ttl / 3.0


@dataclass(kw_only=True, slots=True)
class ProtocolSettings:
    """What one participant of a run runs with (from :class:`RendezvousConfig`, or torchrun's parameters)."""

    run_id: str
    min_nodes: int
    max_nodes: int
    lease_ttl: float = 3.0
    settle: float = 1.0
    join_window: float | None = None
    """Seconds after the first node asked for a follow-up round before it closes without the live nodes
    that have not asked (``None``: ``settle``)."""
    join_timeout: float = 600.0
    failure_budget: int = 10
    failure_window: float = 3600.0
    """Seconds over which ``failure_budget`` failures are counted (0: the run's whole life)."""
    keepalive_interval: float | None = None
    identity: JobIdentity | None = None
    """The settings every node of the run must share (``None``: not checked)."""
    identity_wait: float = 120.0
    """Seconds a node whose identity differs from a live run's waits for that run's nodes to go away."""
    hot: bool = True
    """Membership changes are handled by the workers in-process where they can (:mod:`.hot`)."""
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    """Slow-node detection and its policy (:mod:`.slownodes`)."""

    @classmethod
    def from_config(cls, cfg: RendezvousConfig) -> ProtocolSettings:
        """The protocol settings of a job's rendezvous config (the identity is left to the handler)."""
        return cls(
            run_id=cfg.run_id,
            min_nodes=cfg.min_nodes,
            max_nodes=cfg.max_nodes,
            lease_ttl=cfg.lease_ttl,
            settle=cfg.settle,
            join_window=cfg.join_window,
            join_timeout=cfg.join_timeout,
            failure_budget=cfg.failure_budget,
            failure_window=cfg.failure_window,
            keepalive_interval=cfg.keepalive_interval,
            identity_wait=cfg.identity_wait,
            hot=cfg.hot,
            straggler=cfg.straggler,
        )
