"""Rendezvous settings of a job (the ``rendezvous:`` section of job.yaml)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from elastic_train.etcd.endpoints import parse_endpoints

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


@dataclass(kw_only=True, slots=True)
class TLSConfig:
    """TLS material for talking to etcd; all paths are local files."""

    ca_file: str | None = None
    """CA bundle that signed the etcd server certificate."""
    cert_file: str | None = None
    """Client certificate (mutual TLS); needs key_file."""
    key_file: str | None = None
    """Private key of the client certificate."""

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file/key_file: give both or neither")

    @property
    def enabled(self) -> bool:
        return self.ca_file is not None or self.cert_file is not None


@dataclass(kw_only=True, slots=True)
class RendezvousConfig:
    """Where and how the agents of a job meet."""

    endpoint: str = "127.0.0.1:2379"
    """etcd client endpoint(s), HOST[:PORT] (port 2379 when absent), comma-separated for a cluster."""
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
    connect_timeout: float = 60.0
    """Seconds a starting node waits for etcd to become reachable (an etcd still starting, a member
    restarting) before it fails; wrong credentials and TLS errors fail at once."""
    rpc_timeout: float = 5.0
    """Deadline of each etcd request, and of each gRPC connection attempt; raise it for a slow or loaded
    etcd far away."""
    settle: float = 1.0
    """Seconds without a new joiner before a round with at least min_nodes closes."""
    join_timeout: float = 600.0
    """Seconds a node waits for a round to reach min_nodes before giving up."""
    failure_budget: int = 10
    """Worker-group failures the whole job may survive (scale-ups do not count)."""
    identity_wait: float = 120.0
    """Seconds a node whose settings differ from a live run's waits for that run's nodes to leave (a Job
    deleted moments ago) before it is refused; then it takes the run over."""
    user: str | None = None
    """etcd user name for password authentication."""
    password_env: str = "ELASTIC_TRAIN_ETCD_PASSWORD"
    """Environment variable holding the etcd password (never pass a password on the command line)."""
    password_file: str | None = None
    """File holding the etcd password; used when the environment variable is unset."""
    tls: TLSConfig | None = None
    """TLS settings; plain text when absent."""

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
        if self.join_timeout <= 0:
            raise ValueError(f"join_timeout: {self.join_timeout} must be > 0")
        if not 0 <= self.identity_wait <= 3600:
            raise ValueError(f"identity_wait: {self.identity_wait} must be between 0 and 3600 seconds")
        if self.failure_budget < 0:
            raise ValueError(f"failure_budget: {self.failure_budget} must be >= 0")
        if not 0 <= self.connect_timeout <= 3600:
            raise ValueError(f"connect_timeout: {self.connect_timeout} must be between 0 and 3600 seconds")
        if not 0.1 <= self.rpc_timeout <= 300:
            raise ValueError(f"rpc_timeout: {self.rpc_timeout} must be between 0.1 and 300 seconds")
        if self.keepalive_interval is not None and not (
            0.05 <= self.keepalive_interval <= self.lease_ttl / 2
        ):
            raise ValueError(
                f"keepalive_interval: {self.keepalive_interval:g} s does not fit "
                f"lease_ttl {self.lease_ttl:g} s "
                "(it must be between 0.05 s and lease_ttl/2, so that a failed keep-alive is retried before "
                "the lease expires)"
            )
        try:
            parse_endpoints(self.endpoint)
        except ValueError as exc:
            raise ValueError(f"endpoint: {exc}") from None

    @property
    def keepalive_every(self) -> float:
        """The effective keep-alive interval: ``keepalive_interval``, else a third of the lease TTL."""
        return self.keepalive_interval if self.keepalive_interval is not None else self.lease_ttl / 3.0
