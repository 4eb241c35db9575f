"""How to reach etcd and log in: endpoints, TLS, credentials, timeouts.

The rendezvous settings of a job (:class:`elastic_train.rendezvous.config.RendezvousConfig`) extend
:class:`EtcdConfig`, so job.yaml's ``rendezvous:`` section keeps these keys next to the rendezvous ones.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from elastic_train.errors import ConfigError
from elastic_train.etcd.endpoints import parse_endpoints

#: Environment variable holding the etcd password unless the config names another.
DEFAULT_PASSWORD_ENV = "ELASTIC_TRAIN_ETCD_PASSWORD"


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
class EtcdConfig:
    """Where etcd is and how to log in to it (the password itself is never part of a config)."""

    endpoint: str = "127.0.0.1:2379"
    """etcd client endpoint(s), HOST[:PORT] (port 2379 when absent), comma-separated for a cluster."""
    connect_timeout: float = 60.0
    """Seconds a starting node waits for etcd to become reachable (an etcd still starting, a member
    restarting) before it fails; wrong credentials and TLS errors fail at once."""
    rpc_timeout: float = 5.0
    """Deadline of each etcd request, and of each gRPC connection attempt; raise it for a slow or loaded
    etcd far away."""
    user: str | None = None
    """etcd user name for password authentication."""
    password_env: str = DEFAULT_PASSWORD_ENV
    """Environment variable holding the etcd password (never pass a password on the command line)."""
    password_file: str | None = None
    """File holding the etcd password; used when the environment variable is unset."""
    tls: TLSConfig | None = None
    """TLS settings; plain text when absent."""

    def __post_init__(self) -> None:
        if not 0 <= self.connect_timeout <= 3600:
            raise ValueError(f"connect_timeout: {self.connect_timeout} must be between 0 and 3600 seconds")
        if not 0.1 <= self.rpc_timeout <= 300:
            raise ValueError(f"rpc_timeout: {self.rpc_timeout} must be between 0.1 and 300 seconds")
        try:
            parse_endpoints(self.endpoint)
        except ValueError as exc:
            raise ValueError(f"endpoint: {exc}") from None

    def read_password(self) -> str | None:
        """The etcd password: env var ``password_env``, else ``password_file``; None without a user.

        Raises:
            ConfigError: a user is set but no password is found, or the file cannot be read.
        """
        if self.user is None:
            return None
        value = os.environ.get(self.password_env)
        if value:
            return value
        if self.password_file:
            try:
                with open(self.password_file, encoding="utf-8") as f:
                    return f.read().rstrip("\r\n")
            except OSError as exc:
                raise ConfigError(
                    f"password_file {self.password_file!r} cannot be read ({exc.strerror})"
                ) from exc
        raise ConfigError(
            f"etcd user {self.user!r} is set but no password: "
            f"set ${self.password_env} or rdzv-conf password_file"
        )
